"""Launch diagnostics: which launcher started this process, which MPI library mpi4py loads, and
whether the two can work together, decided before ``MPI_Init``.

A launcher hands each process its rank and the addresses of the others through a process-management
interface: PMIx (Open MPI's ``mpiexec``, ``srun --mpi=pmix``) or the PMI-1/PMI-2 wire protocol
(MPICH's and Intel MPI's Hydra ``mpiexec``, ``srun --mpi=pmi2``). An MPI library that does not speak
the launcher's interface either aborts inside ``MPI_Init`` (MPICH under PMIx: "unsupported PMI
version PMIx", exit status 16, before any Python code could say why) or starts every process as
rank 0 of a world of 1 (Open MPI 5 under Hydra or ``srun --mpi=pmi2``). :func:`start_mpi` imports
``mpi4py.MPI`` without initialising MPI (``mpi4py.rc.initialize = False``), compares the two with
:func:`diagnose` and only then calls ``MPI_Init_thread``; :func:`launcher_mismatch` catches the
world-of-1 case afterwards when MPI was already initialised by the user's code. docs/launching.md
describes every case. This module imports no deep-learning framework.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import shutil
import sys
from collections.abc import Mapping
from types import ModuleType

from ..errors import GradsyncError, LaunchError
from .libraries import loaded_library

log = logging.getLogger("gradsync")

#: Process-management interfaces: PMIx, and the PMI-1/PMI-2 wire protocol of Hydra and srun's pmi2.
PMIX, PMI = "pmix", "pmi"
#: The file names of MPI libraries (libmpi.so.12 of MPICH, libmpi.so.40 of Open MPI, libmpich.so).
LIBMPI = r"/lib(mpi|mpich)[^/]*\.so[.\d]*$"


@dataclasses.dataclass(frozen=True)
class Launcher:
    """The launcher found in the environment of this process.

    ``kind`` is ``"mpiexec"`` (mpirun/mpiexec of some MPI), ``"srun"`` (a SLURM job step) or
    ``"none"`` (a plain process); ``name`` says which launcher in words; ``expected_size`` is the
    number of processes it says it started (None when unknown); ``rank`` this process's rank as the
    launcher numbers it (None for a plain process); ``interfaces`` the process-management interfaces
    its variables offer (:data:`PMIX`: PMIX_NAMESPACE is set; :data:`PMI`: PMI_SIZE is set);
    ``local_rank`` and ``local_size`` this process's place among the launcher's processes on its
    host, where the launcher says (None where it does not).
    """

    name: str
    expected_size: int | None
    kind: str = "none"
    rank: int | None = None
    interfaces: frozenset[str] = frozenset()
    local_rank: int | None = None
    local_size: int | None = None


@dataclasses.dataclass(frozen=True)
class MpiLibrary:
    """The MPI library mpi4py loads, known before ``MPI_Init`` (``MPI_Get_library_version``).

    ``name`` is ``"MPICH"``, ``"Open MPI"``, ``"Intel MPI"``, ``"MVAPICH"`` or the vendor mpi4py
    reports; ``version`` is dotted (``"5.0.2"``); ``interfaces`` the process-management interfaces it
    is known to speak, or None when that cannot be told from its version string (then no decision is
    made before ``MPI_Init``); ``path`` the libmpi file this process mapped, when known.
    """

    name: str
    version: str
    interfaces: frozenset[str] | None = None
    path: str | None = None

    @property
    def label(self) -> str:
        """``"MPICH 5.0.2 (/venv/lib/libmpi.so.12)"``: name, version and file, for messages."""
        return f"{self.name} {self.version}" + (f" ({self.path})" if self.path else "")


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _interfaces(env: Mapping[str, str]) -> frozenset[str]:
    # MPICH itself tells PMIx from PMI by these two variables (and aborts when it finds both).
    return frozenset(name for name, variable in ((PMIX, "PMIX_NAMESPACE"), (PMI, "PMI_SIZE"))
                     if variable in env)


def _uniform_tasks_per_node(text: str | None) -> int | None:
    """SLURM's tasks per node (``"2(x3)"``, ``"2"``, ``"2(x2),1"``) when every node has the same
    number, else None (which node this is would need the step's node list)."""
    counts = {part.split("(")[0] for part in (text or "").split(",") if part}
    return _int_or_none(counts.pop()) if len(counts) == 1 else None


def detect_launcher(environ: Mapping[str, str] | None = None) -> Launcher:
    """Which launcher started this process, from its environment variables (default ``os.environ``).

    Recognises Open MPI's ``mpirun`` (OMPI_COMM_WORLD_SIZE), Hydra's ``mpiexec`` (MPICH, Intel
    MPI: PMI_SIZE with MPI_LOCALNRANKS), and SLURM ``srun`` job steps (SLURM_STEP_NUM_TASKS) with
    the PMI plugin it used (pmi2: PMI_SIZE, pmix: PMIX_RANK, or none), and any other PMIx launcher
    (PMIX_RANK alone). A SLURM batch script itself (SLURM_NTASKS without a job step) counts as a
    plain process: only srun starts tasks. Returns ``Launcher("none", None)`` for a plain process.
    Never raises.
    """
    env = os.environ if environ is None else environ
    offers = _interfaces(env)
    if "OMPI_COMM_WORLD_SIZE" in env:
        return Launcher("Open MPI mpirun/mpiexec", _int_or_none(env["OMPI_COMM_WORLD_SIZE"]),
                        "mpiexec", _int_or_none(env.get("OMPI_COMM_WORLD_RANK")), offers,
                        _int_or_none(env.get("OMPI_COMM_WORLD_LOCAL_RANK")),
                        _int_or_none(env.get("OMPI_COMM_WORLD_LOCAL_SIZE")))
    in_srun_step = "SLURM_STEP_NUM_TASKS" in env
    on_node = (_int_or_none(env.get("SLURM_LOCALID")),
               _uniform_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")))
    if "PMI_SIZE" in env:
        size, rank = _int_or_none(env["PMI_SIZE"]), _int_or_none(env.get("PMI_RANK"))
        # Hydra also runs under SLURM (its proxies are srun tasks); it sets MPI_LOCALNRANKS, srun not.
        if in_srun_step and "MPI_LOCALNRANKS" not in env:
            return Launcher("srun --mpi=pmi2", size, "srun", rank, offers, *on_node)
        return Launcher("Hydra mpiexec (MPICH, Intel MPI)", size, "mpiexec", rank, offers,
                        _int_or_none(env.get("MPI_LOCALRANKID")), _int_or_none(env.get("MPI_LOCALNRANKS")))
    if in_srun_step:
        plugin = "--mpi=pmix" if "PMIX_RANK" in env else "without a PMI plugin (--mpi=none)"
        return Launcher(f"srun {plugin}", _int_or_none(env["SLURM_STEP_NUM_TASKS"]), "srun",
                        _int_or_none(env.get("SLURM_PROCID")), offers, *on_node)
    if "PMIX_RANK" in env:  # another PMIx launcher (PRRTE's prterun, Flux, ...): size unknown
        return Launcher("a PMIx launcher (PMIX_NAMESPACE)", None, "mpiexec",
                        _int_or_none(env["PMIX_RANK"]), offers, _int_or_none(env.get("PMIX_LOCAL_RANK")),
                        _int_or_none(env.get("PMIX_LOCAL_SIZE")))
    return Launcher("none", None, interfaces=offers)


# ---- the MPI library -------------------------------------------------------------------------------

_NAMES = (("MPICH Version", "MPICH"), ("MVAPICH", "MVAPICH"), ("Open MPI", "Open MPI"),
          ("Intel(R) MPI", "Intel MPI"))


def parse_library_version(text: str, vendor: tuple[str, tuple[int, ...]],
                          path: str | None = None) -> MpiLibrary:
    """The :class:`MpiLibrary` described by ``MPI_Get_library_version()``'s ``text``.

    ``vendor`` is ``MPI.get_vendor()`` (e.g. ``("MPICH", (5, 0, 2))``), used when the text names no
    library gradsync knows. Known interfaces: Open MPI 5 and later speak PMIx only; MPICH and
    MVAPICH speak PMI-1/PMI-2 only unless their configure line mentions pmix. Never raises.
    """
    text = text.replace("\0", "")
    name = next((label for marker, label in _NAMES if marker in text), vendor[0])
    numbers = re.search(r"(\d+(?:\.\d+)+)", text.split("\n")[0])
    version = numbers.group(1) if numbers else ".".join(map(str, vendor[1]))
    configure = " ".join(line for line in text.splitlines() if "configure" in line.lower())
    interfaces = None
    if name == "Open MPI" and (_int_or_none(version.split(".")[0]) or 0) >= 5:
        interfaces = frozenset({PMIX})
    elif name in ("MPICH", "MVAPICH") and "pmix" not in configure.lower():
        interfaces = frozenset({PMI})
    return MpiLibrary(name, version, interfaces, path)


def mpi_library(MPI: ModuleType) -> MpiLibrary:
    """The library behind an imported ``mpi4py.MPI``; callable before ``MPI_Init``. Never raises."""
    try:
        text = MPI.Get_library_version()
    except Exception:  # noqa: BLE001 - a library that refuses: describe it by the vendor alone
        text = ""
    return parse_library_version(text, MPI.get_vendor(), loaded_library(LIBMPI))


# ---- deciding --------------------------------------------------------------------------------------

def _launch_fix(launcher: Launcher, library: MpiLibrary) -> str:
    """How to start the job so that ``library`` understands the launcher."""
    if launcher.kind == "srun":
        plugin, others = (("pmix", "MPICH and Intel MPI use --mpi=pmi2") if library.name == "Open MPI"
                          else ("pmi2", "Open MPI uses --mpi=pmix"))
        return (f"Start it with `srun --mpi={plugin}`, the plugin for {library.name} ({others}; "
                "`srun --mpi=list` lists this SLURM's plugins).")
    beside = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    where = f" ({beside})" if beside else ""
    example = f"{beside or 'mpiexec'} -n {launcher.expected_size or 'N'} {sys.executable} ..."
    return (f"The launcher belongs to another MPI: launch with the mpiexec of {library.name}{where}, "
            f"e.g. `{example}`.")


def _started(launcher: Launcher) -> str:
    count = launcher.expected_size
    return f"{launcher.name} started {count} processes" if count else f"{launcher.name} started this process"


_LAUNCHER_PROGRAMS = frozenset({"hydra_pmi_proxy", "prterun", "prted", "orted", "mpiexec", "mpirun"})


def _launcher_bindir() -> str:
    """The directory of the launcher program that started this process (its parent: Hydra's proxy,
    Open MPI's prterun), or '' when the parent is no launcher or cannot be read (not Linux)."""
    try:
        parent = os.readlink(f"/proc/{os.getppid()}/exe")
    except OSError:
        return ""
    return os.path.dirname(parent) if os.path.basename(parent) in _LAUNCHER_PROGRAMS else ""


def _launcher_origin(launcher: Launcher, environ: Mapping[str, str]) -> tuple[str, str]:
    """Where the launcher comes from (its Open MPI version, its directory; '' when unknown), and the
    command that starts the Python of that installation instead ('' when there is none)."""
    version, bindir = environ.get("OMPI_VERSION"), _launcher_bindir()
    facts = [f"Open MPI {version}" if version else "", f"from {bindir}" if bindir else ""]
    origin = f" ({', '.join(f for f in facts if f)})" if any(facts) else ""
    python = os.path.join(bindir, "python")
    if not bindir or bindir == os.path.dirname(sys.executable) or not os.access(python, os.X_OK):
        return origin, ""
    return origin, f"{os.path.join(bindir, 'mpiexec')} -n {launcher.expected_size or 'N'} {python} ..."


def _why_not(launcher: Launcher, library: MpiLibrary, environ: Mapping[str, str]) -> str | None:
    """Why ``library`` cannot join the processes ``launcher`` started, or None when it can (or when
    that cannot be told before MPI_Init)."""
    speaks, offered = library.interfaces, launcher.interfaces
    if speaks is None:
        return None
    if PMIX in offered and PMIX not in speaks and PMI in offered:
        return (f"the environment holds both PMI_SIZE (from {launcher.name}) and PMIX_NAMESPACE="
                f"{environ.get('PMIX_NAMESPACE', '')} (from a PMIx launcher around it: Open MPI's mpiexec "
                f"or srun --mpi=pmix), and {library.name} aborts inside MPI_Init when it finds both "
                "(\"Found both env vars PMI_SIZE and PMIX_NAMESPACE\"); start the ranks with one launcher")
    if PMIX in offered and PMIX not in speaks:
        return (f"the launcher hands each process its rank through PMIx (PMIX_NAMESPACE is set), and "
                f"{library.name} speaks only PMI-1/PMI-2, so MPI_Init would abort "
                "(\"unsupported PMI version PMIx\", exit status 16)")
    if offered == {PMI} and PMI not in speaks and (launcher.expected_size or 0) > 1:
        return (f"the launcher speaks PMI-1/PMI-2 (PMI_SIZE is set, PMIX_NAMESPACE is not), and "
                f"{library.name} speaks only PMIx, so every process would start as rank 0 of a "
                "world of 1 and train alone")
    return None


def diagnose(launcher: Launcher, library: MpiLibrary,
             environ: Mapping[str, str] | None = None) -> str | None:
    """The error message when ``library`` cannot work with ``launcher``, decided before ``MPI_Init``;
    None when it can, or when that cannot be told from their identities (an MPI whose interfaces are
    unknown, a launcher without PMI variables: :func:`launcher_mismatch` then checks the world size
    after ``MPI_Init``). ``environ`` (default ``os.environ``) supplies the values quoted."""
    env = os.environ if environ is None else environ
    reason = _why_not(launcher, library, env)
    if reason is None:
        return None
    origin, command = _launcher_origin(launcher, env)
    other = f" Or keep the launcher and start the Python of its MPI: `{command}`." if command else ""
    return (f"gradsync: {_started(launcher)}{origin}, but the MPI library this Python's mpi4py loads, "
            f"{library.label}, cannot join them: {reason}. {_launch_fix(launcher, library)}{other}")


def launcher_mismatch(launcher: Launcher, world_size: int, library: MpiLibrary) -> str | None:
    """The error message when the launcher started several processes but MPI sees a world of 1.

    The after-the-fact counterpart of :func:`diagnose`, for MPI initialised before gradsync could
    look (the user's code imported ``mpi4py.MPI`` first) and for the cases diagnose cannot decide
    (Open MPI under ``srun --mpi=none``, an MPI of unknown interfaces): every process initialised
    MPI alone and would train alone. Returns None when there is no such mismatch.
    """
    expected = launcher.expected_size
    if expected is None or expected <= 1 or world_size != 1:
        return None
    return (f"gradsync: {_started(launcher)}, but MPI ({library.name} {library.version}) sees a world "
            f"of 1 in each: every process would train alone. {_launch_fix(launcher, library)}")


def warn_if_batch_script_without_srun(launcher: Launcher, world_size: int,
                                      environ: Mapping[str, str] | None = None) -> None:
    """Log a warning when a SLURM job allocated several tasks but this process was started without
    srun (``python train.py`` in the job script), so it trains alone."""
    env = os.environ if environ is None else environ
    tasks = _int_or_none(env.get("SLURM_NTASKS"))
    if launcher.kind == "none" and world_size == 1 and tasks is not None and tasks > 1:
        log.warning("gradsync: SLURM allocated %d tasks (SLURM_NTASKS) but this process was not "
                    "started by srun, so it trains alone; start it with `srun --mpi=pmix` (Open "
                    "MPI) or `srun --mpi=pmi2` (MPICH) in the job script", tasks)


# ---- starting MPI ----------------------------------------------------------------------------------

def import_mpi() -> ModuleType:
    """``mpi4py.MPI``, imported without initialising MPI when this call is the first import.

    Sets ``mpi4py.rc.initialize = False`` for the import and restores it afterwards (mpi4py reads
    its options once, at import). Where ``rc.finalize`` was None it becomes True and stays so:
    mpi4py then still finalises MPI at exit, after every Python atexit handler, as it does when it
    initialised MPI itself (with None it would follow ``rc.initialize`` and never finalise). An
    ``mpi4py.MPI`` imported earlier is returned as it is.
    """
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"]
    import mpi4py

    saved = mpi4py.rc.initialize
    mpi4py.rc.initialize = False
    if mpi4py.rc.finalize is None:
        mpi4py.rc.finalize = True
    try:
        from mpi4py import MPI
    finally:
        mpi4py.rc.initialize = saved
    return MPI


def _finalize_at_exit(MPI: ModuleType) -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def start_mpi(environ: Mapping[str, str] | None = None) -> ModuleType:
    """Initialise MPI for gradsync after checking the launch; returns ``mpi4py.MPI``.

    When MPI is already initialised (the user's code imported ``mpi4py.MPI`` first, which
    initialises it), returns at once: only :func:`launcher_mismatch` can check that launch. Otherwise
    compares :func:`detect_launcher` with :func:`mpi_library` (:func:`diagnose`) and calls
    ``MPI_Init_thread(MPI_THREAD_MULTIPLE)``, the thread level mpi4py would request.

    Raises:
        LaunchError: the launcher and the MPI library cannot work together (the message names both
            and the fix); MPI is then left uninitialised.
        GradsyncError: MPI was already finalised.
    """
    MPI = import_mpi()
    if MPI.Is_finalized():
        raise GradsyncError("gradsync: MPI was already finalised (MPI.Finalize() was called): it "
                            "cannot be started again in this process")
    if MPI.Is_initialized():
        return MPI
    problem = diagnose(detect_launcher(environ), mpi_library(MPI), environ)
    if problem:
        raise LaunchError(problem)
    import mpi4py

    if mpi4py.rc.finalize is None:  # imported by the user with rc.initialize = False: mpi4py
        atexit.register(_finalize_at_exit, MPI)  # would leave MPI unfinalised at exit
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


# ---- the start-up line -----------------------------------------------------------------------------

def waiting_note(library: MpiLibrary, wait_policy: str, environ: Mapping[str, str] | None = None,
                 set_by_gradsync: bool = False) -> str:
    """How this rank waits for the others, for the start-up line: the negotiation exchange's
    ``wait_policy`` (:mod:`gradsync.engine.waiting`) and, under Open MPI, whether its blocking calls yield
    the core (``OMPI_MCA_mpi_yield_when_idle``, which gradsync sets to 1 at import unless the
    environment already has it: ``set_by_gradsync``) or spin on it.
    """
    environ = os.environ if environ is None else environ
    note = ("negotiation waits sleep between tests" if wait_policy == "sleep"
            else "negotiation waits in the blocking MPI call")
    if library.name == "Open MPI":
        value = environ.get("OMPI_MCA_mpi_yield_when_idle", "")
        whose = "set by gradsync" if set_by_gradsync else "as set in the environment"
        if value.strip().lower() in ("1", "true", "yes", "on"):
            note += (f"; Open MPI's blocking calls yield the core "
                     f"(OMPI_MCA_mpi_yield_when_idle={value}, {whose})")
        else:
            note += (f"; Open MPI's blocking calls spin on a core the training may need "
                     f"(OMPI_MCA_mpi_yield_when_idle={value or 'unset'}, {whose})")
    return note


def launch_line(size: int, hosts: int, library: MpiLibrary, launcher: Launcher) -> tuple[int, str]:
    """The log level and text of the line rank 0 logs at ``init()``: ranks, hosts, MPI, launcher.

    WARNING for one rank without a launcher (``python train.py``: it trains alone, which is what
    someone who meant to start N ranks needs to see), INFO otherwise.
    """
    ranks = f"{size} rank{'s' if size != 1 else ''}"
    if size == 1 and launcher.kind == "none":
        beside = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
        return logging.WARNING, (f"gradsync: 1 rank, no launcher, MPI: {library.label}: this process "
                                 f"trains alone; to train on N ranks start it with "
                                 f"`{beside} -n N {sys.executable} ...`")
    return logging.INFO, (f"gradsync: {ranks} on {hosts} host{'s' if hosts != 1 else ''}, MPI: "
                          f"{library.label}, launcher: {launcher.name}")
