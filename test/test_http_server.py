"""HTTP server, TokenizerManager and detokenizer against a fake scheduler (no model).

The fake speaks the real ZMQ protocol and runs the real incremental detokenizer, so these
tests cover everything above the scheduler: validation, streaming, OpenAI shapes, auth.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time

import pytest
import zmq
from fastapi.testclient import TestClient

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.entrypoints.openai.serving_base import sse_response
from sglang.srt.managers.detokenizer_manager import IncrementalDetokenizer, trim_matched_stop
from sglang.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut, SchedulerReady
from sglang.srt.managers.tokenizer_manager import GenerateReqInput, TokenizerManager, hold_back_partial_stop
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.test.byte_tokenizer import make_byte_tokenizer
from sglang.test.fake_scheduler import MAX_TOTAL_TOKENS, FakeScheduler

CONTEXT_LEN = 64
REPLY = "Hello, 世界!"
MODEL = "fake-model"


@contextlib.contextmanager
def fake_backend(**server_kwargs):
    """A TokenizerManager wired to a FakeScheduler; both closed on exit."""
    server_args = ServerArgs(model_path=MODEL, device="cpu", **server_kwargs)
    port_args = PortArgs.init_new(server_args)
    tokenizer = make_byte_tokenizer()
    tm = TokenizerManager(server_args, port_args, tokenizer=tokenizer)
    tm.set_scheduler_info(SchedulerReady(0, 0, MAX_TOTAL_TOKENS, CONTEXT_LEN - 1, CONTEXT_LEN))
    fake = FakeScheduler(port_args, tokenizer, reply=REPLY)
    try:
        yield tm, fake
    finally:
        fake.close()
        tm.close()
        shutil.rmtree(port_args.run_dir, ignore_errors=True)


def warmed_up_app(tm: TokenizerManager, scheduler_info: dict):
    """The app as it serves after launch_server's warm-up request succeeded."""
    app = create_app(tm, scheduler_info)
    app.state.warmed_up.set()
    return app


@pytest.fixture(scope="module")
def backend():
    with fake_backend() as (tm, fake), TestClient(warmed_up_app(tm, {"context_len": CONTEXT_LEN})) as client:
        yield client, fake


@pytest.fixture
def client(backend):
    client, fake = backend
    fake.received.clear()
    return client


@pytest.fixture
def fake(backend):
    return backend[1]


def _sse(response) -> list:
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


# ---------------------------------------------------------------------- /generate
def test_generate_text(client):
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == REPLY
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "stop"
    assert meta["prompt_tokens"] == 2  # one token per byte, no BOS
    assert meta["completion_tokens"] == len(REPLY.encode()) + 1  # + EOS
    assert {"id", "cached_tokens", "e2e_latency"} <= set(meta)


def test_generate_input_ids_and_limits(client):
    r = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
    assert r.json()["text"] == "Hel"
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200
    assert r.json()["text"] == "" and r.json()["meta_info"]["completion_tokens"] == 0


def test_generate_stop_string_trimmed(client):
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"stop": ["世"]}})
    assert r.json()["text"] == "Hello, "
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "世"}
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"stop": "世", "no_stop_trim": True}})
    assert r.json()["text"] == "Hello, 世"


def test_generate_batch(client):
    r = client.post("/generate", json={"text": ["a", "bb"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]})
    assert [o["text"] for o in r.json()] == ["H", "He"]
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [1, 2]


def test_generate_stream(client):
    r = client.post("/generate", json={"text": "hi", "stream": True})
    chunks = _sse(r)
    texts = [c["text"] for c in chunks]
    assert texts[-1] == REPLY
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    # Cumulative snapshots, never a partial UTF-8 character.
    assert all(REPLY.startswith(t) and "\ufffd" not in t for t in texts)
    assert len(chunks) > 1


def test_stream_never_shows_a_stop_string_prefix(client):
    chunks = _sse(client.post("/generate", json={"text": "hi", "stream": True, "sampling_params": {"stop": [", 世"]}}))
    assert chunks[-1]["text"] == "Hello"
    assert all("Hello".startswith(c["text"]) for c in chunks)


