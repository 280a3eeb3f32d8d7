"""--enable-mixed-chunk: running requests take their decode step inside a prefill's forward
(each extends by its newest token), so they keep producing tokens while new prompts are
prefilled, and nothing a user sees changes (in-process scheduler, tiny random models, CPU,
float32; outputs compared with the same requests run without mixing)."""

from __future__ import annotations

from typing import Optional

import pytest

from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.inprocess_scheduler import start_scheduler

# (arrival iteration, prompt, max new tokens): later prompts arrive while earlier ones decode;
# the long one is prefilled in chunks when chunking is small.
ARRIVALS = [
    (0, [5, 17, 42, 99, 7], 12),
    (0, [8, 9, 10], 10),
    (3, list(range(100, 130)), 6),
    (4, [100, 101, 102, 103], 8),
    (6, [5, 17, 42, 60, 61, 62], 7),  # shares a cached prefix with the first prompt
    (9, list(range(200, 223)), 5),
]


def _scheduler(path: str, mixed: bool, overlap: bool = True, **kw) -> Scheduler:
    kw = {"max_total_tokens": 1024, "disable_overlap_schedule": not overlap, **kw}
    args = ServerArgs(model_path=path, device="cpu", dtype="float32", enable_mixed_chunk=mixed, **kw)
    return start_scheduler(args)


def _run(
    scheduler: Scheduler, logprobs: bool = False, aborts: Optional[dict[str, int]] = None
) -> tuple[dict[str, list[int]], list[int], dict[str, list[float]]]:
    """Final output ids per request, the mixed decode rows of every extend batch launched, and
    the prompt logprobs per request (with `logprobs`: from position 0); aborts[rid]: the
    iteration at which rid is aborted."""
    mixed_rows: list[int] = []
    launch = scheduler.worker.launch

    def traced(batch, *args):
        if batch.mode.name == "EXTEND":
            mixed_rows.append(batch.mixed_decode_rows)
        return launch(batch, *args)

    scheduler.worker.launch = traced
    finished = scheduler.send_to_detokenizer.finished
    reqs = {}
    for it in range(2000):
        for i, (at, prompt, n) in enumerate(ARRIVALS):
            if it == at:
                params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                start = 0 if logprobs else -1
                scheduler.handle_message(
                    TokenizedGenerateReqInput(f"r{i}", None, prompt, params, return_logprob=logprobs, logprob_start_len=start)
                )
                reqs[f"r{i}"] = next(r for r in scheduler.waiting if r.rid == f"r{i}")
        for rid, at in (aborts or {}).items():
            if it == at:
                scheduler.handle_message(AbortReq(rid))
        scheduler.run_iteration()
        if len(finished) == len(ARRIVALS) and not (scheduler.running or scheduler.waiting or scheduler.in_flight):
            prompt_logprobs = {rid: [round(lp, 5) for lp, _ in r.input_token_logprobs] for rid, r in reqs.items()}
            return dict(finished), mixed_rows, prompt_logprobs
    raise AssertionError("requests did not finish")


def _assert_all_kv_free(scheduler: Scheduler) -> None:
    assert scheduler.free_kv_tokens() == scheduler.allocator.size
    assert scheduler.req_to_token_pool.available_size() == scheduler.max_running_requests


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("chunked_prefill_size", [None, 8], ids=["whole", "chunked"])
def test_mixed_outputs_equal_unmixed(tiny_llama_dir, overlap, chunked_prefill_size):
    kw = {} if chunked_prefill_size is None else {"chunked_prefill_size": chunked_prefill_size}
    expected, unmixed_batches, _ = _run(_scheduler(tiny_llama_dir, mixed=False, overlap=overlap, **kw))
    assert not any(unmixed_batches)
    scheduler = _scheduler(tiny_llama_dir, mixed=True, overlap=overlap, **kw)
    got, batches, _ = _run(scheduler)
    assert got == expected
    assert [len(got[f"r{i}"]) for i in range(len(ARRIVALS))] == [n for _, _, n in ARRIVALS]
    assert sum(m > 0 for m in batches) >= 3, batches  # prefills did carry running requests
    _assert_all_kv_free(scheduler)


