"""Load test: N mixed requests at a given concurrency against a running server, every
completed response checked, then the KV pool must return to full on every DP rank.

    python benchmark/load_test.py --base-url http://127.0.0.1:30000 --num-requests 200 \
        --concurrency 16 --abort-fraction 0.1

Requests mix /generate, /v1/completions and /v1/chat/completions, streaming and not;
`--abort-fraction` of them stream and are dropped by the client after the first chunk.
Checks per completed response: HTTP 200, a finish reason, token counts that agree with
each other and stay within max_tokens, and (streams) well-formed SSE where each
/generate snapshot extends the previous one. Afterwards a few greedy streams are
replayed without streaming: their concatenated deltas must equal the full text.
Exits 1 on any failure (any 5xx included), printing a JSON summary either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
PROMPT_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "what",
    "is",
    "capital",
    "of",
    "France",
    "hello",
    "how",
    "are",
    "you",
]


@dataclass
class Spec:
    """One request to send: where, how, and what the response must satisfy."""

    index: int
    endpoint: str
    stream: bool
    abort: bool
    prompt: str
    max_tokens: int
    temperature: float

    def body(self, model: str) -> dict[str, Any]:
        ignore_eos = self.abort  # aborted requests must still be running when dropped
        if self.endpoint == "/generate":
            params = {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "ignore_eos": ignore_eos}
            return {"text": self.prompt, "sampling_params": params, "stream": self.stream}
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": ignore_eos,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.endpoint == "/v1/completions":
            body["prompt"] = self.prompt
        else:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        return body


@dataclass
class Report:
    statuses: Counter = field(default_factory=Counter)
    completed: int = 0
    aborted: int = 0
    failures: list[str] = field(default_factory=list)
    # Greedy streams to replay: (spec, concatenated streamed text).
    streamed_greedy: list[tuple[Spec, str]] = field(default_factory=list)

    def fail(self, spec: Spec, message: str) -> None:
        self.failures.append(f"#{spec.index} {spec.endpoint} stream={spec.stream}: {message}")


def make_specs(n: int, abort_fraction: float, max_tokens: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    n_abort = round(n * abort_fraction)
    aborts = set(rng.sample(range(n), n_abort))
    specs = []
    for i in range(n):
        abort = i in aborts
        words = rng.randint(1, 12)
        specs.append(
            Spec(
                index=i,
                endpoint=ENDPOINTS[i % len(ENDPOINTS)],
                stream=abort or rng.random() < 0.5,
                abort=abort,
                prompt=" ".join(rng.choice(PROMPT_WORDS) for _ in range(words)),
                max_tokens=4 * max_tokens if abort else rng.randint(1, max_tokens),
                temperature=rng.choice((0.0, 0.0, 0.7)),
            )
        )
    return specs


async def sse_events(response: httpx.Response) -> AsyncIterator[Any]:
    """Parsed `data:` events up to [DONE] (which must come last)."""
    done = False
    async for line in response.aiter_lines():
        if not line:
            continue
        if done or not line.startswith("data: "):
            raise ValueError(f"malformed SSE line {line[:120]!r}")
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            continue
        yield json.loads(payload)
    if not done:
        raise ValueError("the stream ended without [DONE]")


# ---------------------------------------------------------------------- checks
def check_generate(spec: Spec, out: dict[str, Any]) -> None:
    meta = out["meta_info"]
    reason = meta["finish_reason"]
    assert reason is not None and reason["type"] in ("stop", "length"), f"finish_reason {reason}"
    assert meta["completion_tokens"] == len(out["output_ids"]), "completion_tokens != len(output_ids)"
    assert 0 < meta["completion_tokens"] <= spec.max_tokens, f"completion_tokens {meta['completion_tokens']}"
    assert meta["prompt_tokens"] > 0


def check_usage(spec: Spec, usage: Optional[dict[str, Any]]) -> None:
    assert usage is not None, "no usage"
    assert 0 < usage["completion_tokens"] <= spec.max_tokens, f"completion_tokens {usage['completion_tokens']}"
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def check_openai(spec: Spec, out: dict[str, Any]) -> str:
    (choice,) = out["choices"]
    assert choice["finish_reason"] in ("stop", "length"), f"finish_reason {choice['finish_reason']}"
    check_usage(spec, out["usage"])
    text = choice["message"]["content"] if spec.endpoint == "/v1/chat/completions" else choice["text"]
    assert isinstance(text, str)
    return text


async def check_stream(spec: Spec, response: httpx.Response) -> str:
    """Consume and check a finished stream; returns its full text."""
    if spec.endpoint == "/generate":
        last: Optional[dict[str, Any]] = None
        async for out in sse_events(response):
            assert "error" not in out, f"error event {out}"
            if last is not None:  # cumulative snapshots: each extends the previous one
                assert out["text"].startswith(last["text"]), "a snapshot's text does not extend the previous one"
                assert out["output_ids"][: len(last["output_ids"])] == last["output_ids"]
            last = out
        assert last is not None, "empty stream"
        check_generate(spec, last)
        return last["text"]
    text, reason, usage = "", None, None
    async for chunk in sse_events(response):
        assert "error" not in chunk, f"error event {chunk}"
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            assert reason is None, "a chunk after the finishing one"
            delta = choice["delta"].get("content") if "delta" in choice else choice["text"]
            text += delta or ""
            reason = choice["finish_reason"]
    assert reason in ("stop", "length"), f"finish_reason {reason}"
    check_usage(spec, usage)
    return text


# ---------------------------------------------------------------------- driving
async def run_one(client: httpx.AsyncClient, spec: Spec, model: str, report: Report) -> None:
    try:
        async with client.stream("POST", spec.endpoint, json=spec.body(model)) as response:
            report.statuses[response.status_code] += 1
            if response.status_code != 200:
                report.fail(spec, f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                return
            if spec.abort:
                async for _ in response.aiter_lines():
                    break  # drop the connection after the first line: the server must abort
                report.aborted += 1
                return
            if spec.stream:
                text = await check_stream(spec, response)
                if spec.temperature == 0:
                    report.streamed_greedy.append((spec, text))
            else:
                out = json.loads(await response.aread())
                check_generate(spec, out) if spec.endpoint == "/generate" else check_openai(spec, out)
        report.completed += 1
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        report.fail(spec, f"bad response: {type(e).__name__}: {e}")
    except httpx.HTTPError as e:
        report.fail(spec, f"transport error: {type(e).__name__}: {e}")


async def replay(client: httpx.AsyncClient, spec: Spec, model: str, streamed: str, report: Report) -> None:
    """A greedy stream's concatenated deltas must equal the same request without streaming."""
    plain = Spec(spec.index, spec.endpoint, False, False, spec.prompt, spec.max_tokens, 0.0)
    response = await client.post(spec.endpoint, json=plain.body(model))
    report.statuses[response.status_code] += 1
    out = response.json()
    text = out["text"] if spec.endpoint == "/generate" else check_openai(plain, out)
    if text != streamed:
        report.fail(spec, f"streamed text {streamed!r} != non-streamed {text!r}")


