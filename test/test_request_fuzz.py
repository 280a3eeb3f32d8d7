"""Fuzz a live CPU server (tiny Llama) with hypothesis-generated requests on every endpoint:
bodies built from each request model's fields, each field either a plausible value or an
edge value (NaN, infinities, huge and negative integers, lone surrogates, wrong types, nested
junk), plus raw bodies that are not JSON. Passes when no answer is a 5xx, every 4xx carries
the JSON error shape, no stream carries a 5xx error event, and the server still serves.

SGLANG_FUZZ_REQUESTS sets the number of requests (1,000 by default; docs/benchmarks.md
records a 20,000-request run). Requests go out in concurrent groups of GROUP.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.test.server_utils import kill_server, popen_launch_server

MODEL = "tiny"
VOCAB = 384  # make_tiny_llama's
GROUP = 50
NUM_REQUESTS = int(os.environ.get("SGLANG_FUZZ_REQUESTS", "1000"))
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--context-length", "128", "--enable-metrics"]

# ---------------------------------------------------------------------- values
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 2**70, -(2**70), 10**30])
NUMBERS = st.one_of(
    st.integers(-5, 300), EDGE_INTS, st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.just(1e-300)
)
TEXTS = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "hi", "\ud800", "a\udfffb", "\ud83d", "\x00", "<s>", "</s>", " " * 5, "é世界🙂"]),
)
JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXTS),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXTS, inner, max_size=3),
    max_leaves=6,
)
TOKEN_IDS = st.lists(st.integers(-2, VOCAB + 2) | EDGE_INTS, max_size=6)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values (so requests get past the first check), sometimes anything."""
    return st.one_of(plausible, plausible, plausible, JUNK)


def body(required: dict, optional: dict) -> st.SearchStrategy:
    """A JSON object with the required keys, any subset of the optional ones, and sometimes
    a key that no model has."""
    base = st.fixed_dictionaries({k: field(v) for k, v in required.items()}, optional={k: field(v) for k, v in optional.items()})
    return st.one_of(base, base, base, st.tuples(base, TEXTS, JUNK).map(lambda t: {**t[0], t[1]: t[2]}))


SMALL_MAX = st.integers(-2, 12)
UNIT = st.floats(0, 1)
SAMPLING_FIELDS = {
    "temperature": st.floats(0, 2),
    "top_p": UNIT,
    "top_k": st.integers(-2, 50),
    "min_p": UNIT,
    "frequency_penalty": st.floats(-2.5, 2.5),
    "presence_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0, 2.5),
    "stop": TEXTS | st.lists(TEXTS, max_size=3),
    "stop_token_ids": TOKEN_IDS,
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "seed": NUMBERS,
    "n": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(-1, VOCAB + 1).map(str) | TEXTS, NUMBERS, max_size=3),
}
NATIVE_SAMPLING = body(
    {},
    {
        **SAMPLING_FIELDS,
        "max_new_tokens": SMALL_MAX,
        "min_new_tokens": SMALL_MAX,
        "sampling_seed": NUMBERS,
        "spaces_between_special_tokens": st.booleans(),
    },
)
PROMPT_TEXTS = TEXTS | st.lists(TEXTS, max_size=3)
PROMPT_IDS = TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3)
GENERATE = body(
    {},
    {
        "text": PROMPT_TEXTS,
        "input_ids": PROMPT_IDS,
        "sampling_params": NATIVE_SAMPLING | st.lists(NATIVE_SAMPLING, max_size=3),
        "rid": TEXTS | st.lists(TEXTS, max_size=3),
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "top_logprobs_num": st.integers(-1, 5),
        "logprob_start_len": st.integers(-2, 8),
        "return_text_in_logprobs": st.booleans(),
    },
)
OPENAI_COMMON = {
    **SAMPLING_FIELDS,
    "min_tokens": SMALL_MAX,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": TEXTS,
}
MODELS = st.sampled_from([MODEL, "gpt-4"])
COMPLETIONS = body(
    {"model": MODELS, "prompt": PROMPT_TEXTS | PROMPT_IDS},
    {
        **OPENAI_COMMON,
        "max_tokens": SMALL_MAX,
        "echo": st.booleans(),
        "logprobs": st.integers(-1, 21),
        "suffix": TEXTS,
        "best_of": st.integers(0, 2),
    },
)
CONTENT_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXTS})
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]),
        "content": TEXTS | st.lists(CONTENT_PART, max_size=2),
    },
    optional={"name": TEXTS},
)
CHAT = body(
    {"model": MODELS, "messages": st.lists(MESSAGE, max_size=3)},
    {
        **OPENAI_COMMON,
        "max_tokens": SMALL_MAX,
        "max_completion_tokens": SMALL_MAX,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 21),
        "tools": st.lists(st.dictionaries(TEXTS, TEXTS, max_size=2), max_size=1),
        "tool_choice": TEXTS,
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        "chat_template_kwargs": st.dictionaries(TEXTS, JUNK, max_size=2),
    },
)