def test_running_requests_emit_tokens_in_every_prefill_iteration(tiny_llama_dir):
    """Prompts prefilled in chunks while others run: with mixing every prefill carries the
    running requests' decode step; without it, each such prefill leaves them without a token
    (the stalled-iteration metric shows it)."""
    stalled, prefills_beside_running = {}, {}
    for mixed in (False, True):
        scheduler = _scheduler(tiny_llama_dir, mixed=mixed, chunked_prefill_size=8)
        launch = scheduler.worker.launch
        beside: list[tuple[int, int]] = []

        def traced(batch, scheduler=scheduler, launch=launch, beside=beside):
            if batch.mode.name == "EXTEND" and scheduler.running:
                beside.append((len(scheduler.running), batch.mixed_decode_rows))
            return launch(batch)

        scheduler.worker.launch = traced
        _run(scheduler)
        stalled[mixed] = scheduler.balance.internal_state()["stalled_iteration_fraction"]
        prefills_beside_running[mixed] = beside
    assert len(prefills_beside_running[False]) >= 5 and not any(m for _, m in prefills_beside_running[False])
    # Every such prefill carries running requests (all but those whose step in flight may be
    # their last by length, which wait for it as they would in a decode batch).
    assert prefills_beside_running[True] and all(m >= 1 for _, m in prefills_beside_running[True])
    assert sum(m for _, m in prefills_beside_running[True]) >= 0.8 * sum(n for n, _ in prefills_beside_running[True])
    assert stalled[True] < stalled[False] / 4, stalled


def test_prompt_logprobs_of_a_mixed_prefill_equal_unmixed(tiny_llama_dir):
    _, _, expected = _run(_scheduler(tiny_llama_dir, mixed=False, chunked_prefill_size=8), logprobs=True)
    _, batches, got = _run(_scheduler(tiny_llama_dir, mixed=True, chunked_prefill_size=8), logprobs=True)
    assert any(batches)
    assert got == expected
    assert all(len(v) == len(ARRIVALS[int(rid[1:])][1]) - 1 for rid, v in got.items())


def test_mixed_outputs_equal_unmixed_on_deepseek(tiny_deepseek_v3_dir):
    """MLA attention over a running request's cached prefix, MoE over the mixed rows."""
    kw = {"chunked_prefill_size": 8}
    expected, _, _ = _run(_scheduler(tiny_deepseek_v3_dir, mixed=False, **kw))
    scheduler = _scheduler(tiny_deepseek_v3_dir, mixed=True, **kw)
    got, batches, _ = _run(scheduler)
    assert got == expected
    assert any(batches)
    _assert_all_kv_free(scheduler)


def test_no_mixing_when_running_rows_would_take_most_of_the_chunk(tiny_llama_dir):
    """Chunks of one token: a running request's row would take the whole chunk, so every
    prefill runs alone."""
    got, batches, _ = _run(_scheduler(tiny_llama_dir, mixed=True, chunked_prefill_size=1))
    assert batches and not any(batches)
    assert [len(got[f"r{i}"]) for i in range(len(ARRIVALS))] == [n for _, _, n in ARRIVALS]


def _spec_run(
    path: str, spec: dict, mixed: bool, logprobs: bool = False, aborts: Optional[dict[str, int]] = None, **kw
) -> tuple[dict[str, list[int]], list[tuple[int, int]], Scheduler, dict[str, list[float]]]:
    """ARRIVALS through a speculative scheduler: final output ids, per prefill launched while
    requests ran (running requests, requests whose cycle rode along), the scheduler, and the
    prompt logprobs (with `logprobs`)."""
    scheduler = _scheduler(path, mixed=mixed, **spec, **kw)
    launch = scheduler.worker.launch
    beside: list[tuple[int, int]] = []

    def traced(batch, *args):
        if batch.mode.name == "EXTEND" and scheduler.running:
            alongside = batch.alongside_decode
            beside.append((len(scheduler.running), len(alongside.reqs) if alongside else 0))
        return launch(batch, *args)

    scheduler.worker.launch = traced
    got, _, prompt_logprobs = _run(scheduler, logprobs, aborts)
    return got, beside, scheduler, prompt_logprobs


NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
EAGLE_1_1_2 = dict(
    speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2
)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("chunked_prefill_size", [None, 8], ids=["whole", "chunked"])
def test_speculative_cycles_beside_prefills_equal_unmixed(tiny_deepseek_v3_dir, overlap, chunked_prefill_size):
    """NEXTN 3/1/4: with mixing, every prefill launched while requests run queues their decode
    cycle in the same iteration; tokens equal unmixed scheduling and the stalled-iteration
    fraction drops."""
    kw = {"disable_overlap_schedule": not overlap}
    if chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = chunked_prefill_size
    expected, unmixed, plain, _ = _spec_run(tiny_deepseek_v3_dir, NEXTN, mixed=False, **kw)
    assert len(unmixed) >= 3 and not any(n for _, n in unmixed)
    got, beside, scheduler, _ = _spec_run(tiny_deepseek_v3_dir, NEXTN, mixed=True, **kw)
    assert got == expected
    assert [len(got[f"r{i}"]) for i in range(len(ARRIVALS))] == [n for _, _, n in ARRIVALS]
    assert beside and all(n >= 1 for _, n in beside), beside
    # All but the requests whose cycle in flight may be their last (by length) ride along.
    assert sum(n for _, n in beside) >= 0.7 * sum(r for r, _ in beside), beside
    assert scheduler.mixed_prefill_batches == len(beside)
    stalled = [s.balance.internal_state()["stalled_iteration_fraction"] for s in (plain, scheduler)]
    assert stalled[1] < stalled[0], stalled
    _assert_all_kv_free(scheduler)


