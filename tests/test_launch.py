"""Launch diagnostics (gradsync.process.launch): launcher detection, the MPI library's identity, the decision
before MPI_Init, the world-of-1 check after it, and the start-up line.

The environments below are what each launcher was observed to set (Slurm 22.05, Open MPI 5.0 and
MPICH 5.0 wheels); tests/test_slurm.py runs the same cases for real under srun, and
tests/test_foreign_launcher.py starts one MPI's mpiexec with the other MPI's Python.
"""

import logging
import subprocess
import sys

import pytest

from gradsync.process.launch import (
    PMI,
    PMIX,
    Launcher,
    MpiLibrary,
    detect_launcher,
    diagnose,
    launch_line,
    launcher_mismatch,
    parse_library_version,
    waiting_note,
)
from gradsync.process.libraries import loaded_library
from mpi_launch import REPO, WORKERS, flavour, mpiexec, reports, run_job, run_mpi

OPEN_MPI = MpiLibrary("Open MPI", "5.0.11", frozenset({PMIX}), "/ompi/lib/libmpi.so.40")
MPICH = MpiLibrary("MPICH", "5.0.2", frozenset({PMI}), "/mpich/lib/libmpi.so.12")
SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
OPEN_MPI_ENV = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1",
                "PMIX_NAMESPACE": "prterun-vm-1@1", "OMPI_VERSION": "5.0.11"}
HYDRA_ENV = {"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_FD": "9", "MPI_LOCALNRANKS": "2"}
SRUN_PMIX_ENV = {**SRUN_STEP, "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.8.0"}
SRUN_PMI2_ENV = {**SRUN_STEP, "PMI_SIZE": "2", "PMI_RANK": "1", "PMI_FD": "11"}


@pytest.mark.parametrize("environ, name, size, kind", [
    ({}, "none", None, "none"),
    (OPEN_MPI_ENV, "Open MPI mpirun/mpiexec", 2, "mpiexec"),
    ({"PMI_SIZE": "3", "PMI_RANK": "0", "MPI_LOCALNRANKS": "3"},
     "Hydra mpiexec (MPICH, Intel MPI)", 3, "mpiexec"),
    (SRUN_PMI2_ENV, "srun --mpi=pmi2", 2, "srun"),
    (SRUN_PMIX_ENV, "srun --mpi=pmix", 2, "srun"),
    (SRUN_STEP, "srun without a PMI plugin (--mpi=none)", 2, "srun"),
    # Hydra inside a SLURM allocation starts its proxies with srun (one task per node): its own
    # PMI_SIZE counts the ranks, SLURM_STEP_NUM_TASKS the nodes.
    ({**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"},
     "Hydra mpiexec (MPICH, Intel MPI)", 4, "mpiexec"),
    # Open MPI's mpirun in a job step likewise.
    ({**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "OMPI_COMM_WORLD_SIZE": "4"},
     "Open MPI mpirun/mpiexec", 4, "mpiexec"),
    # The batch script of an sbatch job is no job step: only srun starts the tasks.
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "none", None, "none"),
    ({"PMI_SIZE": "not a number", "MPI_LOCALNRANKS": "1"}, "Hydra mpiexec (MPICH, Intel MPI)", None,
     "mpiexec"),
])
def test_each_launcher_is_recognised_from_its_environment(environ, name, size, kind):
    launcher = detect_launcher(environ)
    assert (launcher.name, launcher.expected_size, launcher.kind) == (name, size, kind)


@pytest.mark.parametrize("environ, rank, interfaces", [
    ({}, None, set()),
    (OPEN_MPI_ENV, 1, {PMIX}),
    (HYDRA_ENV, 1, {PMI}),
    (SRUN_PMIX_ENV, 1, {PMIX}),
    (SRUN_PMI2_ENV, 1, {PMI}),
    (SRUN_STEP, 1, set()),
    ({**HYDRA_ENV, "PMIX_NAMESPACE": "slurm.pmix.8.0"}, 1, {PMI, PMIX}),  # Hydra inside a PMIx step
])
def test_the_launcher_tells_this_processes_rank_and_its_process_management_interfaces(
        environ, rank, interfaces):
    launcher = detect_launcher(environ)
    assert launcher.rank == rank and launcher.interfaces == interfaces


