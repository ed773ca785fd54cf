"""No two modules of src/gradsync import each other, directly or through others.

The imports are read with ``ast`` (nothing is imported): every ``import gradsync...`` and every
``from ... import ...`` that names a gradsync module, at module level, under ``if TYPE_CHECKING:``
and inside functions alike. Imports inside functions are counted too: none is needed to break a
circle today (the ones there defer a framework or MPI itself: ``gradsync.__getattr__`` importing
``gradsync.torch``, ``runtime.init`` importing the coordinator, which imports mpi4py.MPI, the
NCCL backend loaded on first GPU use), so the rule is the strict one. An edge goes to the module
named (``from . import dtypes`` is an edge to ``gradsync.arrays.dtypes``; ``from .ops import poll`` to
``gradsync.ops``); a package's ``__init__`` counts as the package's module, and importing a
submodule is not counted as importing its parent package (Python runs the parent's
``__init__`` first, but the parent importing its children is how packages are built).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the gradsync package under ``src``: dotted name -> file."""
    found = {}
    for path in sorted((src / "gradsync").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The gradsync modules that module ``name`` (file ``path``) imports, anywhere in the file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name.split(".")[0] == "gradsync"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "gradsync":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return {target for target in targets if target in known and target != name}


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the gradsync modules it imports."""
    known = modules(src)
    return {name: imported(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def test_no_module_of_gradsync_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_walk_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    package = tmp_path / "gradsync"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n")
    (package / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["gradsync.a"] == {"gradsync.sub.b"}
    assert graph["gradsync.sub.b"] == {"gradsync.c"}
    assert find_cycle(graph) == ["gradsync.a", "gradsync.sub.b", "gradsync.c", "gradsync.a"]
    (package / "c.py").write_text("import numpy\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_import_gradsync_leaves_ml_dtypes_until_bfloat16_is_used():
    """ml_dtypes costs ~0.5 s of CPU to import, paid by every process of every (re)launch; gradsync
    imports it on the first bfloat16 lookup only."""
    import subprocess
    import sys

    code = ("import sys, numpy as np, gradsync\nfrom gradsync.arrays import dtypes\n"
            "before = 'ml_dtypes' in sys.modules\n"
            "print(before, dtypes.dtype_name(np.dtype(np.float32)), 'ml_dtypes' in sys.modules,\n"
            "      dtypes.dtype_name(dtypes.NUMPY_DTYPES['bfloat16']), 'ml_dtypes' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert done.stdout.split() == ["False", "float32", "False", "bfloat16", "True"], done.stderr
