"""TP, DP replicas and DP attention end to end (CPU, gloo): greedy tokens equal the single-rank run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

import sglang as sgl
from sglang.srt.utils.process import descendant_pids
from sglang.test.server_utils import _PYTHON_DIR, find_free_port, kill_server, popen_launch_server, wait_until_gone

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 250, 11, 12, 13, 14, 15, 16],
    [8, 9, 10],
    [100, 101, 102, 103, 104, 105, 106],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
]
# Different lengths so that requests finish at different steps.
MAX_NEW = [10, 4, 7, 12]


def _params(n):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def _generate(engine, prompts=PROMPTS, max_new=MAX_NEW):
    outs = engine.generate(input_ids=prompts, sampling_params=[_params(n) for n in max_new])
    return [o["output_ids"] for o in outs]


def _single_rank_reference(path: str) -> tuple[str, list[list[int]]]:
    with sgl.Engine(model_path=path, device="cpu") as engine:
        return path, _generate(engine)


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def model_and_reference(request, tiny_llama_dir, tiny_deepseek_v3_dir):
    return _single_rank_reference(tiny_llama_dir if request.param == "llama" else tiny_deepseek_v3_dir)


@pytest.fixture(scope="module")
def llama_and_reference(tiny_llama_dir):
    return _single_rank_reference(tiny_llama_dir)


def _states(engine):
    return engine.get_server_info()["internal_states"]


def _assert_pool_full(engine):
    for s in _states(engine):
        assert s["available_kv_tokens"] == s["max_total_num_tokens"]


@pytest.mark.parametrize(
    "args",
    [
        {"tp_size": 2},
        {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "debug_collectives": True},
        {"dp_size": 2},
    ],
    ids=["tp2", "tp2-dp2-dpattn", "dp2-replicas"],
)
def test_greedy_equals_single_rank(model_and_reference, args):
    path, reference = model_and_reference
    with sgl.Engine(model_path=path, device="cpu", chunked_prefill_size=8, **args) as engine:
        assert _generate(engine) == reference
        # One request only: the other DP rank idles through every step.
        assert _generate(engine, PROMPTS[3:], MAX_NEW[3:]) == reference[3:]
        _assert_pool_full(engine)


def test_dp_attention_uneven_load_and_plan_sync(model_and_reference):
    path, reference = model_and_reference
    args = [
        "--device",
        "cpu",
        "--tp-size",
        "2",
        "--dp-size",
        "2",
        "--enable-dp-attention",
        "--load-balance-method",
        "round_robin",
    ]
    server = popen_launch_server(path, args + ["--chunked-prefill-size", "4"])
    try:
        results = {}

        def run(i, delay):
            time.sleep(delay)
            body = {"input_ids": PROMPTS[i], "sampling_params": _params(MAX_NEW[i])}
            results[i] = requests.post(f"{server.base_url}/generate", json=body, timeout=120).json()["output_ids"]

        # Staggered arrivals: later requests land while the other rank is mid-decode, and the
        # long prompt is chunked (4 tokens per chunk) on one rank while the other decodes.
        threads = [threading.Thread(target=run, args=(i, 0.3 * i)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results.get(i) for i in range(len(PROMPTS))] == reference
        states = requests.get(f"{server.base_url}/get_server_info", timeout=30).json()["internal_states"]
        assert [s["dp_rank"] for s in states] == [0, 1]
        for s in states:
            # Exactly one plan all-gather per scheduler iteration, and one gathered buffer.
            assert abs(s["plan_all_gathers"] - s["iterations"]) <= 1
            assert s["gathered_buffer_bytes"] > 0
            assert s["available_kv_tokens"] == s["max_total_num_tokens"]
        assert re.search(r"DP1 TP1\] Prefill batch", server.log_tail(200000))
    finally:
        kill_server(server)


def test_stuck_rank_trips_the_watchdog_and_the_server_exits(tiny_llama_dir):
    args = ["--device", "cpu", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--watchdog-timeout", "6"]
    server = popen_launch_server(tiny_llama_dir, args)
    children = descendant_pids(server.pid)
    try:
        states = requests.get(f"{server.base_url}/get_server_info", timeout=30).json()["internal_states"]
        # Freeze DP rank 1: rank 0 then waits in the per-iteration all-gather until its watchdog fires.
        os.kill(states[1]["pid"], signal.SIGSTOP)
        server.wait(timeout=60)
        log = server.log_tail(20000)
        assert "watchdog" in log.lower() and "exited unexpectedly" in log
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_server(server)
    assert wait_until_gone(children) == []


@pytest.mark.parametrize("dp_attention", [False, True], ids=["tp2", "tp2-dp2-dpattn"])
def test_two_nodes_on_one_machine(llama_and_reference, dp_attention):
    """--nnodes 2: node 1 runs tp rank 1 only; node 0 runs rank 0 and the HTTP server
    (one model is enough for the launch topology)."""
    path, reference = llama_and_reference
    port = find_free_port(span=8)  # the rendezvous port and the ZMQ ports after it
    args = ["--device", "cpu", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    if dp_attention:
        args += ["--dp-size", "2", "--enable-dp-attention"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PYTHON_DIR, os.environ.get("PYTHONPATH")])))
    node1 = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", path, *args, "--node-rank", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    node1_children: list[int] = []
    try:
        server = popen_launch_server(path, [*args, "--node-rank", "0"])
        node1_children = descendant_pids(node1.pid)
        try:
            outs = []
            for prompt, n in zip(PROMPTS, MAX_NEW):
                body = {"input_ids": prompt, "sampling_params": _params(n)}
                outs.append(requests.post(f"{server.base_url}/generate", json=body, timeout=120).json()["output_ids"])
            assert outs == reference
        finally:
            kill_server(server)
    finally:
        kill_server(node1)
    assert wait_until_gone(node1_children) == []
