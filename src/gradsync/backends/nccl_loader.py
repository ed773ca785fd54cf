"""Finding and loading libnccl.so.2 through cffi in ABI mode (no compiler, no CUDA headers).

Where the library is looked for, and in which order, is :mod:`gradsync.backends.nccl_api`'s docstring; this
module does the looking (:func:`load_library`, once per process) and answers the version
questions that need no GPU (:func:`nccl_built`, :func:`nccl_version`, :func:`version`).
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import functools
import importlib.metadata
import importlib.resources
import logging
import os
from pathlib import Path
from typing import Any

from ..errors import NcclUnavailableError
from ..process.libraries import loaded_library

log = logging.getLogger("gradsync")

#: Environment variable naming the NCCL library to load (a file, or a directory holding libnccl.so.2).
ENV_LIBRARY = "GRADSYNC_NCCL_LIBRARY"
LIBRARY_NAME = "libnccl.so.2"
#: pip distributions that ship libnccl.so.2, in the order they are looked at.
WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")
#: A mapped file that is an NCCL: libnccl.so.2, or the versioned file it links to.
LOADED_PATTERN = r"/libnccl\.so\.2(\.[\d.]+)?$"
LOADED_SOURCE = "already loaded in this process"


@functools.cache
def _ffi() -> Any:
    """The cffi FFI holding the declarations of nccl_api.h (no library loaded)."""
    try:
        import cffi
    except ImportError as exc:
        raise NcclUnavailableError(f"the NCCL binding needs cffi ({exc}); pip install cffi") from None
    try:
        declarations = importlib.resources.files(__package__).joinpath("nccl_api.h").read_text()
    except OSError as exc:
        raise NcclUnavailableError(
            f"the NCCL declarations gradsync/backends/nccl_api.h are missing ({exc}); "
            "this gradsync installation is incomplete") from None
    ffi = cffi.FFI()
    ffi.cdef(declarations)
    return ffi


def _const(name: str) -> int:
    """The value of an enum constant of nccl_api.h, e.g. ``_const("ncclFloat32") == 7``."""
    ffi = _ffi()
    for enum in ("ncclDataType_t", "ncclRedOp_t", "ncclResult_t"):
        values = ffi.typeof(enum).relements
        if name in values:
            return values[name]
    raise KeyError(f"{name} is not an enum constant of nccl_api.h")


@dataclasses.dataclass(frozen=True)
class Library:
    """A loaded NCCL: the cffi ``lib``, where it came from, and its version code."""

    ffi: Any
    lib: Any
    path: str
    source: str
    version_code: int

    @property
    def version(self) -> tuple[int, int, int]:
        return decode_version(self.version_code)


def decode_version(code: int) -> tuple[int, int, int]:
    """(major, minor, patch) of an ``ncclGetVersion`` code.

    From 2.9 on the code is ``major*10000 + minor*100 + patch`` (2.32.3 -> 23203); before, it was
    ``major*1000 + minor*100 + patch`` (2.8.4 -> 2804), as the ``NCCL_VERSION`` macro of nccl.h says.
    """
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def _open(ffi: Any, source: str, path: str, tried: list[str]) -> Library | None:
    """dlopen ``path`` and check that it is an NCCL; on failure, append why to ``tried``."""
    try:
        lib = ffi.dlopen(path)
    except OSError as exc:
        tried.append(f"{source}: {exc}")
        return None
    try:
        get_version = lib.ncclGetVersion
    except AttributeError:
        tried.append(f"{source}: {path} loads but is not NCCL (it has no ncclGetVersion)")
        return None
    code = ffi.new("int *")
    result = get_version(code)
    if result != 0:
        tried.append(f"{source}: {path}: ncclGetVersion returned {result}")
        return None
    return Library(ffi=ffi, lib=lib, path=path, source=source, version_code=code[0])


def _wheel_paths(distribution: str) -> list[str] | str:
    """Where the pip distribution keeps libnccl.so.2, or why there is nothing to try."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    paths = [str(dist.locate_file(f)) for f in dist.files or () if f.name == LIBRARY_NAME]
    if paths:
        return paths
    # No RECORD to read: nvidia.nccl is a namespace package (no __init__.py), hence __path__.
    try:
        import nvidia.nccl
    except ImportError as exc:
        return f"installed, but its files are not listed and nvidia.nccl does not import ({exc})"
    return [os.path.join(p, "lib", LIBRARY_NAME) for p in nvidia.nccl.__path__]


