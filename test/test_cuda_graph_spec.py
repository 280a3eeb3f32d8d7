"""CUDA graphs of speculative decoding, emulated on CPU: each graph's captured work runs where
the graph would replay (a whole decode cycle, or the draft loop, the verify and the draft
extend), for NEXTN and EAGLE, chains and trees, adaptive tiers and DP attention: the eager
tokens and accept lengths. The tests run under TRITON_INTERPRET=1, in the process that
test_cuda_graph_replay.py starts on CPU."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from unittest import mock

import pytest
import torch

from sglang.srt.batch.forward_batch_info import ForwardMode
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, GraphKey
from sglang.srt.model_executor.model_runner import ModelRunner, greedy_decode
from sglang.srt.server_args import ServerArgs
from sglang.test.graph_batches import lengths_agree
from sglang.test.triton_harness import INTERPRETED, patch_interpreter_for_numpy2


# ---------------------------------------------------------------------- speculative sub-forwards
def _weight_addresses(runner: ModelRunner) -> list[int]:
    return [p.data_ptr() for p in runner.model.parameters()]


class _WorkAsGraph:
    """A CUDA graph's stand-in on CPU: replay() runs the captured work on the static inputs and
    leaves the outputs where a replayed graph would. Like a graph, it reads the weights at
    the addresses they had at capture: replacing a weight afterwards fails the replay.
    Counts replays per mode, and keeps the keys replayed with their groups."""

    replays: dict[ForwardMode, int] = {}
    keys: set[tuple[GraphKey, int]] = set()

    def __init__(self, graphs: CudaGraphRunner, key: GraphKey):
        self.graphs, self.key = graphs, key
        self.weights = _weight_addresses(graphs.model_runner)

    def replay(self) -> None:
        assert _weight_addresses(self.graphs.model_runner) == self.weights, "a weight moved after capture"
        mode = self.graphs.modes[self.key.mode_key]
        batch = self.graphs.inputs.batch(self.key, mode)
        if not mode.slots_only:  # else the work reads no lengths from the batch
            assert batch.extend_seq_lens.tolist() == [self.key.tokens_per_req] * self.key.batch_size, self.key
        self.graphs.run_into_outputs(batch, self.key)
        _WorkAsGraph.replays[self.key.mode] = _WorkAsGraph.replays.get(self.key.mode, 0) + 1
        _WorkAsGraph.keys.add((self.key, self.graphs.group(self.key)))


def _emulated_capture(graphs: CudaGraphRunner) -> None:
    """CudaGraphRunner.capture on CPU: the same buffers and warm-up runs (largest key first),
    with _WorkAsGraph graphs."""
    runner = graphs.model_runner
    width = runner.req_to_token_pool.req_to_token.shape[1]
    runner.attn_backend.init_cuda_graph_state(graphs.max_bs, graphs.max_bs * width, torch.device("cpu"))
    for key in graphs.capture_order():
        batch = graphs.inputs.padding_batch(key, graphs.modes[key.mode_key])
        assert graphs.modes[key.mode_key].slots_only or lengths_agree(batch), key
        graphs.ensure_outputs(key, graphs._run(batch, key))
        graphs.graphs[key] = _WorkAsGraph(graphs, key)


@contextmanager
def _cpu_graphs():
    """ModelRunners built inside capture the modes they are given as on CUDA (at the same
    point of their construction), as _WorkAsGraph graphs."""
    with (
        mock.patch.object(ModelRunner, "_graph_modes", lambda runner: runner.captured_modes(None)),
        mock.patch.object(CudaGraphRunner, "capture", _emulated_capture),
    ):
        yield


SPEC_PROMPTS = [[5, 17, 42, 99, 7, 3], [8, 9, 10], [100, 101, 102, 103, 104]]
SPEC_MAX_NEW = [10, 4, 7]  # finishing at different cycles: batches of 3, 2, 1 replay padded graphs


def _spec_args(path: str, **args) -> ServerArgs:
    return ServerArgs(
        model_path=path,
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=1024,
        max_running_requests=4,
        disable_radix_cache=True,
        **args,
    )


def _spec_greedy(
    args: ServerArgs,
    graphs: bool,
    prompts: list[list[int]],
    max_new: list[int],
    tp_rank: int = 0,
    port_args=None,
    return_logprob: bool = False,
) -> tuple[list[list[int]], float]:
    from sglang.test.inprocess_scheduler import greedy, start_scheduler

    if graphs:
        with _cpu_graphs():
            scheduler = start_scheduler(replace(args, cuda_graph_bs=[1, 2, 4]), tp_rank, port_args)
    else:
        scheduler = start_scheduler(args, tp_rank, port_args)
    return greedy(scheduler, prompts, max_new, return_logprob=return_logprob), scheduler.avg_spec_accept_length()


# Greedy batches run each cycle as one graph (DECODE_CYCLE); logprobs need the verify logits,
# so those batches replay the draft loop's, the verify's and the draft extend's graphs instead.
_CYCLE_GRAPHS = {
    False: {ForwardMode.DECODE_CYCLE},
    True: {ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE, ForwardMode.DRAFT_EXTEND},
}


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("logprobs", [False, True], ids=["whole cycle", "sub-forwards"])
@pytest.mark.parametrize("case", ["perfect NEXTN chain", "NEXTN tree", "EAGLE tree"])
def test_captured_work_matches_eager_spec(request, case, logprobs):
    """A cycle through its graphs' captured work (padded batches, static tree masks and hidden
    states), as one graph or sub-forward by sub-forward: the same tokens and accept length as
    eagerly."""
    chain = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    tree = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    path, spec = {
        "perfect NEXTN chain": ("perfect_deepseek_v3_dir", dict(speculative_algorithm="NEXTN", **chain)),
        "NEXTN tree": ("tiny_deepseek_v3_dir", dict(speculative_algorithm="NEXTN", **tree)),
        "EAGLE tree": ("tiny_llama_dir", dict(speculative_algorithm="EAGLE", **tree)),
    }[case]
    path = request.getfixturevalue(path)
    if spec["speculative_algorithm"] == "EAGLE":
        spec["speculative_draft_model_path"] = request.getfixturevalue("tiny_llama_eagle_head_dir")
    args = _spec_args(path, **spec)
    eager_ids, eager_accept = _spec_greedy(args, False, SPEC_PROMPTS, SPEC_MAX_NEW, return_logprob=logprobs)
    _WorkAsGraph.replays = {}
    graph_ids, graph_accept = _spec_greedy(args, True, SPEC_PROMPTS, SPEC_MAX_NEW, return_logprob=logprobs)
    assert graph_ids == eager_ids and graph_accept == eager_accept
    assert set(_WorkAsGraph.replays) == _CYCLE_GRAPHS[logprobs]
    if case == "perfect NEXTN chain":
        assert eager_accept == 4.0


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("logprobs", [False, True], ids=["greedy", "logprobs"])
def test_captured_work_matches_eager_plain_decode(tiny_llama_dir, logprobs):
    """Plain decode: a greedy batch replays the graph of its forward and argmax (greedy_decode),
    one that reads its logits (logprobs) the logits graph; the tokens are eager's."""
    args = _spec_args(tiny_llama_dir)
    eager_ids, _ = _spec_greedy(args, False, SPEC_PROMPTS, SPEC_MAX_NEW, return_logprob=logprobs)
    _WorkAsGraph.keys = set()
    graph_ids, _ = _spec_greedy(args, True, SPEC_PROMPTS, SPEC_MAX_NEW, return_logprob=logprobs)
    assert graph_ids == eager_ids
    programs = {key.program for key, _ in _WorkAsGraph.keys if key.mode == ForwardMode.DECODE}
    assert programs == ({None} if logprobs else {greedy_decode})


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_captured_work_matches_eager_adaptive(partial_deepseek_v3_dir):
    """--speculative-adaptive with tiers forced to change every few cycles (1, 3 and 5 steps, a
    draft that agrees with the target on part of the tokens): each tier's cycles go through
    its own graphs (their group is the tier), with the eager tokens and accept length; the
    graphs hold no other tier's programs."""
    path = partial_deepseek_v3_dir
    spec = dict(
        speculative_algorithm="NEXTN",
        speculative_adaptive=True,
        speculative_adaptive_steps="1,3,5",
        speculative_num_steps=3,
        speculative_adaptive_schedule="3:2,1:2,5:2",
    )
    args = _spec_args(path, **spec)
    eager_ids, eager_accept = _spec_greedy(args, False, SPEC_PROMPTS, SPEC_MAX_NEW)
    _WorkAsGraph.replays, _WorkAsGraph.keys = {}, set()
    graph_ids, graph_accept = _spec_greedy(args, True, SPEC_PROMPTS, SPEC_MAX_NEW)
    assert graph_ids == eager_ids and graph_accept == eager_accept
    assert {(k.mode, group, k.tokens_per_req) for k, group in _WorkAsGraph.keys} == {
        (ForwardMode.DECODE_CYCLE, steps, steps + 1) for steps in (1, 3, 5)
    }


