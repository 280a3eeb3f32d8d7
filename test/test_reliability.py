"""Reliability against a REAL server (python -m sglang.launch_server, CPU, tiny models):
a battery of malformed requests, the mixed load test (benchmark/load_test.py) with client
aborts on a plain, a speculative (NEXTN) and a DP-attention server, a killed scheduler, a
killed launching script, and --enable-nan-detection on a model whose weights contain NaN."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.sampling.sampler import NAN_TOKEN_ID, Sampler, SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.process import descendant_pids
from sglang.test.server_utils import kill_server, popen_launch_server, wait_until_gone
from sglang.test.tiny_models import make_tiny_llama

CONTEXT_LEN = 256
MODEL = "tiny"
LOAD_TEST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmark", "load_test.py")
BASE_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--context-length", str(CONTEXT_LEN)]

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
_CMPL = {"model": MODEL, "prompt": "hi"}


def _gen(**params):
    return {"text": "hi", "sampling_params": params}


# (path, JSON body): each must be refused with a 4xx and an OpenAI-style JSON error.
MALFORMED = [
    # /generate: prompts
    ("/generate", {}),
    ("/generate", {"text": ""}),
    ("/generate", {"text": 123}),
    ("/generate", {"text": "x", "input_ids": [1]}),
    ("/generate", {"input_ids": []}),
    ("/generate", {"input_ids": [-1]}),
    ("/generate", {"input_ids": [10**6]}),
    ("/generate", {"input_ids": ["a"]}),
    ("/generate", {"input_ids": [1] * (CONTEXT_LEN + 10)}),
    ("/generate", {"text": "hello " * (2 * CONTEXT_LEN)}),
    ("/generate", {"text": ["a", "b"], "rid": ["same", "same"]}),
    ("/generate", {"text": ["a", "b"], "stream": True}),
    ("/generate", {"text": "x", "top_logprobs_num": -1, "return_logprob": True}),
    ("/generate", {"text": "x", "unknown_field": 1}),
    # /generate: sampling params
    ("/generate", {"text": "x", "sampling_params": "greedy"}),
    ("/generate", _gen(max_new_tokens=-1)),
    ("/generate", _gen(max_new_tokens=10**9)),
    ("/generate", _gen(max_new_tokens="8")),
    ("/generate", _gen(temperature=-0.5)),
    ("/generate", _gen(top_p=0)),
    ("/generate", _gen(top_p=1.5)),
    ("/generate", _gen(top_k=-2)),
    ("/generate", _gen(n=129)),
    ("/generate", _gen(stop=[""])),
    ("/generate", _gen(stop=[1, 2])),
    ("/generate", _gen(stop_token_ids=[-3])),
    ("/generate", _gen(no_such_param=1)),
    # /v1/completions
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/completions", {**_CMPL, "model": "no-such-model"}),
    ("/v1/completions", {"model": MODEL}),
    ("/v1/completions", {**_CMPL, "prompt": []}),
    ("/v1/completions", {**_CMPL, "prompt": [[-1]]}),
    ("/v1/completions", {**_CMPL, "max_tokens": -5}),
    ("/v1/completions", {**_CMPL, "max_tokens": 10**9}),
    ("/v1/completions", {**_CMPL, "temperature": -1}),
    ("/v1/completions", {**_CMPL, "top_p": 0}),
    ("/v1/completions", {**_CMPL, "logprobs": 21}),
    ("/v1/completions", {**_CMPL, "logprobs": -1}),
    ("/v1/completions", {**_CMPL, "n": 0}),
    ("/v1/completions", {**_CMPL, "stop": ["", "x"]}),
    ("/v1/completions", {**_CMPL, "stop": 7}),
    ("/v1/completions", {**_CMPL, "best_of": 2}),
    # /v1/chat/completions
    ("/v1/chat/completions", {"model": MODEL}),
    ("/v1/chat/completions", {**_CHAT, "messages": []}),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {**_CHAT, "model": "gpt-4"}),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": -1}),
    ("/v1/chat/completions", {**_CHAT, "top_p": 2}),
    ("/v1/chat/completions", {**_CHAT, "top_k": -5}),
    ("/v1/chat/completions", {**_CHAT, "temperature": "hot"}),
    ("/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": 30}),
    ("/v1/chat/completions", {**_CHAT, "top_logprobs": 2}),
    ("/v1/chat/completions", {**_CHAT, "logprobs": "yes please"}),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": "x " * (2 * CONTEXT_LEN)}]}),
]


@pytest.fixture(scope="module")
def server(tiny_llama_unsharded_dir):
    proc = popen_launch_server(tiny_llama_unsharded_dir, BASE_ARGS + ["--enable-metrics", "--log-requests"])
    yield proc
    kill_server(proc)


def _assert_json_4xx(r: requests.Response, what) -> None:
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    assert r.json()["error"]["message"], (what, r.text[:300])


def _assert_kv_full(server) -> None:
    for s in requests.get(server.base_url + "/get_server_info", timeout=60).json()["internal_states"]:
        assert s["available_kv_tokens"] == s["max_total_num_tokens"], s


def _load_test(server, num_requests: int, *extra: str) -> None:
    cmd = [sys.executable, LOAD_TEST, "--base-url", server.base_url, "--num-requests", str(num_requests)]
    cmd += ["--concurrency", "16", "--abort-fraction", "0.1", "--max-tokens", "8", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:] + server.log_tail()
    assert '"server_errors": 0' in done.stdout


def _load_test_module():
    spec = importlib.util.spec_from_file_location("load_test", LOAD_TEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_load_test_checks_catch_bad_responses():
    """The load test's checks fail on what they must catch (so a green run means something)."""
    lt = _load_test_module()
    spec = lt.Spec(0, "/generate", True, False, "hi", max_tokens=2, temperature=0.0)
    good = {
        "text": "ab",
        "output_ids": [5, 6],
        "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 1, "completion_tokens": 2},
    }
    lt.check_generate(spec, good)
    too_long = {**good, "output_ids": [5, 6, 7], "meta_info": {**good["meta_info"], "completion_tokens": 3}}
    unfinished = {**good, "meta_info": {**good["meta_info"], "finish_reason": None}}
    miscounted = {**good, "output_ids": [5]}
    for bad in (too_long, unfinished, miscounted):
        with pytest.raises(AssertionError):
            lt.check_generate(spec, bad)

    def stream(*events: str) -> httpx.Response:
        return httpx.Response(200, content="".join(f"data: {e}\n\n" for e in events).encode())

    snapshot = lambda text, ids: json.dumps({**good, "text": text, "output_ids": ids})
    assert asyncio.run(lt.check_stream(spec, stream(snapshot("a", [5]), snapshot("ab", [5, 6]), "[DONE]"))) == "ab"
    with pytest.raises(AssertionError):  # a snapshot that rewrites earlier text
        asyncio.run(lt.check_stream(spec, stream(snapshot("x", [5]), snapshot("ab", [5, 6]), "[DONE]")))
    with pytest.raises(ValueError):  # no [DONE]
        asyncio.run(lt.check_stream(spec, stream(snapshot("ab", [5, 6]))))


