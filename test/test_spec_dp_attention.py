"""Speculative decoding under DP attention (`--tp 2 --dp 2 --enable-dp-attention`, CPU, gloo, float32).

- Scheduler-level runs (two spawned ranks driving real Scheduler objects iteration by
  iteration, so arrivals are placed exactly): greedy tokens equal the single-rank
  non-speculative run for NEXTN topk 4 (tree) and EAGLE on a tiny Llama, under uneven load —
  one rank idle for a whole run, a rank prefilling (chunked, longer than the chunk) while the
  other verifies, requests ending at different steps. Every dp_gather is recorded and
  attributed to its sub-forward: its rows per DP rank are the planned ones (extend: tokens;
  draft step: bs x topk; verify: bs x num_draft_tokens; draft extend: bs x (steps + 1)), one
  buffer is allocated per rank and every gather uses it.
- A perfect NEXTN draft gives accept length exactly steps + 1 on every DP rank.
- Over HTTP (threads, staggered arrivals, --num-continuous-decode-steps 2), NEXTN topk 1:
  tokens equal the reference, per-rank accept length in the `[DP1 TP1] Decode batch …
  accept len:` line and in internal_states.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Optional
from unittest import mock

import pytest
import requests
import torch
import torch.multiprocessing as mp

from sglang.srt.batch.forward_batch_info import ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import initialize_model_parallel
from sglang.srt.distributed.scheduler_comm import GlobalPlan, LocalPlan
from sglang.srt.layers import dp_attention
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader import get_model
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.speculative.spec_plan import SpecIterationPlan, SpecSizes, SubForward
from sglang.test.inprocess_scheduler import DetokenizerStub
from sglang.test.model_harness import ModelHarness
from sglang.test.server_utils import kill_server, popen_launch_server

CHUNK = 4
CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
LONG = [5, 17, 42, 99, 7, 3, 150, 11, 12, 13, 14, 15, 16]  # longer than CHUNK: prefilled in 4 chunks
# Runs of (iteration, DP rank, rid, prompt, max_new_tokens), one after the other.
SCENARIOS = [
    # Rank 1 idles while rank 0 prefills and decodes; its long prompt arrives while rank 0
    # verifies (extend and decode phases in one iteration); requests end at different steps.
    [
        (0, 0, "a", [8, 9, 10], 9),
        (0, 0, "b", [100, 101, 102, 103, 104, 105, 106], 5),
        (4, 1, "c", LONG, 11),
        (6, 0, "d", [60, 61, 62], 2),
    ],
    # One request: rank 1 is idle for the whole run.
    [(0, 0, "e", LONG[:6], 7)],
]


# ---- reference ---------------------------------------------------------------------------


def _reference(path: str) -> dict[str, list[int]]:
    """Single-rank, non-speculative greedy tokens of every request of SCENARIOS."""
    initialize_model_parallel(1, 0)
    config = ModelConfig(path, dtype="float32", device="cpu")
    harness = ModelHarness(get_model(config, "auto", "cpu"), config, max_context_len=64)
    reqs = [r for run in SCENARIOS for r in run]
    outs = harness.greedy_generate([p for *_, p, _ in reqs], max(n for *_, n in reqs))
    return {rid: out[:n] for (_, _, rid, _, n), out in zip(reqs, outs)}


# ---- sub-forward plan from the all-gather (pure) -------------------------------------------


def test_sub_forward_rows_from_the_plan_all_gather():
    sizes = SpecSizes(steps=3, topk=4, num_draft_tokens=8)
    # DP0 prefills 6 tokens, DP1 decodes 2 requests, DP2 is idle: both phases run everywhere.
    plan = GlobalPlan((LocalPlan(6, 2, 1), LocalPlan(2, 2, 0), LocalPlan(0, 0, 0)))
    it = SpecIterationPlan.from_global(plan, sizes)
    assert it.sub_forwards() == [
        SubForward.TARGET_EXTEND,
        SubForward.DRAFT_EXTEND_PREFILL,
        SubForward.DRAFT_LOOP,  # steps - 1 = 2 draft forwards
        SubForward.TARGET_VERIFY,
        SubForward.DRAFT_EXTEND,
    ]
    assert it.rows(SubForward.TARGET_EXTEND) == it.rows(SubForward.DRAFT_EXTEND_PREFILL) == (6, 0, 0)
    assert it.rows(SubForward.DRAFT_LOOP) == (0, 8, 0)  # bs x topk, not bs x num_draft_tokens
    assert it.rows(SubForward.TARGET_VERIFY) == (0, 16, 0)
    assert it.rows(SubForward.DRAFT_EXTEND) == (0, 8, 0)  # padded to steps + 1 per request
    decode_only = SpecIterationPlan.from_global(GlobalPlan((LocalPlan(1, 1, 0), LocalPlan(0, 0, 0))), sizes)
    assert decode_only.extend_phase() == [] and decode_only.global_num_tokens(SubForward.TARGET_VERIFY) == [8, 0]
    local = SpecIterationPlan.local(0, 3, sizes)
    assert local.global_num_tokens(SubForward.TARGET_VERIFY) is None  # one DP group: no gathering
    assert local.extend_phase() == [] and local.rows(SubForward.TARGET_VERIFY) == (24,)


def test_a_prefill_with_its_running_requests_cycle_runs_both_phases():
    """--enable-mixed-chunk under speculation: a rank that prefills also decodes its running
    requests in the same iteration (LocalPlan.alongside_decode_reqs)."""
    sizes = SpecSizes(steps=3, topk=1, num_draft_tokens=4)
    # DP0 prefills 6 tokens of 2 requests while its 5 running requests cycle; DP1 decodes 2.
    plan = GlobalPlan((LocalPlan(6, 2, 1, alongside_decode_reqs=5), LocalPlan(2, 2, 0, alongside_decode_reqs=0)))
    it = SpecIterationPlan.from_global(plan, sizes)
    assert it.extend_phase() and it.decode_phase()
    assert it.rows(SubForward.TARGET_EXTEND) == (6, 0)
    assert it.rows(SubForward.TARGET_VERIFY) == (20, 8)
    local = SpecIterationPlan.local(6, 5, sizes)
    assert local.rows(SubForward.TARGET_EXTEND) == (6,) and local.rows(SubForward.TARGET_VERIFY) == (20,)


# ---- scheduler-level runs on two spawned ranks ---------------------------------------------


def _start_scheduler(rank: int, server_args: ServerArgs, port_args: PortArgs) -> tuple[Scheduler, int]:
    """A rank's Scheduler (no sockets: requests are injected), and how many gathered buffers it allocated."""
    made = []
    make = ModelRunner._make_gathered_buffer

    def counted(runner: ModelRunner) -> torch.Tensor:
        made.append(runner)
        return make(runner)

    with mock.patch.object(ModelRunner, "_make_gathered_buffer", counted):
        scheduler = Scheduler(server_args, port_args, 0, rank, None)
    scheduler.recv_from_tokenizer = None
    scheduler.send_to_detokenizer = DetokenizerStub()
    return scheduler, len(made)


