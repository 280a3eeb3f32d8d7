"""The device-side verify tree and greedy acceptance against plain-Python references, and the
verify program's greedy outcome against the eager path's, the draft's guesses and the draft
steps' KV columns; tree sampling against the target's law with an imperfect draft, and on
rows whose children cover the whole support."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.cuda_graph_runner import PAD_KV_SLOT
from sglang.srt.sampling.sampler import Sampler, SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.draft_extend_program import DraftExtendProgram
from sglang.srt.speculative.draft_loop import DraftLoop
from sglang.srt.speculative.eagle_utils import (
    DraftTree,
    build_draft_tree,
    chain_tree,
    greedy_accept,
    greedy_accept_chain,
    sample_acceptance,
    select_step_inputs,
    verify_outcome,
    walk_tree,
)
from sglang.srt.speculative.spec_info import top_guesses
from sglang.srt.speculative.verify_program import VerifyProgram
from sglang.srt.utils.device_constants import DeviceConstants
from sglang.test.chi_square import chi_square, fits


def _random_candidates(bs: int, steps: int, topk: int, vocab: int, gen: torch.Generator):
    """Candidates as the draft loop makes them, from random draft distributions."""
    probs = torch.softmax(torch.randn(bs, vocab, generator=gen) * 3, dim=-1)
    scores, tokens = torch.topk(probs, topk, dim=-1)
    cand_scores, cand_tokens = [scores], [tokens]
    cand_parents = [torch.full((bs, topk), -1)]
    input_cand = torch.arange(topk).expand(bs, topk)
    for t in range(steps - 1):
        child_p, child_tok = torch.topk(torch.softmax(torch.randn(bs * topk, vocab, generator=gen) * 3, dim=-1), topk)
        child_scores = (scores.view(bs, topk, 1) * child_p.view(bs, topk, topk)).flatten(1)
        child_tok = child_tok.view(bs, topk * topk)
        cand_scores.append(child_scores)
        cand_tokens.append(child_tok)
        cand_parents.append(input_cand.repeat_interleave(topk, dim=1))
        scores, tokens, flat = select_step_inputs(child_scores, child_tok, topk)
        input_cand = topk + t * topk * topk + flat
    return torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1)


def _reference_tree(scores: list[float], tokens: list[int], parents: list[int], n: int):
    """Nodes: the n - 1 best candidates (stable order), renumbered in candidate order."""
    best = sorted(range(len(scores)), key=lambda c: -scores[c])[: n - 1]
    chosen = sorted(best)
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    node_parents, depths = [0], [0]
    for c in chosen:
        p = 0 if parents[c] < 0 else node_of[parents[c]]
        node_parents.append(p)
        depths.append(depths[p] + 1)
    ancestors = []
    for a in range(n):
        seen, cur = {a}, a
        while cur:
            cur = node_parents[cur]
            seen.add(cur)
        ancestors.append([c in seen for c in range(n)])
    return [tokens[c] for c in chosen], node_parents, depths, ancestors


@pytest.mark.parametrize("steps, topk, n", [(1, 1, 2), (3, 1, 4), (5, 1, 6), (3, 4, 8), (2, 2, 4), (4, 3, 7)])
def test_device_tree_and_greedy_acceptance_match_references(steps, topk, n):
    gen = torch.Generator().manual_seed(steps * 100 + topk * 10 + n)
    bs, vocab, width = 6, 12, steps + 1
    scores, tokens, parents = _random_candidates(bs, steps, topk, vocab, gen)
    tree = build_draft_tree(scores, tokens, parents, n, steps)
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    node_tokens = torch.cat([roots.view(-1, 1), tree.tokens], dim=1)
    # Target choices that often follow the tree (so that paths of every length occur).
    target = torch.randint(0, vocab, (bs, n), generator=gen)
    for b in range(bs):
        for c in range(1, n):
            if torch.rand(1, generator=gen).item() < 0.7:
                target[b, tree.parents[b, c]] = node_tokens[b, c]
    acc = greedy_accept(tree, node_tokens, target, width)
    lengths = set()
    for b in range(bs):
        ref_tokens, ref_parents, ref_depths, ref_mask = _reference_tree(
            scores[b].tolist(), tokens[b].tolist(), parents[b].tolist(), n
        )
        assert tree.tokens[b].tolist() == ref_tokens
        assert tree.parents[b].tolist() == ref_parents
        assert tree.depths[b].tolist() == ref_depths
        assert tree.mask[b].tolist() == ref_mask
        row = node_tokens[b].tolist()
        child_prob = [float(target[b, ref_parents[c]].item() == row[c]) for c in range(n)]
        residual = [1.0 - sum(child_prob[c] for c in range(1, n) if ref_parents[c] == v) for v in range(n)]
        path = walk_tree(ref_parents, child_prob, residual, [0.0] * n)
        a = len(path)
        lengths.add(a)
        assert acc.accept_len[b].item() == a
        nodes = [0] + path
        assert acc.nodes[b].tolist() == nodes + [nodes[-1]] * (width - a - 1)
        assert acc.emitted[b].tolist() == [target[b, c].item() for c in nodes] + [0] * (width - a - 1)
    assert len(lengths) > 1 or steps == 1


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_chain_tree_and_acceptance_are_the_general_ones_for_topk_1(steps):
    """topk 1 in closed form: chain_tree is what build_draft_tree keeps of a chain, and
    greedy_accept_chain accepts what greedy_accept does."""
    gen = torch.Generator().manual_seed(steps)
    tree, node_tokens = _random_tree(7, steps, 1, steps + 1, 5, gen)  # a small vocabulary: matches occur
    chain = chain_tree(tree.tokens, DeviceConstants("cpu"))
    for built, closed in zip(tree.as_tuple(), chain.as_tuple()):
        assert torch.equal(built, closed)
    lengths = set()
    for _ in range(8):
        target = torch.randint(0, 5, node_tokens.shape, generator=gen)
        want = greedy_accept(tree, node_tokens, target, steps + 1)
        got = greedy_accept_chain(node_tokens, target, steps + 1)
        for a, b in zip(want.as_tuple(), got.as_tuple()):
            assert torch.equal(a, b)
        lengths.update(got.accept_len.tolist())
    assert len(lengths) > 1


def test_acceptance_of_an_empty_batch():
    tree = build_draft_tree(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int64), torch.full((0, 3), -1), 4, 3)
    acc = greedy_accept(tree, torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64), 4)
    assert acc.accept_len.shape == (0,) and acc.nodes.shape == (0, 4) and acc.emitted.shape == (0, 4)
    chain = greedy_accept_chain(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64), 4)
    assert chain.accept_len.shape == (0,) and chain.nodes.shape == (0, 4) and chain.emitted.shape == (0, 4)


def _random_tree(bs: int, steps: int, topk: int, n: int, vocab: int, gen: torch.Generator):
    scores, tokens, parents = _random_candidates(bs, steps, topk, vocab, gen)
    tree = build_draft_tree(scores, tokens, parents, n, steps)
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    return tree, torch.cat([roots.view(-1, 1), tree.tokens], dim=1)


@pytest.mark.parametrize("steps, topk, n", [(1, 1, 2), (3, 1, 4), (3, 4, 8), (4, 3, 7)])
def test_tree_from_mask_is_the_built_tree(steps, topk, n):
    gen = torch.Generator().manual_seed(7 * steps + topk + n)
    tree, node_tokens = _random_tree(5, steps, topk, n, 12, gen)
    again = DraftTree.from_mask(node_tokens, tree.mask)
    for built, derived in zip(tree.as_tuple(), again.as_tuple()):
        assert torch.equal(built, derived)


@pytest.mark.parametrize("steps, topk, n", [(1, 1, 2), (3, 1, 4), (3, 4, 8), (4, 3, 7)])
def test_verify_program_outcome_matches_the_eager_path(steps, topk, n):
    """The greedy outcome VerifyProgram computes from the verify batch alone equals the eager
    path's (greedy_accept on the draft loop's tree, then verify_outcome); padded rows (an
    all-true mask, as StaticInputs pads them) yield in-range values."""
    gen = torch.Generator().manual_seed(11 * steps + topk + n)
    bs, pad, vocab, hidden_size, width = 4, 2, 12, 8, steps + 1
    tree, node_tokens = _random_tree(bs, steps, topk, n, vocab, gen)
    kv_len = torch.randint(5, 50, (bs,), generator=gen)
    slots = torch.randperm(1000, generator=gen)[: bs * n].view(bs, n) + 1
    # Target logits whose argmax often follows the tree, for every row of the padded batch.
    logits = torch.randn((bs + pad) * n, vocab, generator=gen)
    for b in range(bs):
        for c in range(1, n):
            if torch.rand(1, generator=gen).item() < 0.7:
                logits[b * n + tree.parents[b, c], node_tokens[b, c]] += 100.0
    hidden = torch.randn((bs + pad) * n, hidden_size, generator=gen)
    fb = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs + pad,
        input_ids=torch.cat([node_tokens.flatten(), torch.zeros(pad * n, dtype=torch.int64)]),
        positions=torch.zeros((bs + pad) * n, dtype=torch.int64),
        out_cache_loc=torch.cat([slots.flatten(), torch.zeros(pad * n, dtype=torch.int64)]),
        req_pool_indices=torch.zeros(bs + pad, dtype=torch.int64),
        seq_lens=torch.cat([kv_len + n, torch.full((pad,), n)]),
        extend_seq_lens=torch.full((bs + pad,), n),
        custom_mask=torch.cat([tree.mask.flatten(0, 1), torch.ones(pad * n, n, dtype=torch.bool)]),
    )
    program = VerifyProgram(n, width, chain=topk == 1)  # a chain: the closed form against the tree's
    out = program(fb, lambda _: LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden))
    got_logits, got_hidden, got = VerifyProgram.split(out)
    assert got_logits is logits and got_hidden is hidden
    target = logits[: bs * n].argmax(-1).view(bs, n)
    want = verify_outcome(greedy_accept(tree, node_tokens, target, width), kv_len, slots, hidden[: bs * n])
    for name, value in zip(("accept_len", "nodes", "emitted"), got.acceptance.as_tuple()):
        assert torch.equal(value[:bs], getattr(want.acceptance, name)), name
        assert value[bs:].min() >= 0 and value.shape[0] == bs + pad
    assert torch.equal(got.extend_slots[:bs], want.extend_slots)
    assert torch.equal(got.extend_hidden[: bs * width], want.extend_hidden)
    assert torch.equal(got.extend_logits_rows[:bs], want.extend_logits_rows)
    assert torch.equal(got.cursors[:bs], want.cursors)
    assert torch.equal(got.host_reads[:bs], want.host_reads)
    assert int(got.acceptance.nodes.max()) < n and int(got.acceptance.accept_len.max()) < width


@pytest.mark.parametrize("topk", [2, 4])
def test_top_guesses_are_the_top_k_of_the_softmax(topk):
    logits = torch.randn(5, 97, generator=torch.Generator().manual_seed(topk)) * 4
    probs, tokens = top_guesses(logits, topk)
    ref_probs, ref_tokens = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    assert probs.shape == tokens.shape == (5, topk) and tokens.dtype == torch.int64
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(probs, ref_probs)


def test_one_guess_is_the_greedy_token_with_score_one():
    """A chain is never ranked: its guess is the argmax (first of tied maxima), its score 1."""
    logits = torch.randn(5, 97, generator=torch.Generator().manual_seed(1)) * 4
    logits[2, 10] = logits[2, 40] = logits[2].max() + 1
    scores, tokens = top_guesses(logits, 1)
    assert tokens.shape == (5, 1) and tokens.dtype == torch.int64
    assert torch.equal(tokens.view(-1), torch.argmax(logits, dim=-1)) and int(tokens[2]) == 10
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.ones(5, 1))


def test_draft_extend_program_returns_the_guesses_and_hidden_states():
    logits, hidden = torch.randn(3, 11), torch.randn(3, 8)
    out = DraftExtendProgram(2, rows_per_req=1)(
        None, lambda fb: LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden)
    )
    ref_probs, ref_tokens = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
    assert torch.equal(out[1], ref_tokens) and torch.equal(out[2], hidden)
    torch.testing.assert_close(out[0], ref_probs)


@pytest.mark.parametrize("topk", [1, 2, 3])
def test_draft_step_writes_its_own_scratch_columns(topk):
    """Step t of the draft loop writes request b's input j to table column L_b + t*topk + j
    (L_b: the KV length), and a padded row only to the dummy slot."""
    steps, bs = 4, 3
    table = torch.arange(5 * 100).view(5, 100) + 1000  # row r, column c: slot 1000 + 100 r + c
    rows, kv_lens = torch.tensor([4, 1, 2]), torch.tensor([7, 20, 3])
    first_loc = table[rows.view(-1, 1), kv_lens.view(-1, 1) + torch.arange(topk)].flatten()
    first_loc[-topk:] = PAD_KV_SLOT  # the last request is a padded row
    first = ForwardBatch(
        mode=ForwardMode.DRAFT_DECODE,
        batch_size=bs,
        input_ids=torch.zeros(bs * topk, dtype=torch.int64),
        positions=kv_lens.repeat_interleave(topk),
        out_cache_loc=first_loc,
        req_pool_indices=rows,
        seq_lens=kv_lens + topk,
        extend_seq_lens=torch.full((bs,), topk),
        seq_lens_cpu=(kv_lens + topk).tolist(),
        req_to_token_pool=SimpleNamespace(req_to_token=table),
    )
    loop = DraftLoop(steps, topk, num_draft_tokens=steps + 1, max_position=1 << 20, constants=DeviceConstants("cpu"))
    for t in range(1, steps - 1):
        step = loop._next_step(
            first,
            t,
            torch.zeros(bs, topk, dtype=torch.int64),
            torch.zeros(bs * topk, 8),
            torch.ones(bs, topk, (t + 1) * topk, dtype=torch.bool),
        )
        want = table[rows.view(-1, 1), kv_lens.view(-1, 1) + t * topk + torch.arange(topk)].flatten()
        want[-topk:] = PAD_KV_SLOT
        assert torch.equal(step.out_cache_loc, want)
        assert torch.equal(step.seq_lens, kv_lens + (t + 1) * topk)
        assert torch.equal(step.positions, kv_lens.repeat_interleave(topk) + t)


@pytest.mark.parametrize("topk, n", [(1, 4), (4, 8)])
def test_cycle_sub_forward_batches_are_dense(tiny_deepseek_v3_dir, topk, n):
    """Triton kernels read a batch's index tensors as dense arrays: every sub-forward of a
    decode cycle hands them contiguous, one request included (whose topk guesses share one
    position: an expanded view of it has stride 0)."""
    from unittest import mock

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from sglang.test.inprocess_scheduler import greedy, start_scheduler

    args = ServerArgs(
        model_path=tiny_deepseek_v3_dir,
        device="cpu",
        dtype="float32",
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=n,
        max_running_requests=2,
        disable_radix_cache=True,
    )
    forward, seen = ModelRunner.forward_eager, []

    def recorded(self, fb, *rest, **kw):
        fields = (fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens)
        seen.append((fb.mode, fb.batch_size, all(t.is_contiguous() for t in fields), [t.stride() for t in fields]))
        return forward(self, fb, *rest, **kw)

    with mock.patch.object(ModelRunner, "forward_eager", recorded):
        greedy(start_scheduler(args), [[5, 17, 42, 99], [8, 9, 10]], [9, 4])
    modes = {mode for mode, bs, *_ in seen if bs == 1}
    assert {ForwardMode.DRAFT_DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND} <= modes
    assert all(s[2] for s in seen), [s for s in seen if not s[2]]


def _multinomial(probs: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(probs, 1).squeeze(1)


def _repeated_tree(parents: list[int], tokens: list[int], copies: int) -> tuple[DraftTree, torch.Tensor]:
    """`copies` requests with the same verify tree (node tokens include the root's)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for v in range(1, n):
        mask[v] |= mask[parents[v]]
    node_tokens = torch.tensor(tokens).expand(copies, -1)
    tree = DraftTree.from_mask(node_tokens, mask.expand(copies, -1, -1))
    return tree, node_tokens


def test_tree_walk_takes_a_child_where_the_children_cover_the_support():
    """top_k 2 rows whose two tokens are the root's children: with u close to 1 the float32
    shares of the children may sum below u (rejecting both left a 0 / 0 residual)."""
    bs, vocab = 2000, 16
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(0))
    info = SamplingBatchInfo.from_requests([SamplingParams(top_k=2)] * bs, [([1], [])] * bs, [None] * bs, vocab, "cpu")
    top = Sampler.filtered_probs(logits, info).topk(2, dim=-1).indices
    # Node 0's row is the row under test; the children's rows (leaves) are uniform.
    probs = torch.full((bs, 3, vocab), 1.0 / vocab)
    probs[:, 0] = Sampler.filtered_probs(logits, info)
    tree, _ = _repeated_tree([0, 0, 0], [0, 0, 0], bs)
    node_tokens = torch.cat([torch.zeros(bs, 1, dtype=torch.long), top], dim=1)
    uniforms = torch.full((bs, 3), 1.0 - 2.0**-24)  # the largest float32 below 1 (torch.rand's maximum)
    acc = sample_acceptance(probs.flatten(0, 1), tree, node_tokens, uniforms, _multinomial, width=2)
    assert acc.accept_len.tolist() == [1] * bs
    assert (acc.emitted[:, 0] == top[:, 1]).all()  # u past the first child's share: the second


