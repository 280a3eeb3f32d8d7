"""The real server end to end (python -m sglang.launch_server, CPU): OpenAI client, native
endpoints, aborts, bad input, shutdown. A tiny random Llama for the plumbing, and
SmolLM2-135M-Instruct for answers that must be right."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time

import openai
import pytest
import requests
import torch
from transformers import AutoTokenizer

from sglang.srt.utils.process import descendant_pids
from sglang.test.prompt_logprobs import check_input_logprobs, reference_logprobs
from sglang.test.server_utils import kill_server, popen_launch_server, wait_until_gone

API_KEY = "test-key"
SERVED_NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    proc = popen_launch_server(
        tiny_llama_dir,
        ["--device", "cpu", "--served-model-name", SERVED_NAME, "--max-total-tokens", "2048", "--enable-metrics"],
        api_key=API_KEY,
    )
    yield proc
    kill_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)


def _get(server, path):
    return requests.get(server.base_url + path, headers=server.headers(), timeout=60)


def _post(server, path, body, **kw):
    return requests.post(server.base_url + path, json=body, headers=server.headers(), timeout=120, **kw)


def _assert_kv_pool_full(server):
    for state in _get(server, "/get_server_info").json()["internal_states"]:
        assert state["available_kv_tokens"] == state["max_total_num_tokens"]


def test_server_announces_readiness(server):
    deadline = time.monotonic() + 60
    while "The server is fired up and ready to roll!" not in server.log_tail(1 << 20):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)


def test_chat_stream_matches_non_stream(client):
    kwargs = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=12)
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_completions_logprobs(client):
    out = client.completions.create(model=SERVED_NAME, prompt="The quick brown", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(len(t) == 2 and max(t.values()) >= v - 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == out.choices[0].text


def test_generate_prompt_logprobs(server, tiny_llama_dir):
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 3,
    }
    out = _post(server, "/generate", body).json()
    check_input_logprobs(out["meta_info"], prompt, reference_logprobs(tiny_llama_dir, [prompt])[0], 1)
    for bad in (len(prompt), -2):
        r = _post(server, "/generate", {**body, "logprob_start_len": bad})
        assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"], r.text


def test_completions_echo_with_logprobs(client, tiny_llama_dir):
    prompt = "The quick brown"
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir).encode(prompt)
    kwargs = dict(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs, echo=True, n=2)
    plain = client.completions.create(**kwargs).choices[0]
    ref = reference_logprobs(tiny_llama_dir, [ids])[0]
    for choice in out.choices:
        lp = choice.logprobs
        assert choice.text == prompt + plain.text
        assert len(lp.tokens) == len(ids) + 4 and "".join(lp.tokens) == choice.text
        assert lp.text_offset == list(itertools.accumulate((len(t) for t in lp.tokens[:-1]), initial=0))
        # The prompt's tokens: the first has no logprob; the others are transformers' values.
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = ref[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(1).tolist()
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        assert [max(t.values()) for t in lp.top_logprobs[1 : len(ids)]] == pytest.approx(
            ref[:-1].max(-1).values.tolist(), abs=1e-4
        )
        # The completion's tokens: as without echo.
        assert lp.tokens[len(ids) :] == plain.logprobs.tokens
        assert lp.token_logprobs[len(ids) :] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kwargs, echo=True, stream=True) if c.choices]
    lp = out.choices[0].logprobs
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-4 for c in content)


def test_models_and_errors(client, server):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong").models.list()
    assert requests.get(server.base_url + "/v1/models", timeout=10).status_code == 401
    assert requests.get(server.base_url + "/health", timeout=10).status_code == 200  # probes need no key


def test_generate_native(server):
    r = _post(server, "/generate", {"text": "The capital", "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200 and r.json()["text"] == "" and r.json()["meta_info"]["completion_tokens"] == 0
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = _post(server, "/generate", {"text": "The capital", "sampling_params": params}).json()
    assert full["meta_info"]["completion_tokens"] == 6 and len(full["output_ids"]) == 6
    r = _post(server, "/generate", {"text": "The capital", "sampling_params": params, "stream": True}, stream=True)
    lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    batch = _post(server, "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": params}).json()
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [3, 2]


def test_info_endpoints(server):
    assert _get(server, "/get_model_info").json()["model_path"] == server.args[server.args.index("--model-path") + 1]
    info = _get(server, "/get_server_info").json()
    assert info["served_model_name"] == SERVED_NAME and info["max_total_num_tokens"] == 2048
    (state,) = info["internal_states"]
    assert {"dp_rank", "avg_spec_accept_length", "max_total_num_tokens", "available_kv_tokens", "last_gen_throughput"} <= set(
        state
    )
    assert _post(server, "/flush_cache", {}).status_code == 200
    assert _get(server, "/health_generate").status_code == 200
    assert _get(server, "/metrics").status_code == 200


def test_bad_requests_do_not_hurt_the_server(server):
    bad = [
        ("/generate", {"text": ""}),
        ("/generate", {"input_ids": [10**7]}),
        ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}),
        ("/generate", {"text": "x" * 100000}),
        ("/v1/chat/completions", {"model": SERVED_NAME, "messages": [{"role": "user", "content": "x"}], "top_p": 0}),
        ("/v1/completions", {"model": SERVED_NAME, "prompt": "x", "stop": [""]}),
    ]
    for path, body in bad:
        r = _post(server, path, body)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (path, body, r.text)
    r = requests.post(
        server.base_url + "/generate", data=b"{oops", headers={**server.headers(), "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    assert _post(server, "/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    _assert_kv_pool_full(server)


def test_client_disconnect_frees_kv(server):
    params = {"max_new_tokens": 450, "temperature": 0, "ignore_eos": True}
    with _post(server, "/generate", {"text": "a long story", "sampling_params": params, "stream": True}, stream=True) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream: closing the connection must abort the request
    deadline = time.monotonic() + 30
    while True:
        state = _get(server, "/get_server_info").json()["internal_states"][0]
        if state["available_kv_tokens"] == state["max_total_num_tokens"]:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert "Aborted request" in server.log_tail(1 << 20)


def test_zz_sigterm_leaves_no_processes(server):
    """Last in this module: SIGTERM the shared server; it and all its children must exit."""
    children = descendant_pids(server.pid)
    assert len(children) >= 2  # detokenizer + scheduler (+ multiprocessing's resource tracker)
    os.kill(server.pid, signal.SIGTERM)
    assert server.wait(30) is not None
    assert wait_until_gone(children) == []


def test_scheduler_death_shuts_the_server_down(tiny_llama_dir):
    proc = popen_launch_server(tiny_llama_dir, ["--device", "cpu"])
    try:
        children = descendant_pids(proc.pid)
        info = requests.get(proc.base_url + "/get_server_info", timeout=60).json()
        os.kill(info["internal_states"][0]["pid"], signal.SIGKILL)
        assert proc.wait(30) != 0
        assert "exited unexpectedly: killed by SIGKILL" in proc.log_tail()
        assert wait_until_gone(children) == []
    finally:
        kill_server(proc)


def test_skip_server_warmup(tiny_llama_dir):
    """Healthy before any generation ran (the warm-up's prefill is not in the log); serves then."""
    proc = popen_launch_server(tiny_llama_dir, ["--device", "cpu", "--skip-server-warmup"])
    try:
        assert "Warm-up skipped" in proc.log_tail() and "Prefill batch" not in proc.log_tail()
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
        assert len(requests.post(proc.base_url + "/generate", json=body, timeout=60).json()["output_ids"]) == 3
        assert "Prefill batch" in proc.log_tail()
    finally:
        kill_server(proc)


# ---------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2_server():
    proc = popen_launch_server("SmolLM2-135M-Instruct", ["--device", "cpu"], timeout=600)
    yield proc
    kill_server(proc)


def test_smollm2_answers_and_streams_consistently(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="none")
    kwargs = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        temperature=0,
        max_tokens=16,
    )
    answer = client.chat.completions.create(**kwargs).choices[0].message.content
    assert "Paris" in answer, answer
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
    )
    assert streamed == answer