def profile_body(profile_dir: str) -> st.SearchStrategy:
    # output_dir: only strings under the test's directory (the server creates the directory).
    dirs = st.sampled_from([os.path.join(profile_dir, "a"), os.path.join(profile_dir, "b\x00c"), ""])
    fields = {
        "output_dir": dirs,
        "num_steps": st.integers(-1, 3) | EDGE_INTS,
        "activities": st.lists(st.sampled_from(["CPU", "GPU", "cpu", "TPU"]), max_size=2),
    }
    return body({}, fields).map(
        lambda b: {**b, "output_dir": _under(profile_dir, b["output_dir"])} if isinstance(b.get("output_dir"), str) else b
    )


def _under(profile_dir: str, path: str) -> str:
    """A junk output_dir string kept inside the test's directory (else the server would create
    it relative to its working directory); "" (the default directory) stays."""
    if not path or path.startswith(profile_dir + os.sep):
        return path
    return os.path.join(profile_dir, "junk", path.replace("..", "__").lstrip(os.sep))


GET_PATHS = ["/health", "/health_generate", "/get_model_info", "/get_server_info", "/v1/models", "/metrics", "/flush_cache"]
POST_PATHS = ["/generate", "/v1/completions", "/v1/chat/completions", "/start_profile", "/stop_profile", "/flush_cache"]


def any_request(profile_dir: str) -> st.SearchStrategy:
    """(method, path, body bytes or None)."""
    as_json = lambda path: lambda b: ("POST", path, json.dumps(b, allow_nan=True).encode())
    return st.one_of(
        GENERATE.map(as_json("/generate")),
        COMPLETIONS.map(as_json("/v1/completions")),
        CHAT.map(as_json("/v1/chat/completions")),
        profile_body(profile_dir).map(as_json("/start_profile")),
        st.just(("POST", "/stop_profile", b"")),
        st.tuples(st.just("GET"), st.sampled_from(GET_PATHS), st.none()),
        st.tuples(st.just("POST"), st.sampled_from(POST_PATHS), st.binary(max_size=40)),  # mostly not JSON
    )


# ---------------------------------------------------------------------- checks
def check_response(request: tuple, r: requests.Response) -> None:
    method, path, data = request
    what = (method, path, (data or b"")[:300])
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["code"] == r.status_code, (what, r.text[:500])
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in r.text.split("\n") if line]
        assert events and events[-1] == "[DONE]", (what, r.text[-300:])
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                assert payload["error"]["code"] < 500, (what, event)


def send(base_url: str, request: tuple) -> None:
    method, path, data = request
    headers = {"Content-Type": "application/json"} if data is not None else {}
    r = requests.request(method, base_url + path, data=data, headers=headers, timeout=120)
    check_response(request, r)


@pytest.fixture(scope="module")
def server(tiny_llama_unsharded_dir, tmp_path_factory):
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = str(tmp_path_factory.mktemp("fuzz_profiles"))
    proc = popen_launch_server(tiny_llama_unsharded_dir, SERVER_ARGS)
    yield proc
    kill_server(proc)


def test_fuzz_every_endpoint(server, tmp_path):
    pool = ThreadPoolExecutor(16)
    sent = []

    @settings(
        max_examples=max(1, NUM_REQUESTS // GROUP),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(any_request(str(tmp_path)), min_size=GROUP, max_size=GROUP))
    def fuzz(group: list[tuple]) -> None:
        for future in [pool.submit(send, server.base_url, request) for request in group]:
            future.result()
        sent.append(len(group))
        assert server.poll() is None, server.log_tail()

    try:
        fuzz()
    finally:
        pool.shutdown()
        requests.post(server.base_url + "/stop_profile", timeout=120)
    assert sum(sent) >= NUM_REQUESTS
    assert requests.get(server.base_url + "/health", timeout=30).status_code == 200
    r = requests.post(server.base_url + "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    assert "Traceback" not in server.log_tail(1 << 24), server.log_tail(20000)
