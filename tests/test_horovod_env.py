"""Horovod's environment variables are read as fallbacks of the GRADSYNC_ ones.

Single process, no MPI, no torch: Config.resolve is given its environment explicitly.
"""

from __future__ import annotations

import pytest

from gradsync.config import SETTINGS, Config, markdown_table

HOROVOD_ONLY = {
    "HOROVOD_FUSION_THRESHOLD": "4096", "HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_CACHE_CAPACITY": "16",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "7", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "70",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_TIMELINE": "/tmp/trace.json",
    "HOROVOD_AUTOTUNE": "1", "HOROVOD_GPU_OPERATIONS": "MPI", "HOROVOD_LOG_LEVEL": "INFO",
}


def test_horovod_variables_set_what_they_set_in_horovod():
    config = Config.resolve({}, environ=HOROVOD_ONLY)
    assert config == Config(fusion_threshold=4096, cycle_time=3.5, cache_capacity=16,
                            stall_check_time_seconds=7.0, stall_shutdown_time_seconds=70.0,
                            hierarchical_allreduce=True, timeline="/tmp/trace.json", autotune=True,
                            gpu_operations="MPI", log_level="INFO")


def test_gradsync_variables_and_keywords_win_over_horovods():
    environ = {"HOROVOD_FUSION_THRESHOLD": "4096", "GRADSYNC_FUSION_THRESHOLD": "8192",
               "HOROVOD_CYCLE_TIME": "3.5"}
    assert Config.resolve({}, environ=environ).fusion_threshold == 8192
    assert Config.resolve({"cycle_time": 9.0}, environ=environ).cycle_time == 9.0


def test_dynamic_timeline_opens_no_file_at_init():
    assert Config.resolve({}, environ={"HOROVOD_TIMELINE": "DYNAMIC"}).timeline == ""


@pytest.mark.parametrize("horovod, ours", [("TRACE", "DEBUG"), ("FATAL", "CRITICAL"),
                                           ("warning", "warning")])
def test_horovods_log_levels(horovod, ours):
    assert Config.resolve({}, environ={"HOROVOD_LOG_LEVEL": horovod}).log_level == ours


def test_stall_check_disable_turns_the_inspector_off():
    environ = {"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "7"}
    assert Config.resolve({}, environ=environ).stall_check_time_seconds == 0.0


def test_a_bad_horovod_value_names_horovods_variable():
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='lots'"):
        Config.resolve({}, environ={"HOROVOD_FUSION_THRESHOLD": "lots"})
    with pytest.raises(ValueError, match="HOROVOD_GPU_OPERATIONS='DDL'"):
        Config.resolve({}, environ={"HOROVOD_GPU_OPERATIONS": "DDL"})


def test_the_table_lists_each_fallback():
    table = markdown_table()
    for setting in SETTINGS:
        if setting.horovod:
            assert f"`{setting.horovod}`" in table
    assert {s.horovod for s in SETTINGS if s.horovod} == set(HOROVOD_ONLY)