def _drive(scheduler: Scheduler, run: list[tuple], record: list[dict]) -> None:
    """Iterate in lockstep with the other rank until every rank is idle after the last arrival."""
    worker = scheduler.spec_worker
    launch = worker.launch
    batches: list[tuple[ForwardMode, int, int]] = []

    def recorded(batch, *plan_and_tier):
        alongside = batch.alongside_decode
        batches.append((batch.mode, len(batch.reqs), len(alongside.reqs) if alongside else 0))
        return launch(batch, *plan_and_tier)

    last_arrival = max(r[0] for r in run)
    with mock.patch.object(worker, "launch", recorded):
        for it in range(10_000):
            for _, _, rid, prompt, max_new in [r for r in run if r[0] == it and r[1] == scheduler.dp_rank]:
                params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
                scheduler.handle_message(TokenizedGenerateReqInput(rid, None, prompt, params))
            worker.trace, batches[:] = [], []
            scheduler.run_iteration()
            if batches:
                record.append({"iteration": scheduler.iterations, "batch": batches[0], "trace": list(worker.trace)})
            if it >= last_arrival and scheduler.globally_idle:
                return
    raise AssertionError("did not finish")


def _check_gathers(gathers: list[tuple], record: list[dict], dp_rank: int, sizes: dict, layers: dict) -> None:
    """Every dp_gather moved the planned rows of its sub-forward, through the one buffer: an
    iteration's gathers, in order, are those of its traced sub-forwards, one per MLP/MoE layer
    of each forward (a decode cycle run as one program traces its three sub-forwards)."""
    steps, topk, n = sizes["speculative_num_steps"], sizes["speculative_eagle_topk"], sizes["speculative_num_draft_tokens"]
    assert len({ptr for *_, ptr in gathers}) == 1, "more than one gathered buffer"
    by_iteration: dict[int, list[tuple]] = {}
    for iteration, rows, local, _ in gathers:
        by_iteration.setdefault(iteration, []).append((rows, local))
    assert set(by_iteration) <= {r["iteration"] for r in record}
    for r in record:
        trace = r["trace"]
        expected = [
            (planned, planned_local)
            for kind, planned, planned_local in trace
            for _ in range((steps - 1 if kind == "draft_loop" else 1) * layers[kind.startswith("target")])
        ]
        assert by_iteration.get(r["iteration"], []) == expected, (trace, r)
        assert all(local == rows[dp_rank] for rows, local in expected), trace
        rows = {kind: planned for kind, planned, _ in trace}
        if "target_verify" in rows:  # per DP rank: bs x topk, bs x num_draft_tokens, bs x (steps + 1)
            bs = [v // n for v in rows["target_verify"]]
            assert rows["target_verify"] == tuple(b * n for b in bs)
            assert rows["draft_extend"] == tuple(b * (steps + 1) for b in bs)
            assert all(planned == tuple(b * topk for b in bs) for kind, planned, _ in trace if kind == "draft_loop")
            assert [kind for kind, _, _ in trace].count("draft_loop") == (steps > 1)
            mode, num_reqs, alongside = r["batch"]
            assert bs[dp_rank] == (num_reqs if mode == ForwardMode.DECODE else alongside)
        if "target_extend" in rows:
            assert rows["draft_extend_prefill"] == rows["target_extend"]


def _rank_main(rank: int, server_args: ServerArgs, port_args: PortArgs, refs: dict, expect: dict, results) -> None:
    torch.set_num_threads(1)
    scheduler, buffers_made = _start_scheduler(rank, server_args, port_args)
    assert buffers_made == 1  # the draft runner shares the target's gathered buffer
    worker = scheduler.spec_worker
    assert worker.draft_runner.gathered_buffer is scheduler.runner.gathered_buffer
    gathers: list[tuple] = []
    gather = dp_attention.dp_gather

    def recorded_gather(local, global_num_tokens, buffer, ranks):
        gathers.append((scheduler.iterations, tuple(global_num_tokens), local.shape[0], buffer.data_ptr()))
        return gather(local, global_num_tokens, buffer, ranks)

    record: list[dict] = []
    with mock.patch.object(dp_attention, "dp_gather", recorded_gather):
        for run in SCENARIOS:
            _drive(scheduler, run, record)
    mine = {r[2] for run in SCENARIOS for r in run if r[1] == scheduler.dp_rank}
    assert scheduler.send_to_detokenizer.finished == {rid: refs[rid] for rid in mine}
    layers = {True: scheduler.model_config.num_hidden_layers, False: 1}
    _check_gathers(gathers, record, scheduler.dp_rank, expect["sizes"], layers)
    # Coverage of the uneven-load cases this run is meant to exercise.
    traces = [dict((k, rows) for k, rows, _ in r["trace"]) for r in record]
    assert any("target_extend" in t and "target_verify" in t for t in traces), "no mixed iteration"
    if scheduler.dp_rank == 1:  # idle for the whole second run
        assert any(r["batch"][0] == ForwardMode.IDLE for r in record), "this rank never idled"
    if expect["mixed"] and scheduler.dp_rank == 0:  # its prefills came while its requests ran
        assert any(r["batch"][2] for r in record), "no prefill of this rank carried its running requests' cycle"
    assert scheduler.free_kv_tokens() == scheduler.allocator.size
    results[rank] = scheduler.avg_spec_accept_length()


def _run_ranks(model_path: str, refs: dict, mixed: bool = False, **spec_args) -> list[float]:
    """Two ranks (--tp 2 --dp 2 --enable-dp-attention); returns each DP rank's accept length."""
    server_args = ServerArgs(
        model_path=model_path,
        device="cpu",
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        chunked_prefill_size=CHUNK,
        max_running_requests=4,
        debug_collectives=True,
        enable_mixed_chunk=mixed,
        **spec_args,
    )
    port_args = PortArgs.init_new(server_args)
    sizes = {k: getattr(server_args, k) for k in CHAIN}
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_rank_main, args=(server_args, port_args, refs, {"sizes": sizes, "mixed": mixed}, results), nprocs=2)
    return [results[r] for r in range(2)]


