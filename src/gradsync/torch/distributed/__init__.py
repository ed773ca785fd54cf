"""A ``torch.distributed`` backend on gradsync's engine: under ``mpiexec -n N`` (or ``srun``)::

    import gradsync.torch  # registers the backend "gradsync" and the rendezvous "gradsync://"
    dist.init_process_group(backend="gradsync", init_method="gradsync://")

needs no MASTER_ADDR, no port and no torchrun variables (``init_method`` may be left out where
MASTER_ADDR is unset): rank and world size are gradsync's (the
rendezvous calls ``gradsync.init()`` if needed). torchrun's rank variables are set for code that
reads them, from the MPI launcher's at import and from gradsync's at the rendezvous
(:func:`export_launcher_variables`). Every call of the group submits to gradsync's
engine; docs/torch-distributed.md lists what works and what does not yet.

``import gradsync.torch`` calls :func:`register`, which records two functions with torch and
exports the launcher's rank variables; the process group's modules are imported when torch first
creates a group.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

BACKEND = "gradsync"


def register() -> None:
    """Register the "gradsync" backend (CPU and CUDA tensors) and the "gradsync://" rendezvous with
    torch.distributed, and export torchrun's rank variables from the MPI launcher's
    (:func:`export_from_launcher`); does nothing where torch.distributed is unavailable, and
    registers nothing a second time."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    export_from_launcher()
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module, not its function
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    if BACKEND not in rendezvous._rendezvous_handlers:
        rendezvous.register_rendezvous_handler(BACKEND, _rendezvous)
    # torch >= 2.15 attaches its flight recorder to every group of a backend not in this set, through
    # the C++ group's registered backends, which a Python process group has none of (creating any
    # group then raises "Could not find the default backend type"); gradsync records nothing there.
    recording = getattr(importlib.import_module("torch.distributed.distributed_c10d"),
                        "_FR_SELF_RECORDING_BACKENDS", None)
    if recording is not None:
        recording.add(BACKEND)
    _default_rendezvous(rendezvous)
    _python_builtin_hooks()


def uses_only_gradsync(backend: Any) -> bool:
    """Whether ``init_process_group``'s ``backend`` names gradsync's backend for every device:
    ``"gradsync"`` (any case) or a ``"cpu:gradsync,cuda:gradsync"`` list; False for None, for any
    other backend, and for a list that names another one for some device (that backend needs a
    store shared between the processes)."""
    if backend is None:
        return False
    parts = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
    return all(part == BACKEND for part in parts)


