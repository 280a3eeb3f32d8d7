"""Collectives among the processes of one node through IPC buffers, and the choices around
them: which GPU each rank gets, when the IPC path runs instead of NCCL, the buffers' sizes.

On CPU the buffers are shared-memory files and the kernels run under Triton's interpreter in
each process, so the flag protocol runs between real concurrent processes; on the GPU the
same protocol runs over CUDA IPC (benchmark/gpu/validate.sh, stage shared-gpu).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sglang.srt.distributed.ipc_collectives import IpcCommunicator, MessageTooLarge
from sglang.srt.distributed.parallel_state import use_ipc
from sglang.srt.managers.data_parallel_controller import scheduler_ranks_on_node
from sglang.srt.model_executor.model_runner import ipc_slot_bytes
from sglang.srt.server_args import ServerArgs
from sglang.test.dist_utils import spawn_gloo

pytest.importorskip("triton")


def _args(**kw) -> ServerArgs:
    return ServerArgs(model_path="m", **kw)


# ---------------------------------------------------------------------- placement
def test_rank_r_uses_gpu_base_plus_r_times_step():
    dp_attn = dict(device="cuda", tp_size=4, dp_size=2, enable_dp_attention=True)
    assert [g for g, _, _ in scheduler_ranks_on_node(_args(**dp_attn))] == [0, 1, 2, 3]
    assert [g for g, _, _ in scheduler_ranks_on_node(_args(**dp_attn, base_gpu_id=2, gpu_id_step=2))] == [2, 4, 6, 8]
    assert [g for g, _, _ in scheduler_ranks_on_node(_args(**dp_attn, gpu_id_step=0))] == [0, 0, 0, 0]
    assert [g for g, _, _ in scheduler_ranks_on_node(_args(**dp_attn, base_gpu_id=3, gpu_id_step=0))] == [3, 3, 3, 3]
    # Replicas without DP attention: the node's i-th process, replica-major.
    replicas = scheduler_ranks_on_node(_args(device="cuda", tp_size=2, dp_size=2, base_gpu_id=1))
    assert replicas == [(1, 0, 0), (2, 1, 0), (3, 0, 1), (4, 1, 1)]


def test_ranks_share_gpu_only_with_step_zero_on_cuda():
    assert _args(device="cuda", tp_size=2, gpu_id_step=0).ranks_share_gpu
    assert not _args(device="cuda", tp_size=2).ranks_share_gpu
    assert not _args(device="cuda", tp_size=1, dp_size=2, gpu_id_step=0).ranks_share_gpu  # replicas: no collectives
    assert not _args(device="cpu", tp_size=2, gpu_id_step=0).ranks_share_gpu


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(base_gpu_id=-1), "--base-gpu-id"),
        (dict(gpu_id_step=-1), "--gpu-id-step"),
        (dict(device="cuda", tp_size=2, gpu_id_step=0, disable_custom_all_reduce=True), "--disable-custom-all-reduce"),
        (dict(device="cuda", tp_size=4, gpu_id_step=0, nnodes=2, dist_init_addr="h:1"), "--nnodes"),
        (dict(custom_collective_buffer_mb=0), "--custom-collective-buffer-mb"),
    ],
)
def test_placement_flags_are_checked(kw, flag):
    with pytest.raises(ValueError, match=flag):
        _args(**kw)


# ---------------------------------------------------------------------- IPC or NCCL
def test_ipc_path_when_the_message_fits_nccl_otherwise():
    assert use_ipc(1000, 1024, ipc_only=False)
    assert not use_ipc(2000, 1024, ipc_only=False)  # NCCL takes it
    assert not use_ipc(10, None, ipc_only=False)  # no buffers (--disable-custom-all-reduce, several nodes)
    assert use_ipc(1000, 1024, ipc_only=True)
    with pytest.raises(MessageTooLarge, match="--custom-collective-buffer-mb"):
        use_ipc(2000, 1024, ipc_only=True)  # ranks sharing a GPU have no NCCL to fall back to
    with pytest.raises(RuntimeError, match="not initialized"):
        use_ipc(10, None, ipc_only=True)


def test_slot_sizes_cover_the_largest_message():
    shared = dict(device="cuda", tp_size=4, dp_size=2, enable_dp_attention=True, gpu_id_step=0)
    tp, attn = ipc_slot_bytes(_args(**shared), local_rows=100, hidden=64, vocab=1000, itemsize=4)
    assert tp == 100 * 2 * 64 * 4  # the MLP's all-reduce over both DP ranks' rows
    assert attn == 100 * 500 * 4  # logits sharded over attention-TP 2
    # Separate GPUs: capped, NCCL takes larger messages; an explicit size wins.
    tp, _ = ipc_slot_bytes(_args(device="cuda", tp_size=2), local_rows=1 << 20, hidden=8192, vocab=10, itemsize=2)
    assert tp == 64 << 20
    assert ipc_slot_bytes(_args(device="cuda", tp_size=2, custom_collective_buffer_mb=1), 10, 8, 8, 2) == (1 << 20,) * 2


def test_too_small_buffer_for_shared_gpu_is_a_startup_error():
    args = _args(device="cuda", tp_size=2, gpu_id_step=0, custom_collective_buffer_mb=0.5)
    with pytest.raises(ValueError, match="--custom-collective-buffer-mb 0.5 is too small"):
        ipc_slot_bytes(args, local_rows=8192, hidden=64, vocab=256, itemsize=4)


# ---------------------------------------------------------------------- the protocol, between processes
def _collectives(rank: int, world: int, results) -> None:
    comm = IpcCommunicator(rank, world, slot_bytes=16384, device=torch.device("cpu"), cpu_group=dist.group.WORLD)
    got = []
    for i, (n, dtype) in enumerate(
        [(1000, torch.float32), (7, torch.float16), (1, torch.float32), (0, torch.float32), (2500, torch.float32)]
    ):
        x = (torch.arange(n, dtype=torch.float32) * (rank + 1) + i).to(dtype)
        comm.all_reduce(x)
        expected = sum((torch.arange(n, dtype=torch.float32) * (r + 1) + i) for r in range(world)).to(dtype)
        got.append(torch.equal(x, expected))
        part = torch.full((3, 2), float(10 * rank + i))
        gathered = comm.all_gather(part, dim=-1)
        got.append(torch.equal(gathered, torch.cat([torch.full((3, 2), float(10 * r + i)) for r in range(world)], dim=-1)))
    with pytest.raises(MessageTooLarge):  # raised before any launch, on every rank alike
        comm.all_reduce(torch.zeros(4097))
    comm.all_reduce(torch.ones(4))  # still in step after the refusal
    dist.barrier()
    results.put((rank, got, int(comm.counter.item())))


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_and_all_gather_between_processes(world, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned processes' triton
    results = mp.get_context("spawn").Queue()
    spawn_gloo(_collectives, world, results)
    rows = sorted(results.get(timeout=60) for _ in range(world))
    for rank, got, counter in rows:
        assert all(got), (rank, got)
        assert counter == 9 + 1  # 5 all-reduces (one of 0 elements: skipped) + 5 all-gathers + 1


# ---------------------------------------------------------------------- layers built before the buffers
def _layers_use_ipc(rank: int, world: int, results) -> None:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.linear import RowParallelLinear

    ps.initialize_model_parallel(world, rank)
    torch.manual_seed(rank)
    layer = RowParallelLinear(8 * world, 6)  # built first, as the model runner does
    layer.weight.data.normal_()  # torch.empty's memory may hold NaN
    if layer.bias is not None:
        layer.bias.data.normal_()
    x = torch.randn(5, 8)
    by_gloo = layer(x)
    ps.init_ipc_collectives(tp_slot_bytes=1024, attn_tp_slot_bytes=1024, device=torch.device("cpu"))
    by_ipc = layer(x)
    gathered = ps.get_tp().all_gather(torch.full((2, 1), float(rank)), dim=-1)
    results.put(
        (
            rank,
            layer.group.ipc is not None,
            torch.allclose(by_gloo, by_ipc),
            int(layer.group.ipc.counter.item()),
            gathered.tolist(),
        )
    )


def test_layers_built_before_the_buffers_use_them(monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = mp.get_context("spawn").Queue()
    spawn_gloo(_layers_use_ipc, 2, results)
    for rank, has_ipc, same, counter, gathered in sorted(results.get(timeout=60) for _ in range(2)):
        assert has_ipc and same and counter == 2, (rank, has_ipc, same, counter)
        assert gathered == [[0.0, 1.0], [0.0, 1.0]]


def test_ranks_per_gpu_splits_the_memory_fraction():
    assert _args(device="cuda", tp_size=4, dp_size=2, enable_dp_attention=True, gpu_id_step=0).ranks_per_gpu == 4
    assert _args(device="cuda", tp_size=2, dp_size=2, gpu_id_step=0).ranks_per_gpu == 4  # replicas share it too
    assert _args(device="cuda", tp_size=4).ranks_per_gpu == 1
    assert _args(device="cpu", tp_size=4, gpu_id_step=0).ranks_per_gpu == 1
