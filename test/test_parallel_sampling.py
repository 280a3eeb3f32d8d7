"""n > 1 samples of one prompt (Engine, /generate, both OpenAI endpoints, with and without
NEXTN), GET /v1/models/{id}, and Engine.async_generate with async streaming."""

from __future__ import annotations

import asyncio

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


def test_n_with_stream_is_refused(engine):
    with pytest.raises(ValueError, match="n > 1"):
        list(engine.generate(PROMPT, SAMPLING, stream=True))


def test_async_generate_and_async_stream(engine):
    expected = engine.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0})["output_ids"]

    async def run() -> tuple[list, list[list[int]]]:
        outs = await asyncio.gather(*(engine.async_generate(PROMPT, {"max_new_tokens": 5, "temperature": 0}) for _ in range(3)))
        stream = await engine.async_generate(PROMPT, {"max_new_tokens": 5, "temperature": 0}, stream=True)
        chunks = [chunk["output_ids"] async for chunk in stream]
        return outs, chunks

    outs, chunks = asyncio.run(run())
    assert [o["output_ids"] for o in outs] == [expected] * 3
    assert chunks[-1] == expected and len(chunks) > 1
    assert engine.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0})["output_ids"] == expected  # sync again


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
