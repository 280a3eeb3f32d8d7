"""Serving benchmark against a running server (SGLang's `python -m sglang.bench_serving`).

    python -m sglang.bench_serving --backend sglang --port 30000 --dataset-name random \
        --random-input-len 256 --random-output-len 128 --num-prompts 200 --max-concurrency 32
    python -m sglang.bench_serving --backend sglang --port 30000 --dataset-name file \
        --dataset-path prompts.jsonl --num-prompts 64 --request-rate 4

Requests stream through /generate (random prompts as input_ids, file prompts as text) with
greedy sampling and ignore_eos, so every request produces exactly its output length.
Arrivals: all at once (default), or Poisson at --request-rate; --max-concurrency caps the
requests in flight. Reports TTFT, TPOT (per request, (latency - TTFT) / (output - 1)), ITL
(between stream chunks; with speculation one chunk can carry several tokens) and E2E
latency as mean / median / p99, request and token throughput, and the accept length: of
this run (tokens after the first / verify steps, summed over requests) and the server's
since startup (/get_server_info, warm-up requests included): per DP rank, with a warning
when the ranks differ by more than 0.1, and their mean; and the client's own CPU (one event
loop reads every chunk), with a warning when it was busy most of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
import orjson
import requests


@dataclass
class BenchRequest:
    payload: dict[str, Any]  # the /generate body, minus sampling parameters
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)  # ITL samples
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_ct: int = 0


# ---------------------------------------------------------------------------- datasets
def random_requests(args: argparse.Namespace, vocab_size: int, rng: random.Random) -> list[BenchRequest]:
    """Uniform random token ids; lengths uniform in [ratio * len, len]."""

    def length(full: int) -> int:
        return rng.randint(max(1, int(full * args.random_range_ratio)), full)

    reqs = []
    for _ in range(args.num_prompts):
        ids = [rng.randrange(vocab_size) for _ in range(length(args.random_input_len))]
        reqs.append(BenchRequest({"input_ids": ids}, length(args.random_output_len)))
    return reqs


def file_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """JSONL lines {"prompt": str, "output_len"?: int}, cycled up to --num-prompts."""
    with open(args.dataset_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise ValueError(f"no prompts in {args.dataset_path}")
    return [
        BenchRequest({"text": r["prompt"]}, int(r.get("output_len", args.random_output_len)))
        for r in (records[i % len(records)] for i in range(args.num_prompts))
    ]


# ---------------------------------------------------------------------------- HTTP
class StreamClient:
    """POST a JSON body and iterate over the server-sent-event payloads (aiohttp: a chunk costs
    the client's one event loop about half of what httpx's connection pool takes at
    concurrency 32, where the client can be the limit; see the client_cpu_* metrics)."""

    def __init__(self, timeout_s: float):
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s), connector=aiohttp.TCPConnector(limit=0)
        )

    async def events(self, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self._session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                if (event := _parse_event(raw)) is not None:
                    yield event

    async def close(self) -> None:
        await self._session.close()


def _parse_event(line: bytes) -> Optional[dict[str, Any]]:
    """A server-sent-event line's JSON payload (None for other lines and the [DONE] mark)."""
    line = line.strip()
    if not line.startswith(b"data:") or line == b"data: [DONE]":
        return None
    event = orjson.loads(line[len(b"data:") :])
    if "error" in event:
        raise RuntimeError(f"stream error: {event['error']}")
    return event


async def send_request(client: StreamClient, url: str, req: BenchRequest) -> RequestResult:
    body = {
        **req.payload,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": req.output_len, "ignore_eos": True},
    }
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async for event in client.events(url, body):
            meta = event["meta_info"]
            now = time.perf_counter()
            if meta["completion_tokens"] > result.completion_tokens:
                if result.completion_tokens == 0:
                    result.ttft = now - start
                else:
                    result.chunk_gaps.append(now - last)
                last = now
            result.completion_tokens = meta["completion_tokens"]
            result.prompt_tokens = meta["prompt_tokens"]
            result.spec_verify_ct = meta.get("spec_verify_ct", 0)
        result.latency = time.perf_counter() - start
        result.ok = result.completion_tokens == req.output_len
        if not result.ok:
            result.error = f"got {result.completion_tokens} tokens, asked {req.output_len}"
    except Exception as e:
        result.error = repr(e)
    return result


async def run_requests(args: argparse.Namespace, url: str, reqs: list[BenchRequest]) -> tuple[list[RequestResult], float, float]:
    """All requests with the arrival process and concurrency cap; (results, wall seconds, this
    process's CPU seconds meanwhile: the client reads every streamed chunk in one event loop)."""
    client = StreamClient(args.timeout)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed)

    async def one(req: BenchRequest) -> RequestResult:
        if limit is None:
            return await send_request(client, url, req)
        async with limit:
            return await send_request(client, url, req)

    try:
        await send_request(client, url, BenchRequest(reqs[0].payload, 4))  # warm-up, not measured
        start, cpu_start = time.perf_counter(), time.process_time()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        await client.close()


# ---------------------------------------------------------------------------- report
def _stats(name: str, values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        f"mean_{name}_ms": statistics.fmean(values) * scale,
        f"median_{name}_ms": statistics.median(values) * scale,
        f"p99_{name}_ms": p99 * scale,
    }