def _dp_spec_worker(rank: int, args: ServerArgs, port_args, results) -> None:
    patch_interpreter_for_numpy2()  # a spawned rank: no conftest ran here
    torch.set_num_threads(1)
    # DP rank 0 decodes three requests; DP rank 1 one short request, then idles through the
    # other rank's cycles: rank 0 replays each cycle as one graph while rank 1 replays the
    # padded graphs of the draft loop, the verify and the draft extend (the same collectives).
    prompts, max_new = (SPEC_PROMPTS, SPEC_MAX_NEW) if rank == 0 else ([[30, 31, 32, 33]], [3])
    ids, accept = _spec_greedy(args, True, prompts, max_new, tp_rank=rank, port_args=port_args)
    results[rank] = (ids, accept, sorted(m.name for m in _WorkAsGraph.replays))


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_captured_work_matches_eager_spec_dp_attention(perfect_deepseek_v3_dir):
    """NEXTN under --tp 2 --dp 2 --enable-dp-attention with every cycle going through the
    graphs' captured work (the key from the plan; a busy rank's whole-cycle graph against an
    idle rank's sub-forward graphs): the single-rank eager tokens, and accept length 4.0 on
    both DP ranks."""
    import torch.multiprocessing as mp

    from sglang.srt.server_args import PortArgs

    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    single, _ = _spec_greedy(
        _spec_args(perfect_deepseek_v3_dir, **spec), False, SPEC_PROMPTS + [[30, 31, 32, 33]], SPEC_MAX_NEW + [3]
    )
    args = _spec_args(perfect_deepseek_v3_dir, tp_size=2, dp_size=2, enable_dp_attention=True, **spec)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_dp_spec_worker, args=(args, PortArgs.init_new(args), results), nprocs=2)
    assert results[0][0] == single[:3] and results[1][0] == single[3:]
    assert results[0][1] == results[1][1] == 4.0
    assert results[0][2] == ["DECODE_CYCLE"]
    assert results[1][2] == ["DECODE_CYCLE", "DRAFT_DECODE", "DRAFT_EXTEND", "TARGET_VERIFY"]


