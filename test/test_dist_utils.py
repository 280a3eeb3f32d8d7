"""spawn_gloo, the CPU tests' multi-rank runner: a rank's failure reaches the test."""

from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

from sglang.test.dist_utils import spawn_gloo


def _rank_one_asserts(rank: int, world: int) -> None:
    assert rank == 0, "rank 1 fails"


def _rank_one_aborts(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)


def _all_pass(rank: int, world: int) -> None:
    assert 0 <= rank < world


def test_a_failing_rank_fails_the_test():
    # The first rank to exit reports: rank 1's assertion, or rank 0's barrier losing its peer.
    with pytest.raises(mp.ProcessRaisedException):
        spawn_gloo(_rank_one_asserts, 2)


def test_a_rank_killed_before_its_function_returned_fails_the_test():
    with pytest.raises(mp.ProcessExitedException):
        spawn_gloo(_rank_one_aborts, 2)


def test_ranks_that_all_pass_pass():
    spawn_gloo(_all_pass, 2)