async def wait_kv_full(client: httpx.AsyncClient, timeout: float) -> Optional[str]:
    """None once every DP rank's KV pool is full again, else the last states seen."""
    deadline = time.monotonic() + timeout
    while True:
        states = (await client.get("/get_server_info")).json()["internal_states"]
        if all(s["available_kv_tokens"] == s["max_total_num_tokens"] for s in states):
            return None
        if time.monotonic() > deadline:
            return json.dumps([{k: s[k] for k in ("dp_rank", "available_kv_tokens", "max_total_num_tokens")} for s in states])
        await asyncio.sleep(0.2)


async def main_async(args: argparse.Namespace) -> Report:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    timeout = httpx.Timeout(args.request_timeout)
    report = Report()
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits, timeout=timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        specs = make_specs(args.num_requests, args.abort_fraction, args.max_tokens, args.seed)
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(spec: Spec) -> None:
            async with sem:
                await run_one(client, spec, model, report)

        await asyncio.gather(*(bounded(s) for s in specs))
        for spec, streamed in report.streamed_greedy[: args.replay_checks]:
            await replay(client, spec, model, streamed, report)
        not_full = await wait_kv_full(client, args.drain_timeout)
        if not_full is not None:
            report.failures.append(f"KV pool not back to full within {args.drain_timeout} s: {not_full}")
    return report


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=16, help="Upper bound of each request's max_tokens.")
    p.add_argument("--replay-checks", type=int, default=8, help="Greedy streams compared with a non-streamed replay.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=60.0, help="Seconds for the KV pool to return to full.")
    p.add_argument("--total-timeout", type=float, default=1200.0, help="Bound on the whole run.")
    args = p.parse_args(argv)
    if not 0 <= args.abort_fraction <= 1 or args.num_requests < 1 or args.concurrency < 1:
        p.error("need 0 <= --abort-fraction <= 1, --num-requests >= 1, --concurrency >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    try:
        report = asyncio.run(asyncio.wait_for(main_async(args), args.total_timeout))
    except asyncio.TimeoutError:
        print(json.dumps({"ok": False, "failures": [f"the run exceeded --total-timeout {args.total_timeout} s"]}))
        return 1
    server_errors = sum(n for status, n in report.statuses.items() if status >= 500)
    summary = {
        "ok": not report.failures and server_errors == 0,
        "requests": args.num_requests,
        "completed": report.completed,
        "aborted": report.aborted,
        "statuses": {str(k): v for k, v in sorted(report.statuses.items())},
        "server_errors": server_errors,
        "replayed": min(len(report.streamed_greedy), args.replay_checks),
        "seconds": round(time.monotonic() - start, 1),
        "failures": report.failures[:20],
    }
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
