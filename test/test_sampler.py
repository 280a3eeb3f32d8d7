import torch

from sglang.srt.sampling.sampler import Sampler, SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams


def _info(params, histories=None, vocab=8, generators=None):
    histories = histories or [([0], [])] * len(params)
    generators = generators or [None] * len(params)
    return SamplingBatchInfo.from_requests(params, histories, generators, vocab, "cpu")


def test_greedy_and_mixed_batch():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [5.0, 0.0, 0.0, 4.9]])
    info = _info([SamplingParams(temperature=0), SamplingParams(temperature=0)], vocab=4)
    assert Sampler()(logits, info).next_token_ids.tolist() == [1, 0]
    info = _info([SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)], vocab=4)
    assert Sampler()(logits, info).next_token_ids.tolist() == [1, 0]


def test_top_k_top_p_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    for params, allowed in [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),
        (SamplingParams(min_p=0.5), {0, 1}),
    ]:
        info = _info([params] * 400, vocab=4)
        drawn = set(Sampler()(logits, info).next_token_ids.tolist())
        assert drawn == allowed, (params, drawn)


def test_sampling_follows_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).repeat(20000, 1)
    ids = Sampler()(logits, _info([SamplingParams()] * 20000, vocab=4)).next_token_ids
    freq = torch.bincount(ids, minlength=4).float() / ids.numel()
    assert torch.allclose(freq, probs, atol=0.02)


def test_seeded_rows_are_reproducible():
    logits = torch.randn(3, 50)

    def draw():
        gens = [torch.Generator().manual_seed(7) for _ in range(3)]
        return Sampler()(logits, _info([SamplingParams()] * 3, vocab=50, generators=gens)).next_token_ids

    assert torch.equal(draw(), draw())


def test_penalties_push_away_repeated_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    hist = [([2], [0, 0])]
    out = Sampler()(logits, _info([SamplingParams(temperature=0, frequency_penalty=1.0)], hist, vocab=3))
    assert out.next_token_ids.item() == 1
    out = Sampler()(logits, _info([SamplingParams(temperature=0, repetition_penalty=1.1)], hist, vocab=3))
    assert out.next_token_ids.item() == 1


def test_a_tiny_repetition_penalty_keeps_the_row_finite():
    """1e-237 is 0 in float32: a seen token's positive logit divided by it is bounded, so
    sampling (min-p, a small temperature) and logprobs stay finite; the seen token wins."""
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    hist = [([2], [3])]  # the prompt's token and the output's count as seen
    for temperature in (1.0, 2e-6):
        params = SamplingParams(temperature=temperature, min_p=1.0, repetition_penalty=1.3245653806158722e-237)
        out = Sampler()(logits, _info([params], hist, vocab=4), return_logprob=True, top_logprobs_num=2)
        assert out.next_token_ids.tolist() == [3]
        assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs[0]).all()


def test_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = Sampler()(logits, _info([SamplingParams(temperature=0)], vocab=3), return_logprob=True, top_logprobs_num=2)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref[:, 2])
    assert out.top_logprobs[1].tolist() == [[2, 1]]


def test_the_same_requests_reuse_their_sampling_parameters(tiny_llama_dir):
    """Decode step after step samples the same requests: their parameters are built once
    (unless penalties, which read the tokens so far); another batch builds its own."""
    from sglang.srt.batch.schedule_batch import Req
    from sglang.srt.server_args import ServerArgs
    from sglang.test.inprocess_scheduler import start_scheduler

    args = ServerArgs(model_path=tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=256)
    worker = start_scheduler(args).worker
    reqs = [Req("a", [1], SamplingParams(temperature=0.5, top_p=0.9)), Req("b", [2], SamplingParams(temperature=0))]
    first = worker.sampling_of(reqs, 64)
    assert first[0].temperatures.view(-1).tolist() == [0.5, 1.0] and first[1:] == (False, 0)
    assert worker.sampling_of(list(reqs), 64) is first
    assert worker.sampling_of(reqs[:1], 64) is not first
    assert worker.sampling_of(reqs, 128) is not worker.sampling_of(reqs, 64)
    logprobs = [Req("c", [3], SamplingParams(), return_logprob=True, top_logprobs_num=2)]
    assert worker.sampling_of(logprobs, 64)[1:] == (True, 2)
    penalized = [Req("d", [4], SamplingParams(frequency_penalty=0.5), output_ids=[3])]
    again = worker.sampling_of(penalized, 64)
    assert worker.sampling_of(penalized, 64) is not again and again[0].output_counts[0, 3] == 1
