"""The IPC collectives on the GPU: correctness (eager, inside CUDA graphs, and mixed), then
latency per message size; with ranks on separate GPUs, NCCL beside them as the baseline.

    source .device/env.sh && python3 benchmark/kernels/bench_collectives.py --world 2 --gpu-id-step 0

Each rank is a process; rank r uses GPU base + r * step (step 0: all on one GPU, where NCCL
refuses to run and its column stays empty). Latency is the median over repeats of one CUDA
graph holding `--per-graph` collectives, divided by that count. On one GPU the processes are
time-sliced, so a collective there costs about a context switch per rank: no speed target
applies, the figures say what a correctness run pays per collective.
Prints one JSON line per check and per size; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from graph_timing import capture, median_replay_ms

from sglang.srt.distributed.ipc_collectives import IpcCommunicator


def _expected_sum(shape, dtype, world: int, seed: int, device) -> torch.Tensor:
    return sum(_rank_input(shape, dtype, r, seed, device).float() for r in range(world)).to(dtype)


def _rank_input(shape, dtype, rank: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _checks(comm: IpcCommunicator, rank: int, world: int, device) -> list[dict]:
    rows = []
    # Eager: sizes across the block boundary, two dtypes, all-reduce and all-gather.
    ok = True
    for seed, (n, dtype) in enumerate(
        [(1, torch.float32), (2047, torch.bfloat16), (2049, torch.float32), (100_000, torch.bfloat16)]
    ):
        x = _rank_input((n,), dtype, rank, seed, device)
        comm.all_reduce(x)
        ok &= torch.equal(x, _expected_sum((n,), dtype, world, seed, device))
        part = _rank_input((5, 3), dtype, rank, seed + 100, device)
        got = comm.all_gather(part, dim=-1)
        ok &= torch.equal(got, torch.cat([_rank_input((5, 3), dtype, r, seed + 100, device) for r in range(world)], dim=-1))
    rows.append({"check": "eager all-reduce and all-gather", "ok": bool(ok)})
    # A graph of three collectives replayed with new inputs, eager calls between replays.
    static = torch.zeros(4096, dtype=torch.bfloat16, device=device)
    outs = []
    for _ in range(2):  # compile outside the capture
        comm.all_reduce(static.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = comm.all_reduce(static * 1)
        b = comm.all_gather(static[:16].clone(), dim=0)
        c = comm.all_reduce(a * 2)
        outs = [a, b, c]
    ok = True
    for seed in range(20):
        static.copy_(_rank_input((4096,), torch.bfloat16, rank, 500 + seed, device))
        graph.replay()
        expected = _expected_sum((4096,), torch.bfloat16, world, 500 + seed, device)
        ok &= torch.equal(outs[0], expected) and torch.equal(outs[2], (expected * 2 * world).to(torch.bfloat16))
        ok &= torch.equal(
            outs[1], torch.cat([_rank_input((4096,), torch.bfloat16, r, 500 + seed, device)[:16] for r in range(world)])
        )
        y = _rank_input((3000,), torch.float32, rank, 900 + seed, device)
        comm.all_reduce(y)
        ok &= torch.equal(y, _expected_sum((3000,), torch.float32, world, 900 + seed, device))
    rows.append({"check": "graph replays mixed with eager calls", "ok": bool(ok)})
    return rows


def _latency_us(fn, per_graph: int, repeats: int) -> float:
    fn()  # compiled outside the capture
    graph = capture(lambda: [fn() for _ in range(per_graph)])
    return median_replay_ms(graph, repeats) * 1000 / per_graph


def _rank(rank: int, args, port: int, results) -> None:
    gpu = args.base_gpu_id + rank * args.gpu_id_step
    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    shared = args.gpu_id_step == 0
    dist.init_process_group("gloo" if shared else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    cpu_group = dist.group.WORLD if shared else dist.new_group(backend="gloo")
    max_bytes = max(args.sizes_kb) * 1024
    comm = IpcCommunicator(rank, args.world, max_bytes, device, cpu_group)
    rows = _checks(comm, rank, args.world, device)
    for kb in args.sizes_kb:
        x = torch.ones(kb * 1024 // 2, dtype=torch.bfloat16, device=device)
        row = {"world": args.world, "gpu_id_step": args.gpu_id_step, "bytes": kb * 1024}
        row["ipc_all_reduce_us"] = round(_latency_us(lambda x=x: comm.all_reduce(x), args.per_graph, args.repeats), 1)
        if not shared:
            row["nccl_all_reduce_us"] = round(_latency_us(lambda x=x: dist.all_reduce(x), args.per_graph, args.repeats), 1)
        rows.append(row)
    dist.barrier(group=cpu_group)
    results.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--gpu-id-step", type=int, default=0)
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[4, 64, 512, 4096])
    p.add_argument("--per-graph", type=int, default=10, help="collectives in the timed graph")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--jsonl", help="also append the rows here")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    start = time.time()
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(60)
    failed = False
    for row in per_rank[0]:
        if "check" in row:
            row["ok"] = all(
                r.get("ok", True) for rank_rows in per_rank.values() for r in rank_rows if r.get("check") == row["check"]
            )
            failed |= not row["ok"]
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(json.dumps({"seconds": round(time.time() - start, 1), "failed": failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