ACCEPT_LENGTH_SPREAD = 0.1  # DP ranks whose accept lengths differ by more get a warning


def server_accept_lengths(base_url: str) -> Optional[list[float]]:
    """Each DP rank's avg_spec_accept_length since startup (/get_server_info's internal_states,
    in DP-rank order); None without speculation."""
    states = requests.get(f"{base_url}/get_server_info", timeout=30).json()["internal_states"]
    values = [s["avg_spec_accept_length"] for s in states if s.get("avg_spec_accept_length") is not None]
    return values or None


def report_accept_lengths(per_rank: Optional[list[float]]) -> Optional[float]:
    """Print each DP rank's accept length, warn when they differ by more than
    ACCEPT_LENGTH_SPREAD; returns their mean (None without speculation)."""
    if per_rank is None:
        return None
    print("Accept length per DP rank: " + ", ".join(f"DP{i} {v:.2f}" for i, v in enumerate(per_rank)))
    if max(per_rank) - min(per_rank) > ACCEPT_LENGTH_SPREAD:
        print(
            f"WARNING: the DP ranks' accept lengths differ by {max(per_rank) - min(per_rank):.2f} "
            f"(more than {ACCEPT_LENGTH_SPREAD}): a rank speculates worse than the others",
            flush=True,
        )
    return statistics.fmean(per_rank)


CLIENT_BUSY_WARNING = 0.9  # a client CPU-busy for this fraction of the run may be what limits it


def summarize(
    args: argparse.Namespace, results: list[RequestResult], duration: float, client_cpu: float, base_url: str
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in done)
    client_busy = client_cpu / duration
    # Each verify step emits accepted drafts + 1; the first token of a request comes from prefill.
    speculated = [r for r in done if r.spec_verify_ct]
    verify_steps = sum(r.spec_verify_ct for r in speculated)
    verify_tokens = sum(r.completion_tokens - 1 for r in speculated)
    per_rank = server_accept_lengths(base_url)
    metrics: dict[str, Any] = {
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(results),
        "completed": len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "input_throughput": sum(r.prompt_tokens for r in done) / duration,
        "output_throughput": out_tokens / duration,
        "accept_length": verify_tokens / verify_steps if verify_steps else None,
        "server_accept_length": report_accept_lengths(per_rank),
        "server_accept_length_per_rank": per_rank,
        "client_cpu_fraction": client_busy,
        "client_cpu_us_per_output_token": client_cpu / out_tokens * 1e6 if out_tokens else None,
    }
    if client_busy > CLIENT_BUSY_WARNING:
        print(
            f"WARNING: the benchmark client was busy {client_busy:.0%} of the run: its own CPU may limit "
            "the throughput measured (fewer chunks: the server's --stream-interval)",
            flush=True,
        )
    metrics.update(_stats("ttft", [r.ttft for r in done]))
    metrics.update(_stats("tpot", [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in done if r.completion_tokens > 1]))
    metrics.update(_stats("itl", [g for r in done for g in r.chunk_gaps]))
    metrics.update(_stats("e2e_latency", [r.latency for r in done]))
    return metrics


def print_report(m: dict[str, Any]) -> None:
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    for key, value in m.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<40}{shown:>20}")
    print("=" * 60, flush=True)


# ---------------------------------------------------------------------------- entry
def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def build_requests(args: argparse.Namespace, base_url: str) -> list[BenchRequest]:
    if args.dataset_name == "file":
        if not args.dataset_path:
            raise ValueError("--dataset-name file needs --dataset-path")
        return file_requests(args)
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    tokenizer_path = args.tokenizer or requests.get(f"{base_url}/get_model_info", timeout=30).json()["tokenizer_path"]
    return random_requests(args, len(get_tokenizer(tokenizer_path)), random.Random(args.seed))


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by args (see get_parser); print and return the metrics."""
    base_url = base_url_of(args)
    if args.flush_cache:
        requests.post(f"{base_url}/flush_cache", timeout=30)
    reqs = build_requests(args, base_url)
    results, duration, client_cpu = asyncio.run(run_requests(args, f"{base_url}/generate", reqs))
    metrics = summarize(args, results, duration, client_cpu, base_url)
    print_report(metrics)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(metrics) + "\n")
    return metrics


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("sglang",), default="sglang")
    p.add_argument("--base-url", help="overrides --host/--port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dataset-name", choices=("random", "file"), default="random")
    p.add_argument("--dataset-path", help='JSONL of {"prompt": ..., "output_len"?: ...} for --dataset-name file')
    p.add_argument("--tokenizer", help="for random prompts' vocabulary (default: the server's tokenizer path)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128, help="also the output length of file prompts without one")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random lengths uniform in [max(1, ratio * len), len]; 0.0 as in SGLang, 1.0 for fixed lengths",
    )
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache first")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", help="append the metrics as one JSON line")
    return p


def main() -> None:
    metrics = run_benchmark(get_parser().parse_args())
    if metrics["completed"] < metrics["num_prompts"]:
        raise SystemExit(f"{metrics['num_prompts'] - metrics['completed']} requests failed: {metrics['errors']}")


if __name__ == "__main__":
    main()