@pytest.fixture(scope="module")
def deepseek_reference(tiny_deepseek_v3_dir) -> dict[str, list[int]]:
    return _reference(tiny_deepseek_v3_dir)


@pytest.mark.timeout(300)
def test_nextn_tree_uneven_load_and_gathered_rows(tiny_deepseek_v3_dir, deepseek_reference):
    _run_ranks(tiny_deepseek_v3_dir, deepseek_reference, speculative_algorithm="NEXTN", **TREE)


@pytest.mark.timeout(300)
def test_nextn_cycles_beside_prefills_under_dp_attention(tiny_deepseek_v3_dir, deepseek_reference):
    """--enable-mixed-chunk: a rank's prefill queues its running requests' cycle in the same
    iteration; every rank runs the planned sub-forwards, tokens equal the reference."""
    _run_ranks(tiny_deepseek_v3_dir, deepseek_reference, mixed=True, speculative_algorithm="NEXTN", **CHAIN)


@pytest.mark.timeout(300)
def test_perfect_nextn_accepts_steps_plus_one_on_every_dp_rank(perfect_deepseek_v3_dir):
    target = perfect_deepseek_v3_dir
    accept = _run_ranks(target, _reference(target), speculative_algorithm="NEXTN", **CHAIN)
    assert accept == [CHAIN["speculative_num_steps"] + 1] * 2


