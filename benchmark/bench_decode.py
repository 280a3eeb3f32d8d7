"""Decode speed through the full engine (scheduler, detokenizer, sampling), per batch size.

A model from a config alone (random weights, `--config`) or a real model (`--model-path`):

    python benchmark/bench_decode.py --config benchmark/configs/llama-3.1-8b.json --batch-sizes 1 32
    python benchmark/bench_decode.py --model-path SmolLM2-135M-Instruct --batch-sizes 1 32
    python benchmark/bench_decode.py --config benchmark/configs/llama-3.1-8b.json \
        --draft-config benchmark/configs/llama-3.1-8b-eagle.json --batch-sizes 1 -- --speculative-algorithm EAGLE \
        --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4

Decode time per token step is (T(out_len) - T(1)) / (out_len - 1): the prefill and the first
token cancel out. Under speculation the same difference divided by the verify steps of the
request gives the time of one speculative cycle. Each figure is the median of --repeats runs after a warm-up. Any flag after `--`
goes to the engine (e.g. `-- --disable-cuda-graph --tp-size 2`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import sglang as sgl
from sglang.srt.server_args import prepare_server_args


def dummy_model_dir(config_path: str) -> str:
    """A directory with the config and a small tokenizer (ids beyond it decode to nothing)."""
    from sglang.test.tiny_models import make_tiny_tokenizer

    out = tempfile.mkdtemp(prefix="bench-model-")
    shutil.copy(config_path, os.path.join(out, "config.json"))
    make_tiny_tokenizer(out)
    return out


def add_model_source_args(parser: argparse.ArgumentParser) -> None:
    """--config or --model-path (one of them), and --draft-config."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="HF config.json: random weights of that shape")
    source.add_argument("--model-path", help="a real model")
    parser.add_argument("--draft-config", help="HF config.json of a draft model: random weights of that shape (with --config)")


def model_source_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The engine flags of add_model_source_args' choice: the model, dummy weights for a config."""
    if args.draft_config and not args.config:
        parser.error("--draft-config needs --config (random weights for both models)")
    if not args.config:
        return ["--model-path", args.model_path]
    flags = ["--model-path", dummy_model_dir(args.config), "--load-format", "dummy"]
    if args.draft_config:
        flags += ["--speculative-draft-model-path", dummy_model_dir(args.draft_config)]
    return flags


def timed_generate(engine: sgl.Engine, prompts: list[list[int]], out_len: int) -> tuple[float, int]:
    """Seconds for the batch, and the verify steps of its first request (0 without speculation)."""
    params = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(o["meta_info"]["completion_tokens"] == out_len for o in outs)
    return elapsed, outs[0]["meta_info"].get("spec_verify_ct", 0)


def synthetic_prompts(batch_size: int, input_len: int) -> list[list[int]]:
    """Distinct token-id prompts within every benchmark tokenizer's vocabulary (the dummy
    models' tokenizer has 384 tokens)."""
    return [[10 + (i * 7 + j) % 290 for j in range(input_len)] for i in range(batch_size)]


def bench(engine: sgl.Engine, batch_size: int, input_len: int, out_len: int, repeats: int) -> dict:
    prompts = synthetic_prompts(batch_size, input_len)
    timed_generate(engine, prompts, 8)  # warm-up at this batch size
    per_token, per_cycle = [], []
    for _ in range(repeats):
        engine.flush_cache()
        t1, _ = timed_generate(engine, prompts, 1)
        engine.flush_cache()
        tn, cycles = timed_generate(engine, prompts, out_len)
        per_token.append((tn - t1) / (out_len - 1))
        if cycles:  # speculative: one cycle = draft steps + verify + draft extend
            per_cycle.append((tn - t1) / cycles)
    step = statistics.median(per_token)
    row = {"batch_size": batch_size, "ms_per_token_step": step * 1e3, "tokens_per_s": batch_size / step}
    if per_cycle:
        row["ms_per_spec_cycle"] = statistics.median(per_cycle) * 1e3
    return row


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--result-file", help="append one JSON line per batch size")
    args = parser.parse_args(argv)
    server_args = prepare_server_args([*model_source_flags(parser, args), *engine_argv])
    engine = sgl.Engine(**vars(server_args))
    try:
        weight_bytes = engine.get_server_info()["internal_states"][0].get("weight_bytes")
        for bs in args.batch_sizes:
            row = bench(engine, bs, args.input_len, args.output_len, args.repeats)
            row.update(
                model=args.config or args.model_path,
                weight_gib=round(weight_bytes / 2**30, 3) if weight_bytes else None,
                attention_backend=server_args.attention_backend,
                cuda_graph=not server_args.disable_cuda_graph,
                engine_args=" ".join(engine_argv),
            )
            print(json.dumps(row), flush=True)
            if args.result_file:
                with open(args.result_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
