"""Documentation stays in step with the code."""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradsync
from gradsync.config import markdown_table

REPO = Path(__file__).parent.parent
DOCS = REPO / "docs"
# A mkdocstrings directive: `::: dotted.path` at the start of a line.
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)


def test_configuration_table_matches_settings():
    text = (DOCS / "configuration.md").read_text()
    table = text.split("<!-- settings-table -->\n")[1].split("\n<!-- /settings-table -->")[0]
    assert table == markdown_table(), "regenerate the table with gradsync.config.markdown_table()"


def module_all(module: str) -> list[str]:
    """``module.__all__`` read from its source (so that gradsync.torch needs no torch here)."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module} has no literal __all__")


def documented() -> dict[str, set[str]]:
    """Module path -> the names that docs/api.md has a ``::: module.name`` directive for."""
    names: dict[str, set[str]] = {}
    for target in DIRECTIVE.findall((DOCS / "api.md").read_text()):
        module, _, name = target.rpartition(".")
        names.setdefault(module, set()).add(name)
    return names


def test_every_public_name_has_its_entry_in_the_api_reference():
    entries = documented()
    top = entries.get("gradsync", set())
    torch_names = entries.get("gradsync.torch", set())
    missing = [n for n in gradsync.__all__
               if n not in top and not (n in gradsync._TORCH_NAMES and n in torch_names)]
    assert not missing, f"add `::: gradsync.NAME` entries to docs/api.md for: {missing}"
    for module in ("gradsync.torch", "gradsync.jax", "gradsync.metrics", "gradsync.lightning"):
        missing = sorted(set(module_all(module)) - entries.get(module, set()))
        assert not missing, f"add `::: {module}.NAME` entries to docs/api.md for: {missing}"
    # gradsync.tensorflow re-exports gradsync's own init, rank, process sets, ...: its own names
    own = set(module_all("gradsync.tensorflow")) - set(gradsync.__all__) | {"Compression"}
    missing = sorted(own - entries.get("gradsync.tensorflow", set()))
    assert not missing, f"add `::: gradsync.tensorflow.NAME` entries to docs/api.md for: {missing}"
    unknown = sorted(top - set(gradsync.__all__))
    assert not unknown, f"docs/api.md documents names that gradsync does not export: {unknown}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("mkdocstrings_handlers") is None,
                    reason="mkdocs and mkdocstrings[python] are not installed (pip install -e '.[docs]')")
def test_the_documentation_site_builds_without_warnings(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in gradsync.__all__:  # every entry really rendered, under its own anchor
        assert re.search(rf'id="gradsync(\.torch)?\.{re.escape(name)}"', api), name