@pytest.mark.timeout(300)
def test_eagle_llama_under_dp_attention(tiny_llama_unsharded_eagle_pair):
    target, head = tiny_llama_unsharded_eagle_pair
    _run_ranks(target, _reference(target), speculative_algorithm="EAGLE", speculative_draft_model_path=head, **TREE)


# ---- HTTP server: staggered arrivals, logs and internal state ------------------------------


def test_http_staggered_arrivals_and_per_rank_accept_length(tiny_deepseek_v3_dir, deepseek_reference):
    run = SCENARIOS[0]
    spec = [f"--{k.replace('_', '-')}={v}" for k, v in CHAIN.items()]
    args = ["--device", "cpu", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--speculative-algo", "NEXTN"]
    args += spec + ["--chunked-prefill-size", str(CHUNK), "--decode-log-interval", "1", "--debug-collectives"]
    # Each DP rank holds its late arrivals back for up to 2 cycles of its own decoding.
    args += ["--num-continuous-decode-steps", "2"]
    args += ["--load-balance-method", "round_robin"]  # both ranks decode: each logs its accept length
    server = popen_launch_server(tiny_deepseek_v3_dir, args)
    try:
        results: dict[str, Optional[list[int]]] = {}

        def send(rid: str, prompt: list[int], max_new: int, delay: float) -> None:
            time.sleep(delay)
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
            results[rid] = requests.post(f"{server.base_url}/generate", json=body, timeout=120).json()["output_ids"]

        # Round robin over the DP ranks; later ones land while others decode.
        threads = [threading.Thread(target=send, args=(rid, p, n, 0.4 * i)) for i, (_, _, rid, p, n) in enumerate(run)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == {rid: deepseek_reference[rid] for *_, rid, _, _ in run}
        states = requests.get(f"{server.base_url}/get_server_info", timeout=30).json()["internal_states"]
        assert [s["dp_rank"] for s in states] == [0, 1]
        for s in states:
            assert 1.0 <= s["avg_spec_accept_length"] <= CHAIN["speculative_num_steps"] + 1
            assert s["available_kv_tokens"] == s["max_total_num_tokens"]
            assert abs(s["plan_all_gathers"] - s["iterations"]) <= 1
        log = server.log_tail(400000)
        for rank in (0, 1):
            assert re.search(rf"DP{rank} TP{rank}\] Decode batch\. .*accept len: \d+\.\d\d", log), rank
        assert re.search(r"DP attention gathered buffer: \d+ rows x \d+ hidden = \d+ bytes", log)
    finally:
        kill_server(server)


# ---- ranks that differ: memory, greedy against sampling ------------------------------------


def _uneven_memory_main(rank: int, server_args: ServerArgs, port_args: PortArgs, results) -> None:
    """Rank 1 has a quarter of rank 0's KV pool, so its memory-derived running-request cap is smaller."""
    torch.set_num_threads(1)
    profile = ModelRunner._profile_max_num_tokens

    def smaller_on_rank_1(runner: ModelRunner, shared) -> int:
        tokens = profile(runner, shared)
        return tokens if shared is not None or rank == 0 else tokens // 4

    with mock.patch.object(ModelRunner, "_profile_max_num_tokens", smaller_on_rank_1):
        scheduler, _ = _start_scheduler(rank, server_args, port_args)
    results[rank] = (scheduler.max_running_requests, tuple(scheduler.runner.gathered_buffer.shape))


@pytest.mark.timeout(300)
def test_ranks_with_unequal_memory_agree_on_the_gathered_buffer(tiny_deepseek_v3_dir):
    """max_running_requests (memory-derived when not given) sizes each rank's gathered buffer;
    it is agreed at startup, so no rank's buffer is smaller than the others' batches need."""
    server_args = ServerArgs(
        model_path=tiny_deepseek_v3_dir,
        device="cpu",
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        chunked_prefill_size=CHUNK,
        max_total_tokens=200,
        speculative_algorithm="NEXTN",
        **CHAIN,
    )
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_uneven_memory_main, args=(server_args, PortArgs.init_new(server_args), results), nprocs=2)
    assert results[0] == results[1]
    assert results[0][0] == 200 // 4 // 2  # rank 1's cap


def _greedy_and_sampling_main(rank: int, server_args: ServerArgs, port_args: PortArgs, refs: dict, results) -> None:
    torch.set_num_threads(1)
    scheduler, _ = _start_scheduler(rank, server_args, port_args)
    run = SCENARIOS[0]
    temperature = 0.0 if rank == 0 else 0.9  # rank 0 greedy, rank 1 samples (same prompts)
    for _, _, rid, prompt, max_new in run:
        params = SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(rid, None, prompt, params))
    finished = scheduler.send_to_detokenizer.finished
    for _ in range(10_000):
        scheduler.run_iteration()
        if len(finished) == len(run) and scheduler.globally_idle:
            break
    assert scheduler.free_kv_tokens() == scheduler.allocator.size
    results[rank] = dict(finished)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_one_dp_rank_greedy_the_other_sampling(tiny_deepseek_v3_dir, deepseek_reference, spec):
    """The greedy rank runs the whole cycle as one program while the sampling rank runs it
    sub-forward by sub-forward with the walk on the host: the same collectives on both
    (--debug-collectives checks them), and the greedy rank's tokens equal the reference."""
    server_args = ServerArgs(
        model_path=tiny_deepseek_v3_dir,
        device="cpu",
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        chunked_prefill_size=CHUNK,
        max_running_requests=4,
        debug_collectives=True,
        speculative_algorithm="NEXTN",
        **spec,
    )
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_greedy_and_sampling_main, args=(server_args, PortArgs.init_new(server_args), deepseek_reference, results), nprocs=2)
    run = SCENARIOS[0]
    assert results[0] == {rid: deepseek_reference[rid] for *_, rid, _, _ in run}
    assert {rid: len(ids) for rid, ids in results[1].items()} == {rid: n for *_, rid, _, n in run}


