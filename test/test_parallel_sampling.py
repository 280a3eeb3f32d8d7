"""n > 1 samples of one prompt (Engine, /generate, both OpenAI endpoints, with and without
NEXTN; streamed: each sample's chunks carry its index), GET /v1/models/{id}, and
Engine.async_generate with async streaming."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
import requests

import sglang as sgl
from sglang.test.server_utils import kill_server, popen_launch_server

PROMPT = "The quick brown fox jumps over"
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "n": 4}


def _check_samples(outs: list[dict], n: int = 4) -> None:
    assert len(outs) == n
    for out in outs:
        meta = out["meta_info"]
        assert len(out["output_ids"]) == 6
        assert meta["cached_tokens"] == meta["prompt_tokens"] - 1  # the prompt's KV, prefilled once
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # independent samples


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu", log_level="warning") as engine:
        yield engine


def test_engine_n_samples_share_the_prompt(engine):
    _check_samples(engine.generate(PROMPT, SAMPLING))


def test_engine_batch_with_n_is_prompt_major(engine):
    outs = engine.generate([PROMPT, "Hello world, this is"], {**SAMPLING, "n": 2, "temperature": 0})
    assert len(outs) == 4
    assert outs[0]["output_ids"] == outs[1]["output_ids"] != outs[2]["output_ids"] == outs[3]["output_ids"]
    assert outs[0]["meta_info"]["prompt_tokens"] != outs[2]["meta_info"]["prompt_tokens"]


def _last_per_index(chunks: list[dict]) -> list[dict]:
    last = {chunk["index"]: chunk for chunk in chunks}
    assert sorted(last) == list(range(len(last)))
    return [last[i] for i in range(len(last))]


def test_engine_stream_n_marks_each_sample(engine):
    params = {**SAMPLING, "sampling_seed": 7}  # sample i draws with seed 7 + i, streamed or not
    final = engine.generate(PROMPT, params)
    chunks = list(engine.generate(PROMPT, params, stream=True))
    assert len(chunks) > 4
    assert [c["output_ids"] for c in _last_per_index(chunks)] == [o["output_ids"] for o in final]


def test_async_generate_and_async_stream(engine):
    # 32 tokens: a stream's pending outputs merge into one chunk while its reader waits, and a
    # loaded machine can starve the reader for a few steps of the tiny model, not for 32.
    greedy = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    expected = engine.generate(PROMPT, greedy)["output_ids"]

    async def run() -> tuple[list, list[list[int]]]:
        outs = await asyncio.gather(*(engine.async_generate(PROMPT, greedy) for _ in range(3)))
        stream = await engine.async_generate(PROMPT, greedy, stream=True)
        chunks = [chunk["output_ids"] async for chunk in stream]
        return outs, chunks

    outs, chunks = asyncio.run(run())
    assert [o["output_ids"] for o in outs] == [expected] * 3
    assert len(chunks) > 1 and chunks[-1] == expected
    assert all(chunk == expected[: len(chunk)] for chunk in chunks)  # each chunk: the output so far
    assert engine.generate(PROMPT, greedy)["output_ids"] == expected  # sync again


def test_engine_n_with_nextn(tiny_deepseek_v3_dir):
    with sgl.Engine(model_path=tiny_deepseek_v3_dir, device="cpu", speculative_algorithm="NEXTN", log_level="warning") as engine:
        outs = engine.generate(input_ids=list(range(3, 13)), sampling_params=SAMPLING)
    _check_samples(outs)
    assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in outs)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    proc = popen_launch_server(tiny_llama_dir, ["--device", "cpu", "--served-model-name", "org/tiny"])
    yield proc
    kill_server(proc)


def test_http_generate_n(server):
    r = requests.post(server.base_url + "/generate", json={"text": PROMPT, "sampling_params": SAMPLING}, timeout=120)
    assert r.status_code == 200, r.text
    _check_samples(r.json())
    body = {"text": PROMPT, "sampling_params": SAMPLING, "stream": True}
    with requests.post(server.base_url + "/generate", json=body, timeout=120, stream=True) as r:
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    _check_samples(_last_per_index([json.loads(line[len("data: ") :]) for line in lines[:-1]]))


def _stream_choices(chunks) -> tuple[dict[int, str], dict[int, list]]:
    """Per choice index: its text, and the finish reasons of its chunks in order."""
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else choice.delta.content
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, reasons


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_openai_completions_stream_n(server, temperature, echo):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    kwargs = dict(
        model="org/tiny", prompt=PROMPT, max_tokens=6, temperature=temperature, echo=echo, extra_body={"ignore_eos": True}
    )
    single = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, n=3, stream=True, stream_options={"include_usage": True}))
    texts, reasons = _stream_choices(chunks)
    assert sorted(texts) == [0, 1, 2]
    assert all(r[-1] == "length" and r.count(None) == len(r) - 1 for r in reasons.values())  # one finish, last
    assert all(t.startswith(PROMPT) == echo and t.count(PROMPT) <= 1 for t in texts.values())
    if temperature == 0:
        assert list(texts.values()) == [single.choices[0].text] * 3
    else:
        assert len(set(texts.values())) > 1
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == single.usage.prompt_tokens
    assert usage.completion_tokens == 18 and usage.total_tokens == usage.prompt_tokens + 18


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_openai_chat_stream_n(server, temperature):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    kwargs = dict(
        model="org/tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=temperature,
        extra_body={"ignore_eos": True},
    )
    single = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, n=3, stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3  # a role chunk per choice
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    texts, reasons = _stream_choices(chunks)
    assert sorted(texts) == [0, 1, 2]
    assert all(r[-1] == "length" and r.count(None) == len(r) - 1 for r in reasons.values())
    if temperature == 0:
        assert list(texts.values()) == [single.choices[0].message.content] * 3
    else:
        assert len(set(texts.values())) > 1
    usage = chunks[-1].usage
    assert usage.prompt_tokens == single.usage.prompt_tokens and usage.completion_tokens == 18


def test_openai_n_and_models_retrieve(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    completion = client.completions.create(model="org/tiny", prompt=PROMPT, max_tokens=6, n=4, temperature=1.0)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    single = client.completions.create(model="org/tiny", prompt=PROMPT, max_tokens=6, temperature=1.0)
    assert completion.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    chat = client.chat.completions.create(
        model="org/tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, n=4, temperature=1.0
    )
    assert [c.index for c in chat.choices] == [0, 1, 2, 3]
    model = client.models.retrieve("org/tiny")
    assert model.id == "org/tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_stream_n_client_gone_aborts_every_sample(server):
    body = {"text": PROMPT, "sampling_params": {**SAMPLING, "n": 3, "max_new_tokens": 400}, "stream": True}
    with requests.post(server.base_url + "/generate", json=body, timeout=120, stream=True) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream: every sample must be aborted
    deadline = time.monotonic() + 30
    while True:
        (state,) = requests.get(server.base_url + "/get_server_info", timeout=10).json()["internal_states"]
        if state["available_kv_tokens"] == state["max_total_num_tokens"] and state["num_running_reqs"] == 0:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