def test_stream_output_flag_gives_deltas():
    body = {"input_ids": [104, 105], "stream": True, "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"n": 2}}
    with fake_backend(stream_output=True) as (tm, fake), TestClient(warmed_up_app(tm, {})) as c:
        chunks = _sse(c.post("/generate", json={"text": "hi", "stream": True}))
        samples = _sse(c.post("/generate", json=body))
    assert "".join(ch["text"] for ch in chunks) == REPLY
    assert sum(len(ch["output_ids"]) for ch in chunks) == len(REPLY.encode()) + 1
    for index in (0, 1):  # per sample: its own deltas, the prompt's logprobs in its first chunk only
        mine = [ch for ch in samples if ch["index"] == index]
        assert "".join(ch["text"] for ch in mine) == REPLY
        assert sum(len(ch["meta_info"]["output_token_logprobs"]) for ch in mine) == len(REPLY.encode()) + 1
        assert [len(ch["meta_info"]["input_token_logprobs"]) for ch in mine] == [2] + [0] * (len(mine) - 1)


BAD_GENERATE = [
    {},
    {"text": ""},
    {"input_ids": []},
    {"text": "a", "input_ids": [1]},
    {"text": 5},
    {"text": None, "input_ids": None},
    {"input_ids": [1, -1]},
    {"input_ids": [10**9]},
    {"input_ids": ["a"]},
    {"text": "hi", "sampling_params": {"temperature": -1}},
    {"text": "hi", "sampling_params": {"top_p": 0}},
    {"text": "hi", "sampling_params": {"top_p": 1.5}},
    {"text": "hi", "sampling_params": {"top_k": -2}},
    {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
    {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}},
    {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}},
    {"text": "hi", "sampling_params": {"n": 129}},
    {"text": "hi", "sampling_params": {"stop": [""]}},
    {"text": "hi", "sampling_params": {"stop": [1]}},
    {"text": "hi", "sampling_params": {"stop_token_ids": [10**9]}},
    {"text": "hi", "sampling_params": {"no_such_param": 1}},
    {"text": "hi", "sampling_params": "greedy"},
    {"text": "x" * CONTEXT_LEN},
    {"text": "hi", "stream": "yes"},
    {"text": "hi", "return_logprob": True, "top_logprobs_num": -1},
    {"text": ["a", "b"], "sampling_params": [{}]},
    {"text": ["a", "b"], "stream": True},
    {"text": []},
    {"text": "hi", "unknown_field": 1},
    {"text": "hi", "rid": ["a", "b"]},
]


@pytest.mark.parametrize("body", BAD_GENERATE)
def test_generate_rejects_bad_requests(client, fake, body):
    r = client.post("/generate", json=body)
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["code"] == r.status_code and err["type"]
    assert fake.received == []  # nothing reached the scheduler


def test_malformed_bodies(client, fake):
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        r = client.post(path, content=b"[1, 2]", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    r = client.post("/generate", content=b"x" * 10, headers={"Content-Length": str(1 << 40)})
    assert r.status_code == 413 and "error" in r.json()
    assert fake.received == []
    r = client.get("/no_such_route")
    assert r.status_code == 404 and "error" in r.json()
    # The server keeps serving.
    assert client.post("/generate", json={"text": "hi"}).json()["text"] == REPLY


# ---------------------------------------------------------------------- OpenAI
def test_chat_completion_and_stream_agree(client, fake):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert out["choices"][0]["finish_reason"] == "stop"
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The chat template was applied (no extra BOS: the template carries the special tokens).
    prompt_ids = fake.received[-1].input_ids
    assert make_byte_tokenizer().decode(prompt_ids) == "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"

    chunks = _sse(client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content_chunks = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in content_chunks) == REPLY
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in content_chunks[:-1])
    assert chunks[-1]["usage"] == usage


def test_chat_logprobs(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2, "max_tokens": 2}
    out = client.post("/v1/chat/completions", json=body).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e"]
    assert content[0]["logprob"] == -0.5 and len(content[0]["top_logprobs"]) == 2
    assert out["choices"][0]["finish_reason"] == "length"