def _attn_tp_sampling_main(rank: int, server_args: ServerArgs, port_args: PortArgs, results) -> None:
    torch.set_num_threads(1)
    scheduler, _ = _start_scheduler(rank, server_args, port_args)
    torch.manual_seed(100)
    if rank == 1:  # the ranks' tree walks draw different uniforms (their other draws agree)
        own = torch.Generator().manual_seed(7)
        scheduler.spec_worker._uniforms = lambda reqs, n: torch.rand((len(reqs), n), generator=own)
    run = SCENARIOS[0]
    for _, _, rid, prompt, max_new in run:
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(rid, None, prompt, params))
    finished = scheduler.send_to_detokenizer.finished
    for _ in range(10_000):
        scheduler.run_iteration()
        if len(finished) == len(run) and not scheduler.has_work():
            break
    results[rank] = dict(finished)


@pytest.mark.timeout(300)
def test_attention_tp_ranks_keep_rank_0s_sampled_acceptance(tiny_deepseek_v3_dir):
    """--tp 2: both ranks hold the same requests and walk the tree with their own random
    numbers; they keep attention-TP rank 0's outcome, so their tokens (and KV) agree."""
    server_args = ServerArgs(
        model_path=tiny_deepseek_v3_dir, device="cpu", tp_size=2, max_running_requests=4, speculative_algorithm="NEXTN", **TREE
    )
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_attn_tp_sampling_main, args=(server_args, PortArgs.init_new(server_args), results), nprocs=2)
    assert results[0] == results[1] and len(results[0]) == len(SCENARIOS[0])
