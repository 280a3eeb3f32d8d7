"""GPU check and timing of prefill CUDA graphs (on by default; --disable-piecewise-cuda-graph) against eager prefill.

0. `engine`: tiny random Llama and DeepSeek-V3 checkpoints (the latter also with NEXTN 3/1/4,
   whose target prefill and draft extend replay prefill graphs), float32 and bfloat16, run
   bench_cuda_graph's greedy request groups (1, 4 and 5 prompts of 3 to 32 tokens) through an
   engine with decode graphs and one with prefill graphs too: whether the tokens are identical
   (float32 must be; bfloat16 is reported: the bucket's GEMM shapes differ from eager's).

Then for each model shape (dummy weights of a config under benchmark/configs), one ModelRunner
captures its decode and prefill graphs (the default buckets unless --tokens):

1. `equal`: each prefill case of sglang.test.prefill_batches (one prompt, several of different
   lengths, a cached prefix, a chunk after a chunk, a full bucket, a long prompt) runs eagerly,
   then replays its graph on the same KV (each writes the same slots from the same prefix):
   whether a graph replayed, the largest |logits difference| relative to the largest |logit|,
   and whether the greedy tokens agree (all of them, and those whose top two logits are further
   apart than twice the tolerance, which must);
2. `timing`: one prompt of each --input-lens, after warm-up: --repeats prefills each way, each
   synchronized, their median wall time (host start to logits on the device) and the median
   of the graph replay alone between CUDA events; then --profile-iters prefills each way under
   torch.profiler: device busy time and kernels per prefill (trace_summary.py).

One JSON line per check; exit status 1 when a check that must pass fails.

    source .device/env.sh && python3 benchmark/gpu/validate_prefill_graphs.py --models small-deepseek llama8b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_cuda_graph import GRAPH_ARGS, greedy_tokens
from bench_decode import dummy_model_dir
from graph_timing import median_replay_ms
from trace_summary import load_events, summarize

from sglang.bench_one_batch import load_runner
from sglang.srt.batch.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.test.prefill_batches import PREFILL_CASES, PrefillBatches, case_batches
from sglang.test.tiny_deepseek import make_tiny_deepseek_v3
from sglang.test.tiny_models import make_tiny_llama

BENCHMARK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "small-deepseek": "deepseek-v3-small-mtp.json",
    "smollm2": "smollm2-135m.json",
    "llama8b": "llama-3.1-8b.json",
    "v2lite": "deepseek-v2-lite.json",
}
# Largest |logits difference| allowed, relative to the largest |logit| (bf16 weights; the
# bucket's GEMM shapes differ from eager's).
RELATIVE_TOL = 2e-2


# (name, checkpoint maker, engine arguments beyond GRAPH_ARGS): plain servers, and a NEXTN
# server whose target prefill and draft extend replay prefill graphs too.
ENGINE_CASES = (
    ("tiny_llama", make_tiny_llama, {}),
    ("tiny_deepseek_v3", make_tiny_deepseek_v3, {}),
    (
        "tiny_deepseek_v3 NEXTN 3/1/4",
        make_tiny_deepseek_v3,
        {
            "speculative_algorithm": "NEXTN",
            "speculative_num_steps": 3,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4,
        },
    ),
)


def check_engine() -> bool:
    """One JSON line per case and dtype; True when every float32 token is identical."""
    ok = True
    for name, make, extra in ENGINE_CASES:
        path = make(tempfile.mkdtemp(prefix="prefill-graph-"))
        for dtype in ("float32", "bfloat16"):
            decode_only = greedy_tokens(path, dtype, {**GRAPH_ARGS, **extra, "disable_piecewise_cuda_graph": True})
            with_prefill = greedy_tokens(path, dtype, {**GRAPH_ARGS, **extra})
            identical = decode_only == with_prefill
            ok &= identical or dtype != "float32"
            row = {"check": "engine", "model": name, "dtype": dtype, "identical": identical}
            print(json.dumps(row), flush=True)
    return ok


def make_runner(config: str, tokens: list[int] | None) -> ModelRunner:
    args = ServerArgs(
        model_path=dummy_model_dir(os.path.join(BENCHMARK_DIR, "configs", config)),
        load_format="dummy",
        device="cuda",
        cuda_graph_bs=[1],
        max_running_requests=32,  # the cases' requests and the timed ones, never freed
        max_total_tokens=16384,
        piecewise_cuda_graph_tokens=tokens,
    )
    runner = load_runner(args)
    assert runner.graph_runner is not None, "no CUDA graphs captured"
    return runner


def check_equal(runner: ModelRunner, model: str) -> bool:
    """One JSON line per case; True when every case replayed a graph, within the tolerance and
    with the same greedy tokens wherever they are clear."""
    graphs = runner.graph_runner
    ok = True
    for case in PREFILL_CASES:
        *warm, fb = case_batches(runner, case)
        for batch in warm:
            runner.forward_eager(batch)
        eager = runner.forward_eager(fb).next_token_logits.float()
        replays = graphs.num_replays
        graph = runner.forward(fb).next_token_logits.float()
        replayed = graphs.num_replays == replays + 1
        tol = RELATIVE_TOL * eager.abs().max().item()
        diff = (graph - eager).abs().max().item()
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
        same = graph.argmax(-1) == eager.argmax(-1)
        same_where_clear = bool(same[clear].all())
        ok &= replayed and diff <= tol and same_where_clear
        row = {
            "check": "equal",
            "model": model,
            "case": case,
            "replayed": replayed,
            "max_abs_logits_diff": diff,
            "max_abs_logit": eager.abs().max().item(),
            "greedy_equal": bool(same.all()),
            "greedy_equal_where_clear": same_where_clear,
        }
        print(json.dumps(row), flush=True)
    return ok


def median_wall_ms(forward: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def device_profile(forward: Callable[[], object], iterations: int) -> dict:
    """Device busy time and kernels per forward, from a torch.profiler trace."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iterations):
            forward()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        summary = summarize(load_events(path), iterations)
    return {k: summary.get(k) for k in ("device_busy_us_per_iter", "kernels_per_iter", "device_span_us_per_iter")}