# Per node of each tree: its parent; the draft's tokens are ranked by an imperfect draft.
_SAMPLING_TREES = {"chain": [0, 0, 1, 2], "tree": [0, 0, 0, 1, 1, 2, 3, 3]}


@pytest.mark.parametrize("shape", sorted(_SAMPLING_TREES))
def test_tree_sampling_has_the_target_law_with_an_imperfect_draft(shape):
    """Every node v's target law p_v is fixed (its path's law); at any node the walk reaches,
    the next emitted token must follow p_v, whether it is one of v's children (accepted) or
    the bonus drawn from p_v without them (every child rejected). Children's tokens are one
    draw each from their parent's law (an imperfect draft), so both outcomes occur often."""
    parents, vocab, copies = _SAMPLING_TREES[shape], 6, 20000
    n = len(parents)
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(n, vocab, generator=gen) * 1.5, dim=-1)
    tokens = [0]
    for v in range(1, n):  # drawn from the parent's law, never repeating a sibling's token
        law = p[parents[v]].clone()
        law[[tokens[c] for c in range(1, v) if parents[c] == parents[v]]] = 0.0
        tokens.append(int(torch.multinomial(law, 1, generator=gen)))
    tree, node_tokens = _repeated_tree(parents, tokens, copies)
    torch.manual_seed(11)
    width = max(int(d) for d in tree.depths[0]) + 1
    acc = sample_acceptance(p.repeat(copies, 1), tree, node_tokens, torch.rand(copies, n), _multinomial, width)
    accept_len, emitted = acc.accept_len.tolist(), acc.emitted.tolist()
    assert {0, width - 1} <= set(accept_len)  # whole paths rejected and accepted
    path_of = {(): 0}  # emitted prefix -> the node the walk is at
    for v in range(1, n):
        prefix = next(k for k, node in path_of.items() if node == parents[v])
        path_of[prefix + (tokens[v],)] = v
    checked = 0
    for prefix, v in path_of.items():
        counts: dict[int, int] = {}
        for a, row in zip(accept_len, emitted):
            if len(prefix) <= a and tuple(row[: len(prefix)]) == prefix:
                counts[row[len(prefix)]] = counts.get(row[len(prefix)], 0) + 1
        total = sum(counts.values())
        if total >= 1000:
            checked += 1
            assert fits(counts, p[v].double(), total), (shape, v, chi_square(counts, p[v].double(), total))
    assert checked >= 3