def test_completions(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5, "logprobs": 1})
    out = r.json()
    choice = out["choices"][0]
    assert choice["text"] == "Hello" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == list("Hello")
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    assert out["usage"]["completion_tokens"] == 5
    # Several prompts, token prompts, echo.
    out = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    out = client.post("/v1/completions", json={"model": MODEL, "prompt": [104, 105], "max_tokens": 1, "echo": True}).json()
    assert out["choices"][0]["text"] == "hiH"
    # echo with logprobs: the prompt's tokens first (the first without a logprob), offsets over the echoed text.
    body = {"model": MODEL, "prompt": [104, 105], "max_tokens": 2, "echo": True, "logprobs": 1}
    logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list("hiHe") and logprobs["text_offset"] == [0, 1, 2, 3]
    assert logprobs["token_logprobs"] == [None, -0.25, -0.5, -0.5]
    assert logprobs["top_logprobs"] == [None, {"i": -0.25}, {"H": -0.5}, {"e": -0.5}]
    chunks = _sse(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 32}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY


BAD_OPENAI = [
    ("/v1/chat/completions", {"model": MODEL}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -0.5}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": [5]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
    ("/v1/completions", {"model": MODEL}),
    ("/v1/completions", {"model": MODEL, "prompt": ""}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "stream": True}),
]