def time_prefill(runner: ModelRunner, model: str, input_len: int, repeats: int, profile_iters: int) -> None:
    """One JSON line per way (graph, eager) for one prompt of input_len tokens."""
    vocab = runner.model_config.vocab_size
    batches = PrefillBatches(runner)
    fb = batches.extend([batches.request([(31 * i + 7) % vocab for i in range(input_len)])])
    runner.attach(fb)
    graphs = runner.graph_runner
    key = graphs.key_for(fb)
    assert key is not None and key.mode == ForwardMode.EXTEND, f"a {input_len}-token prefill has no graph"
    ways = {"graph": lambda: runner.forward(fb), "eager": lambda: runner.forward_eager(fb)}
    for forward in ways.values():  # warm-up: compiles and caches, both ways
        for _ in range(3):
            forward()
    for way, forward in ways.items():
        row = {"check": "timing", "model": model, "input_len": input_len, "way": way, "repeats": repeats}
        row["wall_ms_median"] = median_wall_ms(forward, repeats)
        if way == "graph":
            row["bucket_tokens"] = key.num_tokens
            row["replay_ms_median"] = median_replay_ms(graphs.graphs[key], repeats)
        row.update(device_profile(forward, profile_iters))
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small-deepseek", "llama8b"], choices=sorted(CONFIGS))
    parser.add_argument("--input-lens", type=int, nargs="+", default=[276, 1024])
    parser.add_argument("--tokens", type=int, nargs="+", help="--piecewise-cuda-graph-tokens (default: the server's)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--profile-iters", type=int, default=10)
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine check (tiny models)")
    args = parser.parse_args()
    ok = args.skip_engine or check_engine()
    for model in args.models:
        runner = make_runner(CONFIGS[model], args.tokens)
        ok &= check_equal(runner, model)
        for input_len in args.input_lens:
            time_prefill(runner, model, input_len, args.repeats, args.profile_iters)
        del runner
        torch.cuda.empty_cache()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