def test_adaptive_cycles_beside_prefills_equal_unmixed(tiny_deepseek_v3_dir):
    """--speculative-adaptive with tiers forced to change (1 and 3 steps): cycles of either tier
    ride along with prefills, chunked ones included."""
    spec = dict(NEXTN, speculative_adaptive=True, speculative_adaptive_steps="1,3", speculative_adaptive_schedule="3:2,1:3")
    expected, _, _, _ = _spec_run(tiny_deepseek_v3_dir, spec, mixed=False, chunked_prefill_size=8)
    got, beside, scheduler, _ = _spec_run(tiny_deepseek_v3_dir, spec, mixed=True, chunked_prefill_size=8)
    assert got == expected
    assert beside and all(n >= 1 for _, n in beside)
    _assert_all_kv_free(scheduler)


def test_prompt_logprobs_and_sub_forward_cycles_beside_prefills(tiny_deepseek_v3_dir):
    """Logprobs make each cycle run sub-forward by sub-forward (the host accepts between verify
    and draft extend) beside a prefill computing prompt logprobs: both equal unmixed."""
    expected, _, _, expected_logprobs = _spec_run(tiny_deepseek_v3_dir, NEXTN, mixed=False, logprobs=True, chunked_prefill_size=8)
    got, beside, scheduler, logprobs = _spec_run(tiny_deepseek_v3_dir, NEXTN, mixed=True, logprobs=True, chunked_prefill_size=8)
    assert got == expected and beside
    assert logprobs == expected_logprobs
    _assert_all_kv_free(scheduler)


def test_abort_while_a_cycle_runs_beside_a_prefill(tiny_deepseek_v3_dir):
    """r0 is aborted in the iteration r2's chunked prompt starts (its cycle beside that prefill,
    in flight): it ends with a prefix of its tokens, the others are unchanged, no KV leaks."""
    expected, _, _, _ = _spec_run(tiny_deepseek_v3_dir, NEXTN, mixed=False, chunked_prefill_size=8)
    got, beside, scheduler, _ = _spec_run(tiny_deepseek_v3_dir, NEXTN, mixed=True, aborts={"r0": 4}, chunked_prefill_size=8)
    assert beside
    assert got["r0"] == expected["r0"][: len(got["r0"])] and len(got["r0"]) < len(expected["r0"])
    assert {rid: ids for rid, ids in got.items() if rid != "r0"} == {rid: ids for rid, ids in expected.items() if rid != "r0"}
    _assert_all_kv_free(scheduler)


def test_eagle_cycles_beside_prefills_equal_unmixed(tiny_llama_dir, tiny_llama_eagle_head_dir):
    spec = {**EAGLE_1_1_2, "speculative_draft_model_path": tiny_llama_eagle_head_dir}
    expected, _, _, _ = _spec_run(tiny_llama_dir, spec, mixed=False, chunked_prefill_size=8)
    got, beside, scheduler, _ = _spec_run(tiny_llama_dir, spec, mixed=True, chunked_prefill_size=8)
    assert got == expected
    assert beside and all(n >= 1 for _, n in beside)
    _assert_all_kv_free(scheduler)


@pytest.mark.timeout(300)
def test_mixed_under_dp_attention_equals_single_rank(tiny_llama_dir):
    """tp 2, dp 2 with DP attention (gloo): a rank whose prefill carries its running requests
    runs an extend forward while the other may decode or idle; tokens equal one plain rank's."""
    import sglang as sgl

    prompts = [prompt for _, prompt, _ in ARRIVALS]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for _, _, n in ARRIVALS]
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu") as engine:
        reference = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    args = dict(tp_size=2, dp_size=2, enable_dp_attention=True, debug_collectives=True, chunked_prefill_size=8)
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu", enable_mixed_chunk=True, **args) as engine:
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == reference
        states = engine.get_server_info()["internal_states"]
    assert sum(s["mixed_prefill_batches"] for s in states) >= 1, states
    assert all(s["available_kv_tokens"] == s["max_total_num_tokens"] for s in states)
