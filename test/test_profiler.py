"""The torch profiler on real scheduler ranks (Engine.start_profile / stop_profile)."""

from __future__ import annotations

import os
import time

import pytest

import sglang as sgl


def _complete_files(path: str) -> list[str]:
    """The profile files written in full (a file in progress has ".partial." in its name)."""
    return sorted(n for n in os.listdir(path) if ".partial." not in n) if os.path.isdir(path) else []


def _wait_for_files(path: str, count: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(names := _complete_files(path)) >= count:
            return names
        time.sleep(0.2)
    return _complete_files(path)


def test_every_dp_rank_profiles_and_stops_after_num_steps(tiny_llama_dir, tmp_path):
    out = str(tmp_path / "prof")
    with sgl.Engine(model_path=tiny_llama_dir, tp_size=2, dp_size=2, enable_dp_attention=True, log_level="warning") as engine:
        with pytest.raises(RuntimeError, match="not running"):
            engine.stop_profile()
        engine.start_profile(output_dir=out, num_steps=3)
        engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 8, "ignore_eos": True})
        names = _wait_for_files(out, 4)
        # Both ranks (one of them idle) stopped by themselves after 3 iterations.
        assert [n.split("-", 2)[2] for n in names] == [
            "DP0-TP0.trace.json.gz",
            "DP0-TP0.txt",
            "DP1-TP1.trace.json.gz",
            "DP1-TP1.txt",
        ]
        with pytest.raises(RuntimeError, match="not running"):
            engine.stop_profile()
        with pytest.raises(RuntimeError, match="num_steps"):
            engine.start_profile(num_steps=0)
