"""Hugging Face transformers decode speed on the same random-weight model shapes, and the
HBM roofline (weight bytes / measured device copy bandwidth), for comparison with
benchmark/bench_decode.py on the same machine.

    python benchmark/bench_hf_decode.py --config benchmark/configs/llama-3.1-8b.json --batch-sizes 1 32
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def copy_bandwidth_gbs(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Device-to-device copy: bytes read + written per second (GB/s)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def timed(model, ids: torch.Tensor, new_tokens: int, cache: str) -> float:
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation=cache)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--cache", default="static", help="transformers cache_implementation (static or dynamic)")
    args = parser.parse_args()

    config = AutoConfig.from_pretrained(args.config)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth_gbs()
    print(
        json.dumps(
            {
                "copy_bandwidth_GBps": round(bw, 1),
                "weight_GiB": round(weight_bytes / 2**30, 3),
                "roofline_ms_per_token_bs1": round(weight_bytes / (bw * 1e9) * 1e3, 3),
            }
        ),
        flush=True,
    )
    for bs in args.batch_sizes:
        ids = torch.randint(10, 300, (bs, args.input_len), device="cuda")
        # Warm-up with the timed length: a static cache sized input + output_len gives the shapes
        # that transformers' automatic torch.compile of static-cache decoding specializes on.
        timed(model, ids, args.output_len, args.cache)
        t1 = timed(model, ids, 1, args.cache)
        tn = timed(model, ids, args.output_len, args.cache)
        step = (tn - t1) / (args.output_len - 1)
        print(
            json.dumps(
                {
                    "engine": f"transformers ({args.cache} cache)",
                    "batch_size": bs,
                    "ms_per_token_step": round(step * 1e3, 3),
                    "tokens_per_s": round(bs / step, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