def _default_rendezvous(rendezvous: Any) -> None:
    """Make ``init_process_group(backend="gradsync")`` with neither ``init_method`` nor ``store``
    rendezvous at ``gradsync://`` where torch's default, ``env://``, cannot run (``MASTER_ADDR`` or
    ``MASTER_PORT`` unset; an explicit ``init_method="env://"`` as much): a torchrun script whose
    only change is its backend's name then runs under ``mpiexec``/``srun`` as it is. With both
    variables set (Lightning's environments, a site's scripts), and for every other backend, torch's
    ``env://`` runs as it is (its error names the missing variable).

    torch's rendezvous handlers are not told the backend: the ``env://`` handler is wrapped (once)
    to read it from the ``init_process_group`` call that it serves (the frame of torch's own
    function, found by its code object, whose ``backend`` holds ``Backend(backend)`` by then), so
    that a script that imported ``init_process_group`` by name before ``import gradsync.torch`` is
    served as well. A rendezvous called outside ``init_process_group`` keeps torch's handler."""
    original = rendezvous._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_gradsync", False):
        return
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    init_code = inspect.unwrap(c10d.init_process_group).__code__

    @functools.wraps(original)
    def env_or_gradsync(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            return original(url, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not init_code:
            frame = frame.f_back
        if frame is None or not uses_only_gradsync(frame.f_locals.get("backend")):
            return original(url, **kwargs)
        return _rendezvous(url, **kwargs)

    env_or_gradsync._gradsync = True  # type: ignore[attr-defined]
    rendezvous._rendezvous_handlers["env"] = env_or_gradsync


#: DDP's built-in C++ comm hooks (``dist.BuiltinCommHookType``) that a Python process group cannot
#: serve -> the same hook written in Python, in ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``.
BUILTIN_HOOKS = {"FP16_COMPRESS": "fp16_compress_hook"}


def _python_builtin_hooks() -> None:
    """Make ``DistributedDataParallel._register_builtin_comm_hook`` work on a gradsync group.

    torch's C++ FP16_COMPRESS hook reads the Work's future as a C++ list of tensors, and a Python
    process group's future holds a Python object: backward would stop at an INTERNAL ASSERT
    ("ProcessGroup::allreduce should return TensorList") on every backend written in Python. On a
    DDP model whose process group is gradsync's, the hook of the same arithmetic written in Python
    (:data:`BUILTIN_HOOKS`: cast to float16, divide by the group's size, allreduce, copy back) is
    registered instead, with ``register_comm_hook``. Any other hook type (ALLREDUCE, whose C++ hook
    passes the future on as it is) and any other group get torch's own method. Wraps it once."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel._register_builtin_comm_hook
    if getattr(original, "_gradsync", False):
        return

    @functools.wraps(original)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        import torch.distributed as dist

        python_hook = BUILTIN_HOOKS.get(getattr(comm_hook_type, "name", ""))
        if python_hook is None or dist.get_backend(self.process_group) != BACKEND:
            return original(self, comm_hook_type)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.register_comm_hook(self.process_group, getattr(default_hooks, python_hook))

    _register_builtin_comm_hook._gradsync = True  # type: ignore[attr-defined]
    DistributedDataParallel._register_builtin_comm_hook = _register_builtin_comm_hook


def _create(opts: Any, pg_options: Any = None) -> Any:
    from .group import create

    return create(opts, pg_options)


#: torchrun's variables that the rendezvous sets (:func:`export_launcher_variables`), with the
#: values it set them to: a later rendezvous (after an elastic reset) updates only these.
_exported: dict[str, str] = {}


def export_launcher_variables(rank: int, size: int, local_rank: int | None,
                              local_size: int | None) -> None:
    """Set torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` in
    ``os.environ`` to these values (decimal strings; None: leave that one), where they are unset or
    still hold what an earlier call set: code that reads them (a script's
    ``int(os.environ["LOCAL_RANK"])``, ``torch.distributed.get_node_local_rank()``) gets this
    rank's place. A value set by someone else (the user, torchrun) is left as it is. Neither
    ``MASTER_ADDR``/``MASTER_PORT`` (nothing listens on a port) nor ``GROUP_RANK`` is set:
    with all of ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` Lightning would
    take the process for one of torchrun's and rendezvous through ``MASTER_ADDR``."""
    for name, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
                        ("LOCAL_WORLD_SIZE", local_size)):
        if value is not None and (name not in os.environ or os.environ[name] == _exported.get(name)):
            os.environ[name] = _exported[name] = str(value)


def export_from_launcher(environ: dict[str, str] | None = None) -> None:
    """torchrun's rank variables from the MPI launcher's (:func:`gradsync.process.launch.detect_launcher`:
    ``mpiexec`` of Open MPI or Hydra, ``srun``), before any rendezvous: a torchrun script that
    reads ``int(os.environ["LOCAL_RANK"])`` before ``init_process_group`` (to pick its GPU) gets its
    place on the host. The rendezvous sets gradsync's own values later (the same ones: gradsync's
    rank is the launcher's). Nothing for a process no launcher started. ``environ``: the
    launcher's variables (default ``os.environ``); the export goes to ``os.environ``."""
    from ...process.launch import detect_launcher

    launcher = detect_launcher(environ)
    if launcher.rank is not None and launcher.expected_size is not None:
        export_launcher_variables(launcher.rank, launcher.expected_size, launcher.local_rank,
                                  launcher.local_size)


def _rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """``init_method="gradsync://"``: gradsync's rank and size, and a store every rank shares, over
    MPI (:mod:`.store`; the backend itself exchanges nothing through it). Sets torchrun's rank
    variables where unset (:func:`export_launcher_variables`). Collective: every rank calls it.

    Raises:
        ValueError: a ``rank`` or ``world_size`` (given to ``init_process_group``) other than gradsync's.
        torch.distributed.DistStoreError: a rank did not call ``init_process_group`` within its
            ``timeout`` (as torch's TCPStore rendezvous raises it).
    """
    import torch.distributed as dist

    from ...process import runtime
    from ...process.polling import await_ranks
    from .store import rendezvous_store

    runtime.init()
    rt = runtime.get()
    wait = kwargs.get("timeout")
    try:  # no rank waits forever in the store's collective set-up for a rank that never comes
        await_ranks(rt.control, rt.rank, list(range(rt.size)),
                    None if wait is None else wait.total_seconds(), "init_process_group")
    except TimeoutError as error:
        raise dist.DistStoreError(str(error)) from error
    store = rendezvous_store(rt)  # collective: before anything that may raise on one rank
    query = {key: int(values[0]) for key, values in parse_qs(urlparse(url).query).items()
             if key in ("rank", "world_size")}
    rank, size = runtime.rank(), runtime.size()
    for key, mine in (("rank", rank), ("world_size", size)):
        if query.get(key, -1) not in (-1, mine):
            raise ValueError(f"gradsync://: {key}={query[key]} was given, but gradsync's {key} is "
                             f"{mine} (leave it out: it comes from the MPI launcher)")
    export_launcher_variables(rank, size, runtime.local_rank(), runtime.local_size())
    yield store, rank, size
