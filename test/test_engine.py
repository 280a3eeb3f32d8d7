"""sglang.Engine: output shapes, streaming, validation, aborts, startup errors, shutdown."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest

import sglang as sgl
from sglang.srt.utils.process import descendant_pids
from sglang.test.server_utils import wait_until_gone

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = sgl.Engine(model_path=tiny_llama_dir, device="cpu", max_total_tokens=1024, log_level="warning")
    yield engine
    engine.shutdown()


def _pids(engine) -> list[int]:
    procs = [p.pid for p in engine._subprocesses.procs]
    return procs + [d for p in procs for d in descendant_pids(p)]


def _wait_kv_pool_full(engine, timeout: float = 10.0) -> None:
    """The scheduler applies an abort at its next iteration: poll until the pool is full."""
    deadline = time.monotonic() + timeout
    while True:
        states = engine.get_server_info()["internal_states"]
        if all(s["available_kv_tokens"] == s["max_total_num_tokens"] for s in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def test_output_shape(engine):
    out = engine.generate("The capital of France", GREEDY)
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 8
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8 and meta["prompt_tokens"] > 0
    assert {"id", "cached_tokens"} <= set(meta)
    again = engine.generate("The capital of France", GREEDY)
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0  # prefix cache hit

    outs = engine.generate(["a", "The quick brown fox"], [GREEDY, {**GREEDY, "max_new_tokens": 3}])
    assert [len(o["output_ids"]) for o in outs] == [8, 3]
    outs = engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=GREEDY)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 2]
    assert engine.generate("x", {"max_new_tokens": 0})["output_ids"] == []


def test_logprobs(engine):
    out = engine.generate("Hello", GREEDY, return_logprob=True, top_logprobs_num=2)
    lps, tops = out["meta_info"]["output_token_logprobs"], out["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(len(t) == 2 and abs(t[0][0] - lp[0]) < 1e-4 for t, lp in zip(tops, lps))


def test_stream_matches_non_stream(engine):
    full = engine.generate("Once upon a time", GREEDY)
    chunks = list(engine.generate("Once upon a time", GREEDY, stream=True))
    assert len(chunks) > 1
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert all(full["text"].startswith(c["text"]) for c in chunks)


def test_invalid_requests_raise(engine):
    for kwargs in (
        {"prompt": ""},
        {"prompt": "x", "sampling_params": {"temperature": -1}},
        {"prompt": "x", "sampling_params": {"max_new_tokens": 10**6}},
        {"prompt": "x", "sampling_params": {"bogus": 1}},
        {"input_ids": [10**7]},
        {"prompt": "x", "input_ids": [1]},
    ):
        with pytest.raises(ValueError):
            engine.generate(**kwargs)
    assert len(engine.generate("still works", GREEDY)["output_ids"]) == 8


def test_abandoned_stream_is_aborted(engine, caplog):
    stream = engine.generate("a long one", {**GREEDY, "max_new_tokens": 400}, stream=True)
    rid = next(stream)["meta_info"]["id"]
    with caplog.at_level(logging.INFO, logger="sglang.srt.managers.tokenizer_manager"):
        stream.close()  # aborts the request: its KV goes back to the pool
    assert f"Aborted request {rid}" in caplog.text
    _wait_kv_pool_full(engine)
    assert len(engine.generate("next", GREEDY)["output_ids"]) == 8


def test_zz_shutdown_leaves_no_processes(engine):
    pids = _pids(engine)
    assert len(pids) >= 2
    engine.shutdown()
    assert wait_until_gone(pids) == []
    engine.shutdown()  # idempotent


def test_startup_failure_reports_scheduler_error(tiny_llama_dir, tmp_path):
    broken = tmp_path / "no_weights"
    broken.mkdir()
    for name in os.listdir(tiny_llama_dir):
        if not name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(os.path.join(tiny_llama_dir, name), broken / name)
    before = set(descendant_pids(os.getpid()))
    with pytest.raises(RuntimeError, match="failed to start"):
        sgl.Engine(model_path=str(broken), device="cpu", log_level="error")
    leftover = [p for p in set(descendant_pids(os.getpid())) - before if _cmdline(p).find("resource_tracker") < 0]
    assert wait_until_gone(leftover) == []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_context_manager(tiny_llama_dir):
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu", log_level="warning") as engine:
        pids = _pids(engine)
        info = engine.get_server_info()
        assert json.dumps(info)  # plain data
        assert info["model_path"] == tiny_llama_dir and len(info["internal_states"]) == 1
    assert wait_until_gone(pids) == []