# ---------------------------------------------------------------------- plain server
def test_malformed_requests_get_json_4xx(server):
    assert len(MALFORMED) >= 30
    for path, body in MALFORMED:
        _assert_json_4xx(requests.post(server.base_url + path, json=body, timeout=60), (path, body))
    raw = [
        (b"{oops", "application/json"),  # malformed JSON
        (b"[1, 2]", "application/json"),  # JSON, but not an object
        (b"text=hi", "text/plain"),
        (b"x" * (33 << 20), "application/json"),  # larger than the 32 MiB body limit
    ]
    for data, ctype in raw:
        r = requests.post(server.base_url + "/generate", data=data, headers={"Content-Type": ctype}, timeout=60)
        _assert_json_4xx(r, data[:20])
    _assert_json_4xx(requests.get(server.base_url + "/generate", timeout=60), "GET /generate")
    _assert_json_4xx(requests.post(server.base_url + "/no/such/route", json={}, timeout=60), "unknown route")
    good = requests.post(server.base_url + "/generate", json=_gen(max_new_tokens=4), timeout=60)
    assert good.status_code == 200 and good.json()["meta_info"]["finish_reason"] is not None
    _assert_kv_full(server)


def test_load_plain(server):
    _load_test(server, 200)


def test_metrics_after_requests(server):
    for stream in (False, True):
        body = {"text": "the quick brown", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}, "stream": stream}
        assert requests.post(server.base_url + "/generate", json=body, timeout=60).status_code == 200
    text = requests.get(server.base_url + "/metrics", timeout=60).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    model = f'model_name="{MODEL}"'
    assert values[f"sglang:num_requests_total{{{model}}}"] >= 2
    assert values[f"sglang:generation_tokens_total{{{model}}}"] >= 10
    assert values[f"sglang:prompt_tokens_total{{{model}}}"] >= 2
    assert values[f"sglang:time_to_first_token_seconds_count{{{model}}}"] >= 1
    assert values[f"sglang:time_per_output_token_seconds_count{{{model}}}"] >= 1
    assert values[f"sglang:e2e_request_latency_seconds_count{{{model}}}"] >= 2
    rank = f'dp_rank="0",{model}'
    assert values[f"sglang:num_running_reqs{{{rank}}}"] == 0 and values[f"sglang:num_queue_reqs{{{rank}}}"] == 0
    assert values[f"sglang:token_usage{{{rank}}}"] == 0.0
    assert not any(k.startswith("sglang:spec_accept_length") for k in values)  # no speculation here
    log = server.log_tail(1 << 22)
    assert "Finished " in log and "finish_reason=" in log and "completion_tokens=5" in log


