"""Configuration: init()'s keyword arguments win over GRADSYNC_* variables, which win over defaults.

Single process, no MPI: Config.resolve is given its environment explicitly.
"""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.config import MUST_MATCH, SETTINGS, Config, check_shared, markdown_table
from gradsync.errors import GradsyncError


def test_defaults():
    config = Config.resolve({}, environ={})
    assert config == Config(fusion_threshold=1 << 20, cycle_time=1.0, shutdown_timeout=30.0,
                            log_level="WARNING")


def test_environment_variables_are_parsed():
    config = Config.resolve(environ={
        "GRADSYNC_FUSION_THRESHOLD": "4096",
        "GRADSYNC_CYCLE_TIME": "2.5",
        "GRADSYNC_SHUTDOWN_TIMEOUT": "3",
        "GRADSYNC_LOG_LEVEL": "debug",
    })
    assert config == Config(fusion_threshold=4096, cycle_time=2.5, shutdown_timeout=3.0,
                            log_level="debug")
    assert isinstance(config.fusion_threshold, int) and isinstance(config.shutdown_timeout, float)


def test_keyword_arguments_win_over_the_environment():
    environ = {"GRADSYNC_FUSION_THRESHOLD": "4096", "GRADSYNC_CYCLE_TIME": "2.5"}
    config = Config.resolve({"fusion_threshold": 8192}, environ=environ)
    assert config.fusion_threshold == 8192
    assert config.cycle_time == 2.5  # not overridden: from the environment


def test_a_keyword_argument_of_none_means_not_given():
    config = Config.resolve({"cycle_time": None}, environ={"GRADSYNC_CYCLE_TIME": "7"})
    assert config.cycle_time == 7.0


def test_keyword_values_are_converted_to_the_setting_type():
    config = Config.resolve({"cycle_time": 3, "fusion_threshold": "2048"}, environ={})
    assert config.cycle_time == 3.0 and isinstance(config.cycle_time, float)
    assert config.fusion_threshold == 2048


def test_zero_is_allowed():
    assert Config.resolve(environ={"GRADSYNC_FUSION_THRESHOLD": "0"}).fusion_threshold == 0


def test_variables_of_other_programs_are_ignored():
    # Horovod's are read as fallbacks (tests/test_horovod_env.py); these mean nothing to gradsync.
    assert Config.resolve(environ={"HOROVOD_BATCH_D2D_MEMCOPIES": "1", "NCCL_DEBUG": "INFO",
                                   "PATH": "/bin"}) == Config()


def test_unknown_keyword_is_a_type_error_listing_the_known_ones():
    with pytest.raises(TypeError) as error:
        Config.resolve({"fusion_treshold": 1, "cycle_time": 1.0}, environ={})
    message = str(error.value)
    assert "'fusion_treshold'" in message
    for setting in SETTINGS:
        assert setting.keyword in message


@pytest.mark.parametrize("variable, value", [
    ("GRADSYNC_FUSION_THRESHOLD", "lots"),
    ("GRADSYNC_FUSION_THRESHOLD", "1.5"),
    ("GRADSYNC_CYCLE_TIME", "fast"),
    ("GRADSYNC_SHUTDOWN_TIMEOUT", ""),
])
def test_a_variable_that_does_not_parse_is_a_value_error_naming_it(variable, value):
    with pytest.raises(ValueError, match=variable) as error:
        Config.resolve(environ={variable: value})
    assert repr(value) in str(error.value)


@pytest.mark.parametrize("variable", ["GRADSYNC_FUSION_THRESHOLD", "GRADSYNC_CYCLE_TIME",
                                      "GRADSYNC_SHUTDOWN_TIMEOUT"])
def test_a_negative_value_is_a_value_error(variable):
    with pytest.raises(ValueError, match=f"{variable}.*must not be negative"):
        Config.resolve(environ={variable: "-1"})


def test_a_bad_keyword_value_is_a_value_error_naming_the_keyword():
    with pytest.raises(ValueError, match=r"init\(fusion_threshold=\.\.\.\)"):
        Config.resolve({"fusion_threshold": "big"}, environ={})
    with pytest.raises(ValueError, match=r"init\(cycle_time=\.\.\.\).*negative"):
        Config.resolve({"cycle_time": -0.5}, environ={})


def test_the_configuration_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().cycle_time = 2.0  # type: ignore[misc]


def test_every_setting_is_a_config_field_with_the_same_default():
    fields = {f.name: f.default for f in dataclasses.fields(Config)}
    assert fields == {s.keyword: s.default for s in SETTINGS}
    assert all(s.env == "GRADSYNC_" + s.keyword.upper() for s in SETTINGS)


