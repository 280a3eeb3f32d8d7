"""Host<->device crossings per decode iteration, counted on CPU (on a GPU each read stalls the
host until the GPU is done, and so does each upload from pageable memory)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.batch.forward_batch_info import ForwardMode
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.inprocess_scheduler import start_scheduler
from sglang.test.sync_counter import SyncCounter

STEPS = 4


def test_counter_sees_reads_uploads_and_transfers():
    t = torch.arange(4)
    with SyncCounter() as c:
        t.tolist(), t[0].item(), int(t[1]), bool(t[2]), t.cpu()  # reads
        torch.tensor([1, 2], device="cpu"), t[[0, 1]]  # uploads
        t.to("cpu")  # a transfer
        torch.tensor([1, 2]), t + 1, t[1:]  # host data and device work: not counted
    assert (c.reads, c.uploads, c.transfers) == (5, 2, 1)


def _decode_crossings(scheduler: Scheduler, batch_size: int) -> SyncCounter:
    """Crossings of STEPS decode iterations of batch_size requests (none finishing meanwhile)."""
    for i in range(batch_size):
        params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(f"r{i}", None, [5 + i, 17, 42, 99, 7], params))
    while scheduler.waiting or scheduler.chunked_req:
        scheduler.run_iteration()
    for _ in range(2):  # overlap scheduling: the prefill's tokens arrive, the first decode is queued
        scheduler.run_iteration()
    counter = SyncCounter(trace=True)
    with counter:
        for _ in range(STEPS):
            scheduler.run_iteration()
    assert len(scheduler.running) == batch_size
    return counter


def _args(path: str, **spec) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=8, **spec)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_plain_decode_iteration_reads_the_device_once(tiny_llama_dir, batch_size):
    """One read (the sampled ids) and, whatever the batch size, one upload: the batch with its
    new KV slots and their request->token table entries."""
    c = _decode_crossings(start_scheduler(_args(tiny_llama_dir)), batch_size)
    assert c.reads == STEPS, c.sites
    assert c.uploads + c.transfers == STEPS, c.sites


def _eagle(head_dir: str, topk: int) -> dict:
    """EAGLE with 3 steps and 4 draft tokens (a chain at topk 1, a tree above)."""
    return dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head_dir,
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=4,
    )


def _reads_outside_reference_attention(c: SyncCounter) -> int:
    """Under overlap a speculative cycle is queued with upper bounds of its KV lengths on the
    host; the plain-PyTorch reference backend (CPU) then reads the exact ones, the Triton
    backend (GPU) never does."""
    return sum(n for site, n in c.sites.items() if site.startswith("read") and "torch_native_backend" not in site)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_speculative_decode_cycle_reads_the_device_once(tiny_llama_dir, tiny_llama_eagle_head_dir, batch_size, overlap):
    """Reads: one tensor of accept lengths, kept nodes and emitted tokens, after the cycle's
    last forward (one wait on a GPU; with overlap scheduling, after the next cycle is queued).
    Uploads, whatever the batch size: the table rows, the draft loop's scratch and the
    verify's slots into the table; and the allocator's host copies of the slots it frees."""
    args = _args(tiny_llama_dir, disable_overlap_schedule=not overlap, **_eagle(tiny_llama_eagle_head_dir, topk=2))
    c = _decode_crossings(start_scheduler(args), batch_size)
    assert _reads_outside_reference_attention(c) == STEPS, c.sites
    assert c.reads == STEPS or overlap, c.sites
    assert c.uploads + c.transfers <= 5 * STEPS, c.sites


def test_speculative_prefill_is_queued_without_reading_the_device(tiny_llama_dir, tiny_llama_eagle_head_dir):
    """The target's prefill, its sampling and the draft's extend are queued without a read: the
    sampled tokens reach the draft's input on the device, and the host in the next iteration
    (overlap scheduling), which reads them once."""
    scheduler = start_scheduler(_args(tiny_llama_dir, **_eagle(tiny_llama_eagle_head_dir, topk=1)))
    for i in range(3):
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(f"r{i}", None, [5 + i, 17, 42, 99, 7], params))
    with SyncCounter(trace=True) as launching:
        scheduler.run_iteration()
    assert scheduler.in_flight is not None and scheduler.in_flight[0].mode == ForwardMode.EXTEND
    assert _reads_outside_reference_attention(launching) == 0, launching.sites
    with SyncCounter(trace=True) as resolving:
        scheduler.run_iteration()
    assert _reads_outside_reference_attention(resolving) == 1, resolving.sites
    assert all(len(r.output_ids) == 1 for r in scheduler.running)


def test_a_request_ending_while_a_step_is_in_flight_is_released_without_waiting(tiny_llama_dir):
    """With overlap scheduling the next step is queued when a request ends: reading its table
    row back at once would wait for that step (on a GPU). The read is queued instead and
    completed in the next iteration, after that step is resolved: only then do its slots and
    row return."""
    scheduler = start_scheduler(_args(tiny_llama_dir))
    for i, n in enumerate((3, 12)):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(f"r{i}", None, [5 + i, 17, 42, 99, 7], params))
    free_rows = scheduler.req_to_token_pool.available_size()
    finished = scheduler.send_to_detokenizer.finished
    while "r0" not in finished:
        with SyncCounter(trace=True) as c:
            scheduler.run_iteration()
    assert scheduler.in_flight is not None and scheduler.kv.pending_reads, "r0 ended with the next step queued"
    assert not [site for site in c.sites if site.split(" @ ")[1].startswith("srt/batch/req_kv.py")], c.sites
    rows_while_pending = scheduler.req_to_token_pool.available_size()
    scheduler.run_iteration()  # resolves the step in flight, then completes r0's release
    assert scheduler.req_to_token_pool.available_size() == rows_while_pending + 1 == free_rows - 1  # r1 holds one
    while "r1" not in finished or scheduler.has_work():
        scheduler.run_iteration()
    assert not scheduler.kv.pending_reads
    assert scheduler.free_kv_tokens() == scheduler.allocator.size
    assert scheduler.req_to_token_pool.available_size() == scheduler.max_running_requests
