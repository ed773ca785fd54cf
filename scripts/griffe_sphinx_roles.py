"""A griffe extension for the API reference (mkdocs.yml): Sphinx markup in docstrings as Markdown.

Some docstrings use reST roles (``:func:`synchronize```, ``:class:`~gradsync.handles.Handle```) and
``::`` before a literal block. mkdocstrings renders docstrings as Markdown, where those would show
verbatim; this turns each role into inline code (the last dotted part for ``~``) and ``::`` into
``:``, so that the indented block after it is a code block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|data|mod|exc|obj|const):`(~?)([^`]+)`")
LITERAL_BLOCK = re.compile(r"(\S)::$", re.MULTILINE)


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def markdown(text: str) -> str:
    """``text`` with reST roles as inline code and ``word::`` literal-block markers as ``word:``."""
    return LITERAL_BLOCK.sub(r"\1:", ROLE.sub(_code, text))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring griffe loads with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