def _search(explicit: str, wheels: tuple[str, ...], system: tuple[str, str] | None,
            loaded: str | None = None) -> Library:
    """Load the first NCCL found (module docstring order); raise NcclUnavailableError listing all tries.

    ``explicit`` is the value of GRADSYNC_NCCL_LIBRARY ('' when unset), ``loaded`` the path of an NCCL
    this process already mapped (None: none), ``wheels`` the pip distributions to look in, ``system``
    the (find_library name, soname) pair of the system search, or None to skip it. Parameters, so
    that tests can search places that do not exist.
    """
    ffi = _ffi()
    tried: list[str] = []
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_dir():
            path = path / LIBRARY_NAME
        source = f"{ENV_LIBRARY}={explicit}"
        if not path.exists():
            tried.append(f"{source}: no such file: {path}")
        elif (library := _open(ffi, source, str(path), tried)) is not None:
            return library
        raise NcclUnavailableError(_not_found(tried, f"no other place was searched because {ENV_LIBRARY} "
                                                     "is set; unset it to search the wheels and the system"))
    tried.append(f"{ENV_LIBRARY}: not set")
    if loaded is None:
        tried.append(f"{LOADED_SOURCE}: none")
    elif (library := _open(ffi, LOADED_SOURCE, loaded, tried)) is not None:
        return library
    for wheel in wheels:
        paths = _wheel_paths(wheel)
        if isinstance(paths, str):
            tried.append(f"{wheel} wheel: {paths}")
            continue
        for path in paths:
            if not os.path.exists(path):
                tried.append(f"{wheel} wheel: no such file: {path}")
            elif (library := _open(ffi, f"{wheel} wheel", path, tried)) is not None:
                return library
    if system is not None:
        short_name, soname = system
        found = ctypes.util.find_library(short_name)
        if found is None:
            tried.append(f"system: ctypes.util.find_library({short_name!r}) found nothing")
        for name in dict.fromkeys(n for n in (found, soname) if n):
            if (library := _open(ffi, f"system ({name})", name, tried)) is not None:
                return library
    raise NcclUnavailableError(_not_found(tried, "install it with `pip install gradsync[nccl-cu12]` "
                                                 "(CUDA 12) or gradsync[nccl-cu13] (CUDA 13) or set "
                                                 f"{ENV_LIBRARY} to the path of libnccl.so.2"))


def _not_found(tried: list[str], advice: str) -> str:
    lines = "\n".join(f"  - {t}" for t in tried)
    return f"no usable NCCL library ({LIBRARY_NAME}); tried:\n{lines}\n{advice}"


@functools.cache
def load_library() -> Library:
    """The NCCL library of this process, loaded on the first call (see the module docstring for where
    it is looked for); later calls return the same object. Works without a GPU.

    Raises:
        NcclUnavailableError: no place had a loadable NCCL; the message lists each place and why.
    """
    library = _search(os.environ.get(ENV_LIBRARY, ""), WHEELS, ("nccl", LIBRARY_NAME),
                      loaded_library(LOADED_PATTERN))
    log.info("gradsync: NCCL %s from %s (%s)", _dotted(library.version), library.path, library.source)
    return library


def nccl_built() -> bool:
    """Whether gradsync can use NCCL in this process: True when an NCCL library loads.

    The counterpart of Horovod's ``hvd.nccl_built()``, answered at run time: gradsync loads NCCL
    (see :mod:`gradsync.backends.nccl_api` for where it looks) instead of linking it at build time. It does
    not need a GPU, nor ``gradsync.init()``, and never raises; True does not mean that a GPU is present.
    """
    try:
        load_library()
    except NcclUnavailableError:
        return False
    return True


def nccl_version() -> tuple[int, int, int] | None:
    """The (major, minor, patch) version of the NCCL library gradsync loads, e.g. ``(2, 32, 3)``;
    None when none loads (then :func:`nccl_built` is False). Needs no GPU and never raises."""
    try:
        return load_library().version
    except NcclUnavailableError:
        return None


def version() -> tuple[int, int, int]:
    """(major, minor, patch) of the loaded NCCL. Raises NcclUnavailableError when none loads."""
    return load_library().version


def _dotted(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))