def test_every_default_has_its_settings_type():
    for setting in SETTINGS:
        assert type(setting.default) is setting.type, setting.keyword


def test_every_default_passes_its_own_check():
    # The check applies to given values only; a default it refused would be a contradiction.
    for setting in SETTINGS:
        assert setting.check(setting.default) is None, setting.keyword


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.type in (int, float)], ids=lambda s: s.env)
def test_no_numeric_setting_takes_a_negative_value(setting):
    with pytest.raises(ValueError, match=f"{setting.env}='-1' must"):
        Config.resolve(environ={setting.env: "-1"})


@pytest.mark.parametrize("text, expected", [("1", True), ("yes", True), ("ON", True), (" true ", True),
                                            ("0", False), ("no", False), ("Off", False), ("", False)])
def test_boolean_settings_read_the_usual_spellings(text, expected):
    config = Config.resolve(environ={"GRADSYNC_AUTOTUNE": text, "GRADSYNC_CALLER_RUNS": text})
    assert config.autotune is expected and config.caller_runs is expected


def test_a_boolean_that_is_not_one_names_the_variable():
    with pytest.raises(ValueError, match="GRADSYNC_HIERARCHICAL_ALLREDUCE='maybe' is not a valid bool value"):
        Config.resolve(environ={"GRADSYNC_HIERARCHICAL_ALLREDUCE": "maybe"})
    assert Config.resolve({"hierarchical_allreduce": True}, environ={}).hierarchical_allreduce is True


@pytest.mark.parametrize("variable, good, bad", [
    ("GRADSYNC_JOIN_DIVISOR", ["size", "contributors"], "ranks"),
    ("GRADSYNC_WAIT_POLICY", ["sleep", "mpi"], "spin"),
])
def test_a_named_choice_takes_its_names_only(variable, good, bad):
    field = variable.removeprefix("GRADSYNC_").lower()
    for name in good:
        assert getattr(Config.resolve(environ={variable: name}), field) == name
    with pytest.raises(ValueError, match=f"{variable}='{bad}' must be one of '{good[0]}', '{good[1]}'"):
        Config.resolve(environ={variable: bad})


def test_the_settings_every_rank_must_share():
    assert {s.keyword for s in MUST_MATCH} == {
        "fusion_threshold", "cache_capacity", "join_divisor", "rank_failure_timeout_seconds",
        "small_gradient_bytes", "wait_policy", "shared_memory_bytes", "shared_memory_threshold"}


class FakeComm:
    """allgather of a world where the other ranks hold ``others`` (tuples of MUST_MATCH values)."""

    def __init__(self, *others):
        self.others, self.sent = others, []

    def allgather(self, mine):
        self.sent.append(mine)
        return [mine, *self.others]


def test_ranks_that_share_their_settings_pass_the_check():
    config = Config.resolve({"fusion_threshold": 4096}, environ={})
    mine = (4096, 256 << 10, "mpi", 2 << 20, 512 << 10, 30.0, "size", 1024)  # in MUST_MATCH's order
    comm = FakeComm(mine, mine)
    assert check_shared(comm, config) is None
    assert comm.sent == [mine]


def test_ranks_that_differ_fail_alike_naming_the_settings_and_each_ranks_value():
    config = Config()
    other = tuple(getattr(config, s.keyword) for s in MUST_MATCH)
    other = tuple(4096 if s.keyword == "small_gradient_bytes" else
                  "contributors" if s.keyword == "join_divisor" else value
                  for s, value in zip(MUST_MATCH, other))
    with pytest.raises(GradsyncError) as error:
        check_shared(FakeComm(other), config)
    assert str(error.value) == (
        "gradsync: GRADSYNC_SMALL_GRADIENT_BYTES (which gradients share buckets) and "
        "GRADSYNC_JOIN_DIVISOR (what Average divides by) must be the same on every rank; got "
        "rank 0: small_gradient_bytes=262144, join_divisor=size, "
        "rank 1: small_gradient_bytes=4096, join_divisor=contributors")


def test_the_markdown_table_lists_every_variable():
    table = markdown_table()
    for setting in SETTINGS:
        assert f"`{setting.env}`" in table


@pytest.mark.parametrize("value", ["0.1", "0.49"])
def test_a_rank_failure_timeout_below_half_a_second_is_refused(value):
    with pytest.raises(ValueError, match="GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS.*0 \\(off\\) or at least 0.5"):
        Config.resolve(environ={"GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": value})
    assert Config.resolve(environ={"GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": "0"}).rank_failure_timeout_seconds == 0

