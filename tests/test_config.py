"""Configuration: init()'s keyword arguments win over GRADSYNC_* variables, which win over defaults.

Single process, no MPI: Config.resolve is given its environment explicitly.
"""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.config import SETTINGS, Config, markdown_table


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
        assert setting.field in message


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
    assert fields == {s.field: s.default for s in SETTINGS}
    assert all(s.env == "GRADSYNC_" + s.field.upper() for s in SETTINGS)


def test_the_markdown_table_lists_every_variable():
    table = markdown_table()
    for setting in SETTINGS:
        assert f"`{setting.env}`" in table


@pytest.mark.parametrize("value", ["0.1", "0.49"])
def test_a_rank_failure_timeout_below_half_a_second_is_refused(value):
    with pytest.raises(ValueError, match="GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS.*0 \\(off\\) or at least 0.5"):
        Config.resolve(environ={"GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": value})
    assert Config.resolve(environ={"GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS": "0"}).rank_failure_timeout_seconds == 0

