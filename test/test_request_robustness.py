"""No request can kill the server: each request that used to take a CPU server down (or got a
plain-text 500, or stalled every client), then the second line of defence in the scheduler,
logit_bias on the plain and the speculative paths, and /health on a stopped scheduler."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
import time

import pytest
import requests
import torch

import sglang as sgl
from sglang.srt.entrypoints.openai.serving_base import start_stream
from sglang.srt.managers.io_struct import ProfileReq, TokenizedGenerateReqInput
from sglang.srt.managers.tokenizer_manager import RequestError
from sglang.srt.sampling.sampler import Sampler, SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.inprocess_scheduler import start_scheduler
from sglang.test.server_utils import kill_server, popen_launch_server

MODEL = "tiny"
CONTEXT_LEN = 128
STALL_TIMEOUT_S = 5
SERVER_ARGS = [
    "--device", "cpu", "--served-model-name", MODEL, "--context-length", str(CONTEXT_LEN),
    "--enable-metrics", "--scheduler-stall-timeout", str(STALL_TIMEOUT_S),
]  # fmt: skip
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_llama_unsharded_dir, tmp_path_factory):
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = str(tmp_path_factory.mktemp("profiles"))
    proc = popen_launch_server(tiny_llama_unsharded_dir, SERVER_ARGS)
    yield proc
    kill_server(proc)


def _post_raw(server, path: str, body: str | bytes, timeout: float = 60) -> requests.Response:
    return requests.post(server.base_url + path, data=body, headers={"Content-Type": "application/json"}, timeout=timeout)


def _assert_json_4xx(r: requests.Response, what) -> None:
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"] and error["code"] == r.status_code, (what, r.text[:300])


def _assert_serving(server) -> None:
    assert server.poll() is None, server.log_tail()
    r = requests.post(server.base_url + "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    assert requests.get(server.base_url + "/health", timeout=10).status_code == 200


def _with(body: dict, **fields) -> str:
    """`body` with `fields` as JSON; NaN and Infinity are written as the bare tokens that
    Python's (and so Starlette's) JSON parser accepts."""
    return json.dumps({**body, **fields}, allow_nan=True)


# ---------------------------------------------------------------------- 1, 2: numbers
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_temperature_is_refused_everywhere(server, value):
    for path, body in [
        ("/generate", {"text": "hi", "sampling_params": {"temperature": value, "max_new_tokens": 2}}),
        ("/v1/completions", {**_CMPL, "temperature": value}),
        ("/v1/chat/completions", {**_CHAT, "temperature": value}),
    ]:
        _assert_json_4xx(_post_raw(server, path, _with(body)), (path, value))
    _assert_serving(server)


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**64, -(2**63) - 1])
def test_out_of_range_seed_is_refused(server, seed):
    for path, body in [
        ("/generate", {"text": "hi", "sampling_params": {"seed": seed, "max_new_tokens": 2}}),
        ("/generate", {"text": "hi", "sampling_params": {"sampling_seed": seed, "max_new_tokens": 2}}),
        ("/v1/completions", {**_CMPL, "seed": seed}),
        ("/v1/chat/completions", {**_CHAT, "seed": seed}),
    ]:
        _assert_json_4xx(_post_raw(server, path, _with(body)), (path, seed))
    _assert_serving(server)


def test_extreme_seeds_within_range_generate(server):
    for seed in (2**64 - 1, -(2**63)):
        r = _post_raw(server, "/v1/completions", _with(_CMPL, seed=seed, temperature=1.0))
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- 3, 5: /start_profile
@pytest.mark.parametrize(
    "body",
    [
        '{"num_steps": "x"}',
        '{"num_steps": 1.5}',
        '{"num_steps": 0}',
        '{"num_steps": 99999999999999999999999}',
        '{"activities": "CPU"}',
        '{"output_dir": 7}',
        '{"output_dir": "/tmp/a\\u0000b"}',
        '{"nope": 1}',
        "not json",
        "[1, 2]",
        "\x00\xff",
    ],
)
def test_start_profile_bad_bodies_are_400(server, body):
    _assert_json_4xx(_post_raw(server, "/start_profile", body.encode("latin-1")), body)
    _assert_serving(server)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU activities are valid where torch sees a GPU")
def test_start_profile_gpu_activities_without_gpu_are_400(server):
    """Found by the fuzz run: no activity left once GPU is dropped made the torch profiler raise in the scheduler."""
    _assert_json_4xx(_post_raw(server, "/start_profile", '{"activities": ["GPU"]}'), "GPU only")
    _assert_serving(server)


def test_start_profile_valid_body_still_works(server):
    r = _post_raw(server, "/start_profile", '{"num_steps": 2, "activities": ["CPU"]}')
    assert r.status_code == 200, r.text
    _assert_serving(server)  # its two steps end the profile
    deadline = time.monotonic() + 60
    while requests.post(server.base_url + "/stop_profile", timeout=60).status_code == 200:
        assert time.monotonic() < deadline  # stopped by itself: a stop is refused, or this one stopped it


# ---------------------------------------------------------------------- 4: lone surrogates
@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", '{"text": "a\\ud800b", "sampling_params": {"max_new_tokens": 2}}'),
        ("/generate", '{"text": "hi", "rid": "\\udfff"}'),
        ("/generate", '{"text": "hi", "sampling_params": {"stop": ["\\ud800"]}}'),
        ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}'),
        ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udc00x"]}'),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}'),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}'),
    ],
)
def test_lone_surrogates_are_400(server, path, body):
    r = _post_raw(server, path, body)
    _assert_json_4xx(r, body)
    assert "surrogate" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- 6: a 10 MB prompt
def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    prompt = ("lorem ipsum dolor sit amet, " * 400_000)[: 10 << 20]
    answer: dict = {}

    def send() -> None:
        answer["r"] = requests.post(server.base_url + "/generate", json={"text": prompt}, timeout=300)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)  # the body is sent and parsed; tokenization has begun
    latencies = []
    window_start = time.monotonic()
    while sender.is_alive():
        start = time.monotonic()
        assert requests.get(server.base_url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    sender.join()
    window = time.monotonic() - window_start
    _assert_json_4xx(answer["r"], "10 MB prompt")
    assert len(latencies) >= 5, latencies  # the tokenization took a while: /health was measured during it
    # A blocked event loop holds one /health for the rest of the tokenization; scheduling noise
    # on a loaded 2-core runner costs a few hundred ms at most.
    assert max(latencies) < max(0.5, window / 4), (window, latencies)


# ---------------------------------------------------------------------- 7: stream cancelled early
def test_stream_that_ends_before_its_first_output_is_a_499():
    async def nothing():
        return
        yield

    with pytest.raises(RequestError) as e:
        asyncio.run(start_stream(nothing()))
    assert e.value.status_code == 499


# ---------------------------------------------------------------------- second line: the scheduler
class _DetokenizerStub:
    def __init__(self) -> None:
        self.finished: dict[str, tuple[list[int], dict]] = {}
        self.ids: dict[str, list[int]] = {}

    def send_pyobj(self, msg) -> None:
        for rid, ids, reason in zip(msg.rids, msg.output_ids, msg.finished_reasons):
            self.ids[rid] = self.ids.get(rid, []) + ids
            if reason is not None:
                self.finished[rid] = (self.ids.pop(rid), reason)


class _ReplyStub:
    def __init__(self) -> None:
        self.replies: list = []

    def send_pyobj(self, msg) -> None:
        self.replies.append(msg)


def test_scheduler_refuses_a_bad_request_alone(tiny_llama_unsharded_dir):
    """Requests that skipped the TokenizerManager's checks (NaN temperature, a seed torch
    rejects, a token id outside the vocabulary, a bad logit_bias) and a profile request with
    options of the wrong type fail alone; the good request next to them finishes."""
    scheduler = start_scheduler(ServerArgs(model_path=tiny_llama_unsharded_dir, device="cpu"))
    scheduler.send_to_detokenizer = out = _DetokenizerStub()
    scheduler.send_to_tokenizer = replies = _ReplyStub()
    bad = {
        "nan": SamplingParams(max_new_tokens=4, temperature=math.nan),
        "seed": SamplingParams(max_new_tokens=4, sampling_seed=2**70),
        "bias": SamplingParams(max_new_tokens=4, logit_bias={10**6: 1.0}),
    }
    for rid, params in bad.items():
        scheduler.handle_message(TokenizedGenerateReqInput(rid, None, [5, 6, 7], params))
    scheduler.handle_message(TokenizedGenerateReqInput("vocab", None, [5, 10**6], SamplingParams(max_new_tokens=4)))
    good = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    scheduler.handle_message(TokenizedGenerateReqInput("good", None, [5, 6, 7], good))
    scheduler.handle_message(ProfileReq("start", num_steps="x"))
    for _ in range(100):
        scheduler.run_iteration()
        if "good" in out.finished:
            break
    for rid in [*bad, "vocab"]:
        ids, reason = out.finished[rid]
        assert ids == [] and reason["type"] == "abort" and reason["message"].startswith("Invalid request"), (rid, reason)
    ids, reason = out.finished["good"]
    assert len(ids) == 4 and reason["type"] == "length"
    (profile,) = replies.replies
    assert not profile.success and "TypeError" in profile.message


# ---------------------------------------------------------------------- 9: logit_bias
def test_logit_bias_in_the_sampler():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [5.0, 0.0, 0.0, 4.9]])
    params = [SamplingParams(temperature=0, logit_bias={3: 4.0}), SamplingParams(temperature=0, logit_bias={0: -100})]
    info = SamplingBatchInfo.from_requests(params, [([0], [])] * 2, [None, None], 4, "cpu")
    assert Sampler()(logits, info).next_token_ids.tolist() == [3, 3]
    assert torch.equal(info.apply_penalties(logits), logits + torch.tensor([[0, 0, 0, 4.0], [-100, 0, 0, 0]]))
    torch.manual_seed(0)
    sampled = [SamplingParams(temperature=1.0, logit_bias={2: -100})] * 2000
    info = SamplingBatchInfo.from_requests(sampled, [([0], [])] * 2000, [None] * 2000, 4, "cpu")
    assert 2 not in Sampler()(logits[:1].repeat(2000, 1), info).next_token_ids.tolist()


def test_logit_bias_validation():
    assert SamplingParams.from_dict({"logit_bias": {"7": -1.5}}).logit_bias == {7: -1.5}
    for bias in ({"x": 1}, {"7": 101}, {"7": math.nan}, {"-1": 1}, {"7": "1"}, [1, 2]):
        with pytest.raises(ValueError):
            SamplingParams.from_dict({"logit_bias": bias}).verify(100)
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"logit_bias": {"100": 1}}).verify(100)


def test_logit_bias_on_plain_and_speculative_paths(tiny_llama_unsharded_eagle_pair):
    """Greedy with a bias gives the same tokens with and without EAGLE (verification applies
    the bias to every tree node), tokens that differ from the unbiased ones; a +100 bias
    makes its token the only one."""
    target, head = tiny_llama_unsharded_eagle_pair
    prompts = [[5, 17, 42, 99, 7], [8, 9, 10], [100, 101, 102, 103]]
    base = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}

    def run(engine, **params):
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params={**base, **params})]

    with sgl.Engine(model_path=target, device="cpu") as engine:
        unbiased = run(engine)
        favoured = sorted({t for ids in unbiased for t in ids})[:3]
        bias = {str(t): -8.0 for t in favoured} | {"42": 3.0}
        plain = run(engine, logit_bias=bias)
        assert run(engine, logit_bias={"42": 100}) == [[42] * 10] * 3
    assert plain != unbiased
    spec_args = {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
    with sgl.Engine(
        model_path=target, device="cpu", speculative_algorithm="EAGLE", speculative_draft_model_path=head, **spec_args
    ) as engine:
        assert run(engine, logit_bias=bias) == plain


def test_openai_logit_bias(server):
    r = requests.post(
        server.base_url + "/v1/completions",
        json={**_CMPL, "max_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ids = requests.post(
        server.base_url + "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}}},
        timeout=60,
    ).json()["output_ids"]
    assert ids == [42] * 4
    _assert_json_4xx(_post_raw(server, "/v1/chat/completions", _with(_CHAT, logit_bias={"42": 101})), "bias 101")


# ---------------------------------------------------------------------- 8: /health
def test_health_and_probes_need_no_key_and_info_hides_it(tiny_llama_unsharded_dir):
    proc = popen_launch_server(tiny_llama_unsharded_dir, SERVER_ARGS, api_key="sekret-key")
    try:
        for path in ("/health", "/health_generate", "/metrics"):
            assert requests.get(proc.base_url + path, timeout=60).status_code == 200, path
        assert requests.get(proc.base_url + "/get_server_info", timeout=60).status_code == 401
        info = requests.get(proc.base_url + "/get_server_info", headers=proc.headers(), timeout=60)
        assert info.status_code == 200 and "sekret-key" not in info.text
    finally:
        kill_server(proc)


def test_zz_health_is_503_while_a_scheduler_is_stopped(server):
    (state,) = requests.get(server.base_url + "/get_server_info", timeout=60).json()["internal_states"]
    os.kill(state["pid"], signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        while (r := requests.get(server.base_url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() - stopped_at < STALL_TIMEOUT_S + 2, "still 200"
            time.sleep(0.2)
        assert r.status_code == 503 and "has not finished an iteration" in r.json()["error"]["message"]
        assert time.monotonic() - stopped_at >= STALL_TIMEOUT_S - 0.5
    finally:
        os.kill(state["pid"], signal.SIGCONT)
    deadline = time.monotonic() + 10
    while requests.get(server.base_url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _assert_serving(server)