# ---------------------------------------------------------------------- other servers
def test_load_speculative_nextn(tiny_deepseek_v3_dir):
    args = BASE_ARGS + [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
        "--enable-metrics",
    ]
    proc = popen_launch_server(tiny_deepseek_v3_dir, args)
    try:
        _load_test(proc, 200)
        metrics = requests.get(proc.base_url + "/metrics", timeout=60).text
        assert 'sglang:spec_accept_length{dp_rank="0"' in metrics
    finally:
        kill_server(proc)


def test_load_dp_attention(tiny_llama_unsharded_dir):
    args = BASE_ARGS + ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
    proc = popen_launch_server(tiny_llama_unsharded_dir, args)
    try:
        _load_test(proc, 200)
        states = requests.get(proc.base_url + "/get_server_info", timeout=60).json()["internal_states"]
        assert [s["dp_rank"] for s in states] == [0, 1]
    finally:
        kill_server(proc)


def test_killed_scheduler_makes_the_server_exit(tiny_llama_unsharded_dir):
    watchdog = 10
    args = BASE_ARGS + ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--watchdog-timeout", str(watchdog)]
    proc = popen_launch_server(tiny_llama_unsharded_dir, args)
    try:
        children = descendant_pids(proc.pid)
        states = requests.get(proc.base_url + "/get_server_info", timeout=60).json()["internal_states"]
        os.kill(states[1]["pid"], signal.SIGKILL)
        assert proc.wait(watchdog + 5) != 0
        assert "exited unexpectedly" in proc.log_tail()
        assert wait_until_gone(children) == []
    finally:
        kill_server(proc)


# A stand-in server for popen_launch_server: /health answers 200 on the --port it is given.
_HEALTH_ONLY_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

# Launches the stand-in, prints its pid and waits to be killed.
_LAUNCHER = f"""
import time
from sglang.test.server_utils import popen_launch_server
proc = popen_launch_server("unused", launcher=("-c", {_HEALTH_ONLY_SERVER!r}), timeout=60)
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_server_ends_with_the_process_that_launched_it():
    """A benchmark script killed outright (`timeout -s KILL`) leaves no server behind."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(launcher.stdout.readline())
    finally:
        launcher.kill()
        launcher.wait()
    assert wait_until_gone([server_pid]) == []


# ---------------------------------------------------------------------- NaN
POISONED_TOKEN = 100


@pytest.fixture(scope="module")
def nan_llama_dir(tmp_path_factory) -> str:
    """A tiny Llama whose embedding row POISONED_TOKEN is NaN: a prompt holding that token
    has NaN logits; others (and the warm-up on token 0) are clean."""
    path = make_tiny_llama(str(tmp_path_factory.mktemp("rel_nan_llama")))
    weights_file = os.path.join(path, "model.safetensors")
    weights = load_file(weights_file)
    weights["model.embed_tokens.weight"][POISONED_TOKEN] = float("nan")
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


def test_sampler_flags_non_finite_rows_only_when_asked():
    logits = torch.randn(3, 16)
    logits[1, 4], logits[2, 0] = float("nan"), float("inf")
    for temperature in (0.0, 0.7):
        info = SamplingBatchInfo.from_requests(
            [SamplingParams(temperature=temperature)] * 3, [([1], [])] * 3, [None] * 3, 16, "cpu"
        )
        ids = Sampler(detect_nan=True)(logits, info, return_logprob=True, top_logprobs_num=2).next_token_ids.tolist()
        assert ids[1:] == [NAN_TOKEN_ID, NAN_TOKEN_ID] and 0 <= ids[0] < 16
    greedy = SamplingBatchInfo.from_requests([SamplingParams(temperature=0.0)] * 3, [([1], [])] * 3, [None] * 3, 16, "cpu")
    assert NAN_TOKEN_ID not in Sampler()(logits, greedy).next_token_ids.tolist()  # unchanged without the flag


def test_nan_logits_are_reported_not_sampled(nan_llama_dir):
    proc = popen_launch_server(nan_llama_dir, BASE_ARGS + ["--enable-nan-detection"])
    try:
        poisoned = [3, POISONED_TOKEN, 4]
        for stream, temperature in ((False, 0.0), (True, 0.8)):
            body = {"input_ids": poisoned, "sampling_params": {"max_new_tokens": 4, "temperature": temperature}, "stream": stream}
            r = requests.post(proc.base_url + "/generate", json=body, timeout=60)
            assert r.status_code == 500 and "NaN or inf in the model's logits" in r.json()["error"]["message"], r.text
        assert "NaN or inf in the logits of request" in proc.log_tail(1 << 20)
        clean = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        r = requests.post(proc.base_url + "/generate", json=clean, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1, r.text
        _assert_kv_full(proc)
    finally:
        kill_server(proc)
