"""The device-side verify tree and greedy acceptance against plain-Python references."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.speculative.eagle_utils import build_draft_tree, greedy_accept, select_step_inputs, walk_tree


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
        path, _ = walk_tree(ref_parents, child_prob, [0.0] * n)
        a = len(path)
        lengths.add(a)
        assert acc.accept_len[b].item() == a
        nodes = [0] + path
        assert acc.nodes[b].tolist() == nodes + [nodes[-1]] * (width - a - 1)
        assert acc.emitted[b].tolist() == [target[b, c].item() for c in nodes] + [0] * (width - a - 1)
    assert len(lengths) > 1 or steps == 1


def test_acceptance_of_an_empty_batch():
    tree = build_draft_tree(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int64), torch.full((0, 3), -1), 4, 3)
    acc = greedy_accept(tree, torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64), 4)
    assert acc.accept_len.shape == (0,) and acc.nodes.shape == (0, 4) and acc.emitted.shape == (0, 4)
