"""Every module path a user imports keeps working after the core moved into layer packages (issue 38).

The core lives in ``engine/``, ``executors/``, ``backends/``, ``arrays/``, ``process/`` and
``torch/reducer/``; those are gradsync's own. What a user imports stays where it was: the public API
modules at the top, ``gradsync.torch`` with the submodules that mirror ``horovod.torch``'s, the other
framework packages, and the ``python -m`` entry points. Each path below is imported and must be a
file at that very path in this checkout (not a stale installed copy). The names inside
``gradsync.torch`` are Horovod's: tests/test_horovod_namespace.py checks them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

CORE = ["gradsync", "gradsync.ops", "gradsync.handles", "gradsync.errors", "gradsync.process_sets",
        "gradsync.metrics", "gradsync.compression", "gradsync.config", "gradsync.timeline",
        "gradsync.check", "gradsync.elastic", "gradsync.run", "gradsync.run.driver",
        # the NCCL binding: docs/gpu.md's example has `from gradsync.backends import nccl_api`
        "gradsync.backends", "gradsync.backends.nccl_api"]
# horovod.torch's submodules, then gradsync.torch's own that docs/ shows users.
TORCH = ["gradsync.torch", "gradsync.torch.mpi_ops", "gradsync.torch.optimizer",
         "gradsync.torch.compression", "gradsync.torch.functions", "gradsync.torch.sync_batch_norm",
         "gradsync.torch.elastic", "gradsync.torch.comm_hooks", "gradsync.torch.zero",
         "gradsync.torch.zero_state", "gradsync.torch.array"]
# Framework packages: (module, the markers of tests/conftest.py that skip it where it cannot import).
FRAMEWORKS = [
    ("gradsync.jax", ("jax",)), ("gradsync.jax.elastic", ("jax",)), ("gradsync.jax.array", ("jax",)),
    ("gradsync.tensorflow", ("tensorflow",)), ("gradsync.tensorflow.mpi_ops", ("tensorflow",)),
    ("gradsync.tensorflow.compression", ("tensorflow",)), ("gradsync.tensorflow.elastic", ("tensorflow",)),
    ("gradsync.tensorflow.util", ("tensorflow",)),
    ("gradsync.keras", ("keras",)), ("gradsync.keras.callbacks", ("keras",)),
    ("gradsync.keras.elastic", ("keras",)),
    # horovod.tensorflow.keras's paths, for gradsync.keras
    ("gradsync.tensorflow.keras", ("tensorflow", "keras")),
    ("gradsync.tensorflow.keras.callbacks", ("tensorflow", "keras")),
    ("gradsync.tensorflow.keras.elastic", ("tensorflow", "keras")),
    ("gradsync.lightning", ("torch", "lightning")),
    ("gradsync.ray", ("ray",)),
]
ENTRY_POINTS = ["gradsync.check", "gradsync.timeline", "gradsync.run"]  # python -m gradsync.X


def framework_param(module: str, markers: tuple[str, ...]):
    return pytest.param(module, marks=[getattr(pytest.mark, m) for m in markers], id=module)


def assert_imports_from_its_own_path(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__name__ == name
    relative = Path(*name.split("."))
    expected = {SRC / relative.with_suffix(".py"), SRC / relative / "__init__.py"}
    assert Path(module.__file__).resolve() in expected, (name, module.__file__)


@pytest.mark.parametrize("name", CORE)
def test_the_public_modules_import_from_their_paths(name):
    assert_imports_from_its_own_path(name)


@pytest.mark.torch
@pytest.mark.parametrize("name", TORCH)
def test_gradsync_torch_and_its_horovod_submodules_import_from_their_paths(name):
    assert_imports_from_its_own_path(name)


@pytest.mark.parametrize("name", [framework_param(m, markers) for m, markers in FRAMEWORKS])
def test_the_framework_packages_import_from_their_paths(name):
    assert_imports_from_its_own_path(name)


@pytest.mark.tensorflow
@pytest.mark.keras
def test_horovods_tensorflow_keras_path_gives_gradsync_keras_own_objects():
    """``import horovod.tensorflow.keras as hvd`` ported as ``gradsync.tensorflow.keras``: the same
    functions and classes as gradsync.keras (not copies: isinstance and registries agree)."""
    keras_path = importlib.import_module("gradsync.keras")
    tf_path = importlib.import_module("gradsync.tensorflow.keras")
    for name in keras_path.__all__:
        if name not in ("callbacks", "elastic"):
            assert getattr(tf_path, name) is getattr(keras_path, name), name
    for sub in ("callbacks", "elastic"):
        ours, theirs = getattr(keras_path, sub), importlib.import_module(f"gradsync.tensorflow.keras.{sub}")
        assert ours.__all__ and all(getattr(theirs, n) is getattr(ours, n) for n in ours.__all__), sub
        assert getattr(tf_path, sub) is theirs


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy is not installed")
def test_the_cupy_adapter_imports_from_its_path():
    assert_imports_from_its_own_path("gradsync.cupy")


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_python_dash_m_entry_points_resolve_and_answer_help(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and Path(spec.origin).resolve().is_relative_to(SRC / "gradsync")
    if spec.submodule_search_locations:  # a package runs its __main__
        assert importlib.util.find_spec(f"{name}.__main__") is not None
    else:
        assert 'if __name__ == "__main__":' in Path(spec.origin).read_text()
    result = subprocess.run([sys.executable, "-m", name, "--help"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: "), result.stdout


def test_the_console_script_target_exists():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"gradsyncrun": "gradsync.run.driver:main"}
    module, _, function = scripts["gradsyncrun"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def documented_paths() -> set[str]:
    """Every gradsync module that README.md, docs/ and examples/ import or run with ``python -m``."""
    pattern = re.compile(r"(?:^|\s)(?:import|from|python -m) (gradsync(?:\.\w+)*)", re.MULTILINE)
    texts = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("*.py")]
    return {name for path in texts for name in pattern.findall(path.read_text())}


def test_every_module_path_the_documentation_shows_is_tested_here():
    tested = set(CORE) | set(TORCH) | {m for m, _ in FRAMEWORKS} | set(ENTRY_POINTS) | {"gradsync.cupy"}
    shown = documented_paths()
    assert {"gradsync", "gradsync.torch", "gradsync.check"} <= shown  # the scan finds them
    assert not shown - tested, f"add these to tests/test_import_paths.py: {sorted(shown - tested)}"
