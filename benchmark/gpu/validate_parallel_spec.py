"""GPU validation of speculative decoding and of TP / DP attention (NCCL).

With --gpus 2: greedy tokens under TP, DP attention (eager and with decode CUDA graphs) and
NEXTN + DP attention equal the single-GPU plain run, a perfect draft accepts steps + 1 on every DP rank, and decode
throughput of tp2 against tp2 + dp2 on a DeepSeek-V2-Lite-shaped dummy model.
With --gpus 1: the same speculative checks (NEXTN chain and tree, EAGLE, perfect draft) on one
GPU with the Triton backend, eagerly and with CUDA graphs.

    source .device/env.sh && python3 benchmark/gpu/validate_parallel_spec.py --gpus 2 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import sglang as sgl
from sglang.test.spec_models import make_eagle_head, make_perfect_deepseek_v3
from sglang.test.tiny_deepseek import make_tiny_deepseek_v3
from sglang.test.tiny_models import make_tiny_llama

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 12, 13], [8, 9, 10], [100, 101, 102, 103, 104, 105, 106], list(range(30, 70))]
MAX_NEW = [24, 9, 17, 30]
DP_ATTN = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}


def greedy(path: str, **kwargs) -> tuple[list[list[int]], list]:
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW]
    with sgl.Engine(model_path=path, log_level="warning", **kwargs) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
        states = engine.get_server_info()["internal_states"]
    return [o["output_ids"] for o in outs], [s.get("avg_spec_accept_length") for s in states]


def check(name: str, path: str, reference: list[list[int]], **kwargs) -> dict:
    start = time.time()
    try:
        tokens, accept = greedy(path, **kwargs)
        row = {"check": name, "identical": tokens == reference, "accept_len_per_dp_rank": accept}
    except Exception as e:  # keep validating the other configurations
        row = {"check": name, "identical": False, "error": f"{type(e).__name__}: {e}"[:500]}
    row["seconds"] = round(time.time() - start, 1)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=2)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    parallel = DP_ATTN if args.gpus == 2 else {}
    tmp = tempfile.mkdtemp()
    llama = make_tiny_llama(os.path.join(tmp, "llama"))
    dsv3 = make_tiny_deepseek_v3(os.path.join(tmp, "dsv3"))
    perfect = make_perfect_deepseek_v3(os.path.join(tmp, "perfect"))
    where = "tp2 dp2 dp-attention" if args.gpus == 2 else "1 GPU"
    rows = []
    references = {}
    for name, path in (("llama", llama), ("dsv3", dsv3)):
        references[name], _ = greedy(path, dtype="float32", disable_cuda_graph=True)
        if args.gpus == 2:
            rows.append(check(f"{name} tp2", path, references[name], dtype="float32", tp_size=2, disable_cuda_graph=True))
            rows.append(check(f"{name} {where}", path, references[name], dtype="float32", disable_cuda_graph=True, **DP_ATTN))
            rows.append(check(f"{name} {where} cuda graphs", path, references[name], dtype="float32", **DP_ATTN))
    eagle = make_eagle_head(llama, os.path.join(tmp, "eagle"))
    perfect_reference, _ = greedy(perfect, dtype="float32", disable_cuda_graph=True)
    spec_cases = [
        (
            f"dsv3 NEXTN topk{k}",
            dsv3,
            references["dsv3"],
            {**NEXTN, "speculative_eagle_topk": k, "speculative_num_draft_tokens": n},
        )
        for k, n in ((1, 4), (4, 8))
    ] + [
        (
            "llama EAGLE topk4",
            llama,
            references["llama"],
            {
                "speculative_algorithm": "EAGLE",
                "speculative_draft_model_path": eagle,
                "speculative_num_steps": 3,
                "speculative_eagle_topk": 4,
                "speculative_num_draft_tokens": 8,
            },
        ),
        (
            "perfect NEXTN (accept len must be 4.0 per rank)",
            perfect,
            perfect_reference,
            {**NEXTN, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4},
        ),
    ]
    # One GPU: speculative sub-forwards eagerly and through CUDA graphs (same tokens, same accept).
    for graphs in (False, True) if args.gpus == 1 else (False,):
        for name, path, reference, spec in spec_cases:
            label = f"{name} {where}" + (" cuda graphs" if graphs else "")
            rows.append(check(label, path, reference, dtype="float32", disable_cuda_graph=not graphs, **parallel, **spec))
    with open(os.path.join(args.out, f"validate_{args.gpus}gpu.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    if args.skip_throughput or args.gpus == 1:
        return
    bench = [
        sys.executable,
        "benchmark/bench_decode.py",
        "--config",
        "benchmark/configs/deepseek-v2-lite.json",
        "--batch-sizes",
        "64",
        "--output-len",
        "32",
        "--repeats",
        "2",
        "--result-file",
        os.path.join(args.out, "tp_dp_throughput.jsonl"),
        "--",
    ]
    for extra in (
        ["--tp-size", "2", "--disable-cuda-graph"],
        ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--disable-cuda-graph"],
        ["--tp-size", "2", "--cuda-graph-max-bs", "64"],
        ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--cuda-graph-max-bs", "64"],
        ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--disable-cuda-graph", "--speculative-algorithm", "NEXTN"],
        [
            "--tp-size",
            "2",
            "--dp-size",
            "2",
            "--enable-dp-attention",
            "--cuda-graph-max-bs",
            "64",
            "--speculative-algorithm",
            "NEXTN",
        ],
    ):
        print("throughput:", " ".join(extra), flush=True)
        subprocess.run(bench + extra, timeout=240, check=False)


if __name__ == "__main__":
    main()
