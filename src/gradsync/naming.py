"""How the adapters name the collectives they derive from a list of variables or a pytree.

Ranks match collectives by name, so a derived name must be the same on every rank for the same
program and must not repeat among collectives that are in flight together. Framework labels are
not unique on their own: Keras 3 names both Dense layers' weights ``kernel``, TensorFlow 2 names
every unnamed variable ``Variable:0``, a pytree's key paths may repeat in a custom node. So the
position in the list (or among the leaves) makes a name unique and the label keeps it readable:
both depend on the program only, never on a rank's own state (an ``id()``, a counter).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def indexed(prefix: str, labels: Sequence[str | None]) -> list[str]:
    """Member ``i`` of a list named ``<prefix>.<i>.<label>`` (``<prefix>.<i>`` without a label):
    unique within the list whatever the labels are.

    >>> indexed("b", ["kernel", "bias", "kernel", None])
    ['b.0.kernel', 'b.1.bias', 'b.2.kernel', 'b.3']
    """
    return [f"{prefix}.{i}" if not label else f"{prefix}.{i}.{label}" for i, label in enumerate(labels)]


def deduplicated(names: Sequence[str]) -> list[str]:
    """``names`` with every name that occurs more than once suffixed by ``#<position>``, its
    position in the list; a name that occurs once is kept as it is (readable, and stable for the
    response cache). Should a suffixed name meet a given one (``["a", "a", "a#1"]``), every name
    is suffixed: the text after the last ``#`` is then the position, which tells them apart.

    >>> deduplicated(["w['a']", "w[0]", "w[0]"])
    ["w['a']", 'w[0]#1', 'w[0]#2']
    """
    counts = Counter(names)
    if all(count == 1 for count in counts.values()):
        return list(names)
    suffixed = [f"{name}#{i}" if counts[name] > 1 else name for i, name in enumerate(names)]
    if len(set(suffixed)) == len(suffixed):
        return suffixed
    return [f"{name}#{i}" for i, name in enumerate(names)]