def _dp_adaptive_worker(rank: int, args: ServerArgs, port_args, results) -> None:
    patch_interpreter_for_numpy2()  # a spawned rank: no conftest ran here
    torch.set_num_threads(1)
    # As _dp_spec_worker: rank 1's one request ends early, then it idles through rank 0's cycles.
    prompts, max_new = (SPEC_PROMPTS, [16, 4, 7]) if rank == 0 else ([[30, 31, 32, 33]], [3])
    _WorkAsGraph.keys = set()
    ids, _ = _spec_greedy(args, True, prompts, max_new, tp_rank=rank, port_args=port_args)
    results[rank] = (ids, {(k.mode.name, group) for k, group in _WorkAsGraph.keys})


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_captured_work_matches_eager_adaptive_dp_attention(partial_deepseek_v3_dir):
    """--speculative-adaptive under --tp 2 --dp 2 --enable-dp-attention, a tier change every
    cycle: the busy rank replays each tier's whole-cycle graph and the idle rank the same
    tier's sub-forward graphs (the tier is part of the key chosen from the plan), with the
    single-rank tokens."""
    import torch.multiprocessing as mp

    from sglang.srt.server_args import PortArgs

    path = partial_deepseek_v3_dir
    single, _ = _spec_greedy(_spec_args(path), False, SPEC_PROMPTS + [[30, 31, 32, 33]], [16, 4, 7, 3])
    args = _spec_args(
        path,
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        speculative_algorithm="NEXTN",
        speculative_adaptive=True,
        speculative_adaptive_steps="1,3,5",
        speculative_num_steps=3,
        speculative_adaptive_schedule="3:1,1:1,5:1",
    )
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_dp_adaptive_worker, args=(args, PortArgs.init_new(args), results), nprocs=2)
    assert results[0][0] == single[:3] and results[1][0] == single[3:]
    assert results[0][1] == {("DECODE_CYCLE", steps) for steps in (1, 3, 5)}
    assert results[1][1] >= {(mode, steps) for mode in ("TARGET_VERIFY", "DRAFT_EXTEND") for steps in (1, 3, 5)}
    assert {steps for mode, steps in results[1][1] if mode == "DRAFT_DECODE"} == {3, 5}  # 1 step: no draft loop