@pytest.mark.parametrize("environ, place", [
    ({}, (None, None)),
    ({**OPEN_MPI_ENV, "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (1, 2)),
    ({**HYDRA_ENV, "MPI_LOCALRANKID": "1"}, (1, 2)),
    ({**SRUN_PMI2_ENV, "SLURM_STEP_TASKS_PER_NODE": "2"}, (1, 2)),
    ({**SRUN_PMIX_ENV, "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, (1, 2)),
    ({**SRUN_STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}, (1, None)),  # which node: not told
    ({"PMIX_RANK": "3", "PMIX_NAMESPACE": "prterun-vm-1@1", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"},
     (1, 2)),
])
def test_the_launcher_tells_this_processes_place_on_its_host(environ, place):
    launcher = detect_launcher(environ)
    assert (launcher.local_rank, launcher.local_size) == place


@pytest.mark.parametrize("text, vendor, name, version, interfaces", [
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25\nMPICH ABI:          18:2:6\n"
     "MPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra:gforker\n", ("MPICH", (5, 0, 2)),
     "MPICH", "5.0.2", {PMI}),
    ("MPICH Version:      4.2.0\nMPICH configure:    --with-pmix=/usr --with-pm=no\n", ("MPICH", (4, 2, 0)),
     "MPICH", "4.2.0", None),
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11\0",
     ("Open MPI", (5, 0, 11)), "Open MPI", "5.0.11", {PMIX}),
    ("Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6", ("Open MPI", (4, 1, 6)), "Open MPI",
     "4.1.6", None),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n", ("Intel MPI", (2021, 10)), "Intel MPI", "2021.10", None),
    ("MVAPICH2 Version :\t2.3.7\nMVAPICH2 Configure: --with-pm=hydra\n", ("MVAPICH2", (2, 3, 7)),
     "MVAPICH", "2.3.7", {PMI}),
    ("", ("Some MPI", (1, 2)), "Some MPI", "1.2", None),
])
def test_the_library_is_named_from_its_version_string_before_mpi_init(text, vendor, name, version,
                                                                       interfaces):
    library = parse_library_version(text, vendor, "/x/libmpi.so")
    assert (library.name, library.version) == (name, version)
    assert library.interfaces == (None if interfaces is None else frozenset(interfaces))
    assert library.label == f"{name} {version} (/x/libmpi.so)"


def test_the_library_file_is_found_among_the_mapped_files(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 08:01 1 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /venv/lib/libmpi.so.12\n"
                    "7f04-7f05 rw-p 00000000 00:00 0 \n"
                    "7f06-7f07 r-xp 00000000 08:01 3 /site/nvidia/nccl/lib/libnccl.so.2\n")
    assert loaded_library(r"/lib(mpi|mpich)[^/]*\.so[.\d]*$", str(maps)) == "/venv/lib/libmpi.so.12"
    assert loaded_library(r"/libnccl\.so\.2$", str(maps)) == "/site/nvidia/nccl/lib/libnccl.so.2"
    assert loaded_library(r"/libfoo\.so$", str(maps)) is None
    assert loaded_library(r"x", str(tmp_path / "missing")) is None


@pytest.mark.parametrize("environ, library, reason", [
    # The filed case: Open MPI's mpiexec (PMIx) starting the MPICH venv's Python.
    (OPEN_MPI_ENV, MPICH, "MPICH speaks only PMI-1/PMI-2, so MPI_Init would abort (\"unsupported PMI "
                          "version PMIx\", exit status 16)"),
    (SRUN_PMIX_ENV, MPICH, "MPICH speaks only PMI-1/PMI-2"),
    ({**HYDRA_ENV, "PMIX_NAMESPACE": "slurm.pmix.8.0"}, MPICH,
     "both PMI_SIZE (from Hydra mpiexec (MPICH, Intel MPI)) and PMIX_NAMESPACE=slurm.pmix.8.0"),
    # The reverse: Hydra (PMI) starting the Open MPI venv's Python.
    (HYDRA_ENV, OPEN_MPI, "Open MPI speaks only PMIx, so every process would start as rank 0 of a "
                          "world of 1 and train alone"),
    (SRUN_PMI2_ENV, OPEN_MPI, "Open MPI speaks only PMIx"),
])
def test_a_launcher_the_library_cannot_understand_is_found_before_mpi_init(environ, library, reason):
    message = diagnose(detect_launcher(environ), library, environ)
    assert message is not None
    assert message.startswith(f"gradsync: {detect_launcher(environ).name} started 2 processes"), message
    assert f"the MPI library this Python's mpi4py loads, {library.label}, cannot join them" in message
    assert reason in message, message
    if environ.get("SLURM_STEP_NUM_TASKS"):
        plugin = "pmix" if library.name == "Open MPI" else "pmi2"
        assert f"Start it with `srun --mpi={plugin}`, the plugin for {library.name}" in message
    else:
        assert f"launch with the mpiexec of {library.name}" in message
        assert f" -n 2 {sys.executable} ...`" in message, message
    if "OMPI_VERSION" in environ:
        assert "started 2 processes (Open MPI 5.0.11" in message, message


@pytest.mark.parametrize("environ, library", [
    (OPEN_MPI_ENV, OPEN_MPI),
    (HYDRA_ENV, MPICH),
    (SRUN_PMIX_ENV, OPEN_MPI),
    (SRUN_PMI2_ENV, MPICH),
    ({}, MPICH),
    ({}, OPEN_MPI),
    ({**OPEN_MPI_ENV, "PMI_SIZE": "2"}, OPEN_MPI),  # Open MPI ignores PMI_* beside PMIx
    ({**HYDRA_ENV, "PMI_SIZE": "1"}, OPEN_MPI),  # one process: a world of 1 is what was asked for
    (SRUN_STEP, MPICH),  # no PMI variables: decided after MPI_Init (launcher_mismatch)
    (OPEN_MPI_ENV, MpiLibrary("Intel MPI", "2021.10")),  # unknown interfaces: no decision
])
def test_a_launcher_the_library_understands_or_cannot_be_judged_passes(environ, library):
    assert diagnose(detect_launcher(environ), library, environ) is None


@pytest.mark.parametrize("environ, library, fix", [
    (SRUN_PMI2_ENV, OPEN_MPI, "Start it with `srun --mpi=pmix`, the plugin for Open MPI"),
    (SRUN_STEP, OPEN_MPI, "Start it with `srun --mpi=pmix`, the plugin for Open MPI"),
    (SRUN_STEP, MPICH, "Start it with `srun --mpi=pmi2`, the plugin for MPICH"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, MPICH, "launch with the mpiexec of MPICH"),
    ({"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"}, OPEN_MPI, "launch with the mpiexec of Open MPI"),
])
def test_a_world_of_one_under_a_launcher_of_two_names_the_mismatch_and_the_fix(environ, library, fix):
    launcher = detect_launcher(environ)
    message = launcher_mismatch(launcher, 1, library)
    assert message is not None
    assert f"{launcher.name} started 2 processes" in message
    assert f"MPI ({library.name} {library.version}) sees a world of 1" in message
    assert fix in message
    if "mpiexec of" in fix:  # the example command is this Python, not whichever is first on PATH
        assert f" -n 2 {sys.executable} ...`" in message, message


@pytest.mark.parametrize("launcher, world_size", [
    (Launcher("none", None), 1),
    (Launcher("srun --mpi=pmix", 2, "srun"), 2),
    (Launcher("srun --mpi=none", 1, "srun"), 1),  # one task: nothing to mismatch
    (Launcher("Open MPI mpirun/mpiexec", 4, "mpiexec"), 2),  # not the world-of-1 trap
])
def test_no_error_when_the_world_is_what_the_launcher_started_or_not_a_world_of_one(launcher,
                                                                                     world_size):
    assert launcher_mismatch(launcher, world_size, MPICH) is None


def test_the_start_up_line_warns_about_one_rank_without_a_launcher_and_informs_otherwise():
    level, line = launch_line(1, 1, MPICH, Launcher("none", None))
    assert level == logging.WARNING
    assert line.startswith(f"gradsync: 1 rank, no launcher, MPI: {MPICH.label}: this process trains alone")
    assert f" -n N {sys.executable} ...`" in line
    level, line = launch_line(4, 2, OPEN_MPI, detect_launcher({**OPEN_MPI_ENV, "OMPI_COMM_WORLD_SIZE": "4"}))
    assert level == logging.INFO
    assert line == f"gradsync: 4 ranks on 2 hosts, MPI: {OPEN_MPI.label}, launcher: Open MPI mpirun/mpiexec"
    assert launch_line(1, 1, MPICH, detect_launcher(HYDRA_ENV))[0] == logging.INFO  # mpiexec -n 1


def test_the_start_up_line_says_how_ranks_wait_and_who_chose_open_mpis_yield():
    assert waiting_note(MPICH, "sleep", {}) == "negotiation waits sleep between tests"
    assert waiting_note(MPICH, "mpi", {}) == "negotiation waits in the blocking MPI call"
    yielding = waiting_note(OPEN_MPI, "sleep", {"OMPI_MCA_mpi_yield_when_idle": "1"}, set_by_gradsync=True)
    assert yielding.endswith("Open MPI's blocking calls yield the core "
                             "(OMPI_MCA_mpi_yield_when_idle=1, set by gradsync)"), yielding
    spinning = waiting_note(OPEN_MPI, "mpi", {"OMPI_MCA_mpi_yield_when_idle": "0"})
    assert spinning.endswith("Open MPI's blocking calls spin on a core the training may need "
                             "(OMPI_MCA_mpi_yield_when_idle=0, as set in the environment)"), spinning


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with this checkout's gradsync and no launcher variables."""
    environ = {k: v for k, v in __import__("os").environ.items()
               if not k.startswith(("PMI", "OMPI_", "SLURM_", "GRADSYNC_"))}
    environ.update(PYTHONPATH=str(REPO / "src"), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=environ, cwd=REPO)


def test_import_gradsync_does_not_import_mpi4py_MPI():
    # Importing mpi4py.MPI initialises MPI, and MPI_Init aborts under a foreign launcher before
    # init() could say why; so only init() may import it.
    result = run_python("import gradsync, gradsync.metrics, sys; assert 'mpi4py.MPI' not in sys.modules, "
                        "sorted(m for m in sys.modules if m.startswith('mpi4py'))")
    assert result.returncode == 0, result.stderr


def test_init_starts_mpi_itself_and_leaves_mpi4py_to_finalize_it_at_exit():
    # rc.finalize=True makes mpi4py finalise MPI at exit although it did not initialise it
    # (test_foreign_launcher.py checks under Open MPI, whose launcher reports a missing
    # MPI_Finalize); rc.initialize reads as before.
    result = run_python(
        "import gradsync, mpi4py\n"
        "gradsync.init()\n"
        "from mpi4py import MPI\n"
        "print(MPI.Is_initialized(), MPI.Query_thread() == MPI.THREAD_MULTIPLE, mpi4py.rc.initialize, "
        "mpi4py.rc.finalize, gradsync.size())\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True", "True", "1"], result.stdout + result.stderr


def test_an_mpi_the_user_initialised_first_is_used_as_it_is():
    result = run_python("from mpi4py import MPI\nimport gradsync\ngradsync.init()\n"
                        "print(gradsync.size(), MPI.Is_initialized())\n")
    assert result.returncode == 0 and result.stdout.split() == ["1", "True"], result.stderr


def test_rank_0_logs_the_start_up_line_visible_by_default():
    result = run_python("import gradsync\ngradsync.init()\n")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "gradsync: 1 rank" in line]
    assert len(lines) == 1 and lines[0].startswith("[gradsync rank 0] WARNING: gradsync: 1 rank, no launcher"), \
        result.stderr
    quiet = run_python("import gradsync\ngradsync.init()\n", GRADSYNC_LOG_LEVEL="error")
    assert quiet.returncode == 0 and "gradsync: 1 rank" not in quiet.stderr, quiet.stderr


@pytest.mark.mpi
def test_under_mpiexec_rank_0_alone_logs_the_start_up_line():
    # The log line goes to stderr and the worker's report to stdout; captured apart, the
    # launcher's chunked forwarding cannot splice one into the other.
    result = run_mpi("init_only.py", 2, timeout=120, separate_stderr=True)
    lines = [line for line in result.stderr.splitlines() if "gradsync: 2 ranks on 1 host" in line]
    assert len(lines) == 1 and lines[0].startswith("[gradsync rank 0] INFO: "), result.stderr
    assert f"MPI: {'Open MPI' if flavour() == 'openmpi' else 'MPICH'} " in lines[0], lines[0]
    assert "no launcher" not in result.stderr
    assert {r: v["size"] for r, v in reports(result.stdout, 2).items()} == {0: 2, 1: 2}, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(("variable", "field"), [
    # Which gradients share buckets: ranks that disagree would submit different collectives.
    ("GRADSYNC_SMALL_GRADIENT_BYTES", "small_gradient_bytes"),
    # Whether an allreduce goes through shared memory: one rank in MPI_Allreduce, the other in
    # MPI_Barrier, would wait for each other for good.
    ("GRADSYNC_SHARED_MEMORY_BYTES", "shared_memory_bytes"),
])
def test_settings_that_differ_by_rank_stop_init_on_every_rank_with_each_ranks_value(variable, field):
    # init() refuses, naming each rank's value, instead of hanging in the first collective.
    if mpiexec() is None:
        pytest.skip("no mpiexec found")
    worker = [sys.executable, str(WORKERS / "init_only.py")]
    if flavour() == "openmpi":
        cmd = [mpiexec(), "-n", "1", "-x", f"{variable}=0", *worker, ":",
               "-n", "1", "-x", f"{variable}=4096", *worker]
    else:
        cmd = [mpiexec(), "-n", "1", "-env", variable, "0", *worker, ":",
               "-n", "1", "-env", variable, "4096", *worker]
    result = run_job(cmd, 120, check=False)
    # Each rank that reports (the launcher may kill one once the other exits) has the error, naming
    # every rank's value.
    message = f"gradsync: {variable} ("  # then why it must match, and each rank's value of it
    errors = {r: v["error"] for r, v in reports(result.stdout, 2, every=False).items()}
    assert result.returncode != 0, result.stdout
    for rank, error in errors.items():
        assert error is not None and error.startswith(message), (rank, error)
        assert error.endswith(f"must be the same on every rank; got rank 0: {field}=0, rank 1: {field}=4096"), error


def test_a_launcher_that_fails_before_starting_any_process_is_launched_again(tmp_path):
    # The harness's retry of Open MPI's random start-up failure (PMIx listener), and only of it.
    count = tmp_path / "launches"
    script = (f"echo x >> {count}; echo \"The PMIx server's listener thread failed to start. We "
              "cannot\"; exit 213")
    result = run_job(["sh", "-c", script], 30, check=False)
    assert result.returncode == 213 and count.read_text().count("x") == 2
    other = tmp_path / "other"
    result = run_job(["sh", "-c", f"echo x >> {other}; echo some other failure; exit 3"], 30, check=False)
    assert result.returncode == 3 and other.read_text().count("x") == 1
