"""pyproject.toml's extras: the test extras install no GPU library, NCCL comes per CUDA major.

A CPU-only machine installing `.[torch,mpi,test]` must not download a GPU library, and no extra may
put an NCCL wheel beside a CUDA build of torch unasked: nvidia-nccl-cu12 and nvidia-nccl-cu13 both
install nvidia/nccl/lib/libnccl.so.2, so one overwrites the other's file (and uninstalling it
deletes it).
"""

from __future__ import annotations

import re

import pytest

from mpi_launch import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

GPU_LIBRARY = re.compile(r"^(nvidia-|cupy|jax-cuda|jaxlib-cuda|cuda-)", re.I)


def extras() -> dict[str, list[str]]:
    with open(REPO / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["optional-dependencies"]


def resolved(extra: str, table: dict[str, list[str]]) -> set[str]:
    """The distribution names an extra installs, following ``gradsync[...]`` references."""
    names: set[str] = set()
    for requirement in table[extra]:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        inner = re.search(r"\[([^\]]+)\]", requirement)
        if name.lower() == "gradsync" and inner:
            for other in inner.group(1).split(","):
                names |= resolved(other.strip(), table)
        else:
            names.add(name.lower())
    return names


@pytest.mark.parametrize("extra", ["test", "test-core", "mpi", "openmpi", "examples", "docs", "torch"])
def test_no_extra_but_the_nccl_ones_installs_a_gpu_library(extra):
    table = extras()
    gpu = sorted(name for name in resolved(extra, table) if GPU_LIBRARY.match(name))
    assert gpu == [], f"extra {extra!r} installs GPU libraries {gpu}: a CPU-only machine downloads them"


def test_nccl_comes_in_one_extra_per_cuda_major_and_nowhere_else():
    table = extras()
    assert resolved("nccl-cu12", table) == {"nvidia-nccl-cu12"}
    assert resolved("nccl-cu13", table) == {"nvidia-nccl-cu13"}
    assert "nccl" not in table, "an unversioned nccl extra would pick one CUDA major for everybody"
    owners = {extra for extra in table if any("nccl" in n for n in resolved(extra, table))}
    assert owners == {"nccl-cu12", "nccl-cu13"}


def test_the_readme_describes_the_extras_as_they_are():
    readme = (REPO / "README.md").read_text()
    for extra in extras():
        assert f"`{extra}`" in readme, f"README.md does not describe the {extra!r} extra"
