"""The scheduler's host phases: what each iteration's wall time went to, per busy iteration."""

import time

import pytest

from sglang.srt.managers.scheduler_phases import IterationPhases


def test_schedule_is_the_rest_and_idle_iterations_do_not_count():
    phases = IterationPhases()
    phases.begin()
    phases.end(time.perf_counter() - 1.0)  # nothing launched or processed: not counted
    assert phases.take_log_text() == ""

    for _ in range(2):
        phases.begin()
        started = time.perf_counter() - 0.010
        phases.add("launch", 0.002)
        phases.add("wait", 0.003)
        phases.add("process", 0.001)
        phases.add("wait", 0.001)  # a second step processed in the same iteration adds up
        phases.end(started)
    us = phases.per_iteration_us()
    assert us["launch"] == pytest.approx(2000) and us["wait"] == pytest.approx(4000)
    assert us["process"] == pytest.approx(1000)
    assert 3000 <= us["schedule"] < 3000 + 5000  # 10 ms of wall time less the 7 ms measured
    text = phases.take_log_text()
    assert text.startswith("host us/iter: launch 2000, wait 4000, process 1000, schedule ")
    assert phases.take_log_text() == ""  # the window starts again after each log line
