"""DP attention load balance on CPU: the same Poisson workload against a `--tp-size 2
--dp-size 2 --enable-dp-attention` server once per `--load-balance-method` and
`--dp-prefill-align-iters` value, reporting the DP balance ratio (mean over largest per-rank
rows per iteration, from /get_server_info), the stalled-iteration fraction, the iterations,
the mean request latency and the total time.

    python benchmark/dp_balance.py --num-requests 64 --rate 8 --seed 0 --align-iters 0 4

Workload (fixed by --seed): arrivals at exponential gaps of mean 1/rate; prompts of 4 to
--max-prompt tokens and outputs of 2 to --max-output tokens (ignore_eos), both drawn
log-uniformly so that a few long requests mix with many short ones. Model: the tiny Llama of
sglang.test.tiny_models (random weights; the figures measure scheduling, not the model).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import threading
import time

import requests

from sglang.srt.server_args import LOAD_BALANCE_METHODS
from sglang.test.server_utils import kill_server, popen_launch_server
from sglang.test.tiny_models import make_tiny_llama


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))


def workload(args) -> list[tuple[float, list[int], int]]:
    """(arrival time in s, prompt ids, max_new_tokens) per request."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(1, 380) for _ in range(log_uniform(rng, 4, args.max_prompt))]
        out.append((t, prompt, log_uniform(rng, 2, args.max_output)))
    return out


def run(model: str, method: str, align_iters: int, requests_: list, args) -> dict:
    flags = ["--device", "cpu", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
    flags += ["--load-balance-method", method, "--skip-server-warmup", "--chunked-prefill-size", str(args.chunk)]
    flags += ["--dp-prefill-align-iters", str(align_iters)]
    server = popen_launch_server(model, flags)
    try:
        url = server.base_url
        errors: list[str] = []
        latencies: list[float] = []

        def send(arrival: float, prompt: list[int], max_new: int, start: float) -> None:
            time.sleep(max(0.0, start + arrival - time.monotonic()))
            sent = time.monotonic()
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
            reply = requests.post(f"{url}/generate", json=body, timeout=600)
            if reply.status_code != 200 or len(reply.json()["output_ids"]) != max_new:
                errors.append(reply.text[:200])
            latencies.append(time.monotonic() - sent)

        start = time.monotonic()
        threads = [threading.Thread(target=send, args=(*r, start)) for r in requests_]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total_s = time.monotonic() - start
        states = requests.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
        return {
            "method": method,
            "align_iters": align_iters,
            "total_s": round(total_s, 2),
            "mean_latency_s": round(sum(latencies) / len(latencies), 2),
            "balance_ratio": round(states[0]["balance_ratio"], 3),
            "tokens_per_iteration": [round(s["tokens_per_iteration"], 2) for s in states],
            "stalled_iteration_fraction": [round(s["stalled_iteration_fraction"], 3) for s in states],
            "iterations": [s["iterations"] for s in states],
        }
    finally:
        kill_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second")
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=["round_robin", "minimum_tokens"], choices=LOAD_BALANCE_METHODS)
    parser.add_argument(
        "--align-iters", nargs="+", type=int, default=[0], help="--dp-prefill-align-iters values, each run with every method"
    )
    args = parser.parse_args()
    model = make_tiny_llama(tempfile.mkdtemp(prefix="dp_balance_"))
    reqs = workload(args)
    for align_iters in args.align_iters:
        for method in args.methods:
            print(json.dumps(run(model, method, align_iters, reqs, args)), flush=True)


if __name__ == "__main__":
    main()