@pytest.mark.parametrize("path,body", BAD_OPENAI)
def test_openai_rejects_bad_requests(client, fake, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 400, (body, r.status_code, r.text)
    assert r.json()["error"]["message"]
    assert fake.received == []


def test_unknown_model_is_404(client):
    for path, body in [
        ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]


def test_health_is_503_until_the_warm_up_finished():
    with fake_backend() as (tm, fake), TestClient(create_app(tm, {})) as c:
        r = c.get("/health")
        assert r.status_code == 503 and "warm-up" in r.json()["error"]["message"]
        assert c.post("/generate", json={"text": "hi"}).json()["text"] == REPLY  # requests are served meanwhile
        c.app.state.warmed_up.set()
        assert c.get("/health").status_code == 200


def test_info_endpoints(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.get("/get_model_info").json() == {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
    info = client.get("/get_server_info").json()
    assert info["model_path"] == MODEL and info["context_len"] == CONTEXT_LEN
    (state,) = info["internal_states"]
    assert state["available_kv_tokens"] == state["max_total_num_tokens"] == MAX_TOTAL_TOKENS
    assert {"dp_rank", "avg_spec_accept_length", "last_gen_throughput"} <= set(state)
    assert client.post("/flush_cache").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == CONTEXT_LEN
    assert client.get("/metrics").status_code == 404  # only with --enable-metrics


def test_profile_endpoints(client, tmp_path):
    out = str(tmp_path / "prof")
    assert client.post("/stop_profile").json()["error"]["message"] == "the profiler is not running"
    assert client.post("/start_profile", json={"oops": 1}).status_code == 400
    assert client.post("/start_profile", json={"activities": ["TPU"]}).status_code == 400
    r = client.post("/start_profile", json={"output_dir": out, "activities": ["CPU"]})
    assert r.status_code == 200 and out in r.text
    assert client.post("/start_profile").status_code == 400  # already running
    assert client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert client.post("/stop_profile").status_code == 200
    deadline = time.monotonic() + 60  # the files are written after the reply, each renamed into place when complete
    while (
        len(files := sorted(p.name for p in (tmp_path / "prof").iterdir() if ".partial." not in p.name)) < 2
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert [f.split("-TP0")[1] for f in files] == [".trace.json.gz", ".txt"]
    assert "sorted by self_cpu_time_total" in (tmp_path / "prof" / files[1]).read_text()


def test_api_key_and_metrics():
    with fake_backend(api_key="sekret", enable_metrics=True) as (tm, fake), TestClient(warmed_up_app(tm, {})) as c:
        for path in ("/get_model_info", "/v1/models", "/get_server_info"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        for path in ("/health", "/health_generate", "/metrics"):  # probes and scrapers need no key
            assert c.get(path).status_code == 200
        info = c.get("/get_server_info", headers={"Authorization": "Bearer sekret"})
        assert "sekret" not in info.text and "api_key" not in info.json()
        r = c.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer sekret"})
        assert r.json()["text"] == REPLY


# ---------------------------------------------------------------------- aborts
class _GoneClient:
    async def is_disconnected(self) -> bool:
        return True


def test_abort_on_disconnect_and_on_closed_stream():
    async def scenario(tm):
        # Non-streaming: the client is gone; the request ends without output and is aborted.
        gen = tm.generate_request(GenerateReqInput(text="hi"), _GoneClient())
        assert [o async for o in gen] == []
        # Streaming: the consumer stops reading (closes the generator).
        gen = tm.generate_request(GenerateReqInput(text="hi", stream=True))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()

    with fake_backend() as (tm, fake):
        fake.hold = True
        asyncio.run(scenario(tm))
        deadline = time.monotonic() + 5
        while len(fake.aborted) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fake.received) == 2
        assert fake.aborted == [r.rid for r in fake.received]
        assert tm.rid_to_state == {}


def test_stream_body_closed_when_the_client_goes_away():
    """Starlette cancels the send of a gone client's stream and leaves the body at a yield;
    the response must close it at once (that is what aborts the request), not at GC."""
    closed = asyncio.Event()
    first_sent = asyncio.Event()

    async def chunks():
        try:
            for i in range(1000):
                yield {"i": i}
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def receive():
        await first_sent.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message.get("body"):
            first_sent.set()
            await asyncio.sleep(3600)  # the client stopped reading: the send never completes

    async def scenario():
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/", "headers": []}
        await asyncio.wait_for(sse_response(chunks())(scope, receive, send), 10)
        assert closed.is_set()

    asyncio.run(scenario())


def test_dead_backend_fails_requests_with_503():
    async def scenario(tm):
        task = asyncio.ensure_future(tm.generate_request(GenerateReqInput(text="hi")).__anext__())
        await asyncio.sleep(0.2)
        tm.mark_dead("scheduler died")
        with pytest.raises(ValueError, match="scheduler died"):
            await task
        with pytest.raises(ValueError, match="not healthy"):
            await tm.generate_request(GenerateReqInput(text="hi")).__anext__()

    with fake_backend() as (tm, fake):
        fake.hold = True
        asyncio.run(scenario(tm))


def test_outputs_queued_while_the_loop_was_busy_leave_as_one_chunk():
    """The TokenizerManager handles every detokenizer message already queued before a
    consumer runs: a stream that fell behind sends what gathered as one chunk."""

    async def scenario(tm, fake) -> dict:
        outputs = tm.generate_request(GenerateReqInput(text="hi", stream=True, sampling_params={"max_new_tokens": 10}))
        first = asyncio.ensure_future(outputs.__anext__())
        while not fake.received:
            await asyncio.sleep(0.01)
        rid = fake.received[0].rid
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(fake.port_args.tokenizer_ipc_name)
        for n, piece in enumerate("abcde"):
            push.send_pyobj(
                BatchStrOut(
                    rids=[rid],
                    output_strs=[piece],
                    output_ids=[[97 + n]],
                    output_offsets=[n],
                    finished_reasons=[None],
                    prompt_tokens=[1],
                    completion_tokens=[n + 1],
                    cached_tokens=[0],
                )
            )
        time.sleep(0.2)  # the event loop is blocked meanwhile: all five messages are queued
        chunk = await first
        push.close(linger=0)
        await outputs.aclose()
        return chunk

    with fake_backend() as (tm, fake):
        fake.hold = True
        chunk = asyncio.run(scenario(tm, fake))
    assert chunk["text"] == "abcde" and chunk["output_ids"] == [97, 98, 99, 100, 101]


# ---------------------------------------------------------------------- detokenizer
def test_incremental_detokenizer_matches_full_decode():
    tok = make_byte_tokenizer()
    text = "añb 世界 🙂 end"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    # One new id per message, then two at once: the pieces are never partial characters and
    # add up to the whole text.
    pieces = [detok.step("r", ids[n : n + 1], n, None) for n in range(len(ids) - 2)]
    pieces.append(detok.step("r", ids[-2:], len(ids) - 2, None))
    assert all("\ufffd" not in s for s in pieces)
    assert "".join(pieces) == text
    # The finish message brings the last (stop) id and the whole text.
    assert detok.step("r", [tok.eos_token_id], len(ids), {"type": "stop", "matched": tok.eos_token_id}) == text
    assert "r" not in detok.states  # finished requests are forgotten


def test_batched_detokenization_equals_one_request_at_a_time():
    """handle() gives per request the same texts as decoding each request alone, with both
    special-token options in one message, through the tokenizers backend and through the
    transformers path of a tokenizer that cleans up tokenization spaces."""
    tok = make_byte_tokenizer()
    texts = ["añb 世界 🙂 end", "plain ascii words", "🙂🙂 x", "a<|im_end|>b c"]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    skips = [True, False, True, False]
    for clean_up in (False, True):
        tok.clean_up_tokenization_spaces = clean_up
        batched, alone = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
        assert (batched.decoder.backend is None) == clean_up
        got = dict.fromkeys(range(len(seqs)), "")
        want = dict.fromkeys(range(len(seqs)), "")
        for n in range(max(len(x) for x in seqs)):
            live = [i for i, x in enumerate(seqs) if n < len(x)]
            finished = [{"type": "length"} if n == len(seqs[i]) - 1 else None for i in live]
            out = batched.handle(
                BatchTokenIDOut(
                    rids=[str(i) for i in live],
                    output_ids=[seqs[i][n : n + 1] for i in live],
                    output_offsets=[n] * len(live),
                    finished_reasons=finished,
                    prompt_tokens=[1] * len(live),
                    completion_tokens=[n + 1] * len(live),
                    cached_tokens=[0] * len(live),
                    skip_special_tokens=[skips[i] for i in live],
                    spaces_between_special_tokens=[True] * len(live),
                    no_stop_trim=[False] * len(live),
                    output_token_logprobs=[None] * len(live),
                    output_top_logprobs=[None] * len(live),
                    spec_verify_ct=[0] * len(live),
                )
            )
            for k, i in enumerate(live):
                piece = alone.step(str(i), seqs[i][n : n + 1], n, finished[k], skips[i])
                got[i] = out.output_strs[k] if finished[k] else got[i] + out.output_strs[k]
                want[i] = piece if finished[k] else want[i] + piece
        assert got == want
        assert got[3] == tok.decode(seqs[3], skip_special_tokens=False) and got[2] == texts[2]
        assert not batched.states


def test_detokenizer_stop_handling():
    tok = make_byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("abcSTOPx", add_special_tokens=False)
    assert detok.step("a", ids, 0, {"type": "stop", "matched": "STOP"}) == "abc"
    assert detok.step("b", ids, 0, {"type": "stop", "matched": "STOP"}, no_stop_trim=True) == "abcSTOPx"
    # A matched stop token id that is not special is dropped unless no_stop_trim.
    assert detok.step("c", ids, 0, {"type": "stop", "matched": ids[-1]}) == "abcSTOP"
    assert detok.step("d", ids, 0, {"type": "stop", "matched": ids[-1]}, no_stop_trim=True) == "abcSTOPx"
    special = [ids[0], tok.convert_tokens_to_ids("<|im_end|>"), ids[1]]
    assert detok.step("e", special, 0, {"type": "length"}, skip_special_tokens=False) == "a<|im_end|>b"
    assert detok.step("f", special, 0, {"type": "length"}) == "ab"
    assert trim_matched_stop("x\n\ny", {"type": "stop", "matched": "\n\n"}, False) == "x"
    assert trim_matched_stop("x\n\ny", {"type": "length"}, False) == "x\n\ny"


def test_hold_back_partial_stop():
    assert hold_back_partial_stop("Hello, wo", ["world"]) == "Hello, "
    assert hold_back_partial_stop("Hello", ["xyz"]) == "Hello"
    assert hold_back_partial_stop("ab\n", ["\n\n", "b\nq"]) == "a"
    assert hold_back_partial_stop("", ["a"]) == ""
