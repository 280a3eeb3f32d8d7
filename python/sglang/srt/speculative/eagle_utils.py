"""Draft tree bookkeeping and tree verification (pure functions, no model calls).

Vocabulary used throughout, per request:
- candidate: a drafted token with a cumulative draft score (product of draft probabilities
  along its path) and a parent candidate (-1 for depth 1). Candidates are numbered in the
  order they were drafted, so a parent always has a smaller number than its children.
- verify tree: node 0 is the request's last sampled token (the root, whose target KV is not
  written yet); nodes 1..n-1 are the chosen candidates in candidate order, so parents precede
  children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.utils.transfer import to_host


def select_step_inputs(
    child_scores: torch.Tensor, child_tokens: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The topk best children (by cumulative score) become the next draft step's inputs.

    child_scores, child_tokens: [bs, topk * topk], child c of input c // topk.
    Returns (scores [bs, topk], tokens [bs, topk], flat child index [bs, topk]).
    """
    scores, flat = torch.topk(child_scores, topk, dim=1)
    return scores, child_tokens.gather(1, flat), flat


@dataclass
class VerifyTree:
    """Verify trees of a batch, on the host (small: bs x num_draft_tokens)."""

    tokens: list[list[int]]  # [bs][n] node tokens (node 0: the root)
    parents: list[list[int]]  # [bs][n] parent node (-1 for the root)
    depths: list[list[int]]  # [bs][n] depth (0 for the root)

    def ancestor_masks(self) -> torch.Tensor:
        """[bs, n, n] bool (host): node a of request b sees node c iff c is a or an ancestor of a."""
        parents = torch.tensor(self.parents).clamp_(min=0)  # the root stands in for its own parent
        bs, n = parents.shape
        itself = torch.eye(n, dtype=torch.bool).expand(bs, n, n)
        mask, parent_rows = itself, parents.unsqueeze(-1).expand(bs, n, n)
        for _ in range(max(max(d) for d in self.depths)):  # each pass adds one more generation
            mask = itself | mask.gather(1, parent_rows)
        return mask


def build_verify_tree(
    root_tokens: list[int],
    cand_scores: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_parents: torch.Tensor,
    num_draft_tokens: int,
) -> VerifyTree:
    """Keep the num_draft_tokens - 1 best candidates per request (plus the root).

    root_tokens: [bs] (host); cand_*: [bs, M]. A child's score never exceeds its parent's and
    a parent's number is smaller, so a stable descending sort ranks every parent before its
    children: the kept set is closed under ancestors. One read of the device.
    """
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, : num_draft_tokens - 1]
    chosen = order.sort(dim=1).values
    chosen_l, tokens_l, parents_l = to_host(chosen, cand_tokens.gather(1, chosen), cand_parents.gather(1, chosen))
    tokens = [[root] + toks for root, toks in zip(root_tokens, tokens_l)]
    all_parents, all_depths = [], []
    for cands, cand_par in zip(chosen_l, parents_l):
        node_of = {c: i + 1 for i, c in enumerate(cands)}
        parents, depths = [-1], [0]
        for p in cand_par:
            node = 0 if p < 0 else node_of[p]
            parents.append(node)
            depths.append(depths[node] + 1)
        all_parents.append(parents)
        all_depths.append(depths)
    return VerifyTree(tokens, all_parents, all_depths)


def walk_tree(parents: list[int], child_prob: list[float], uniforms: list[float]) -> tuple[list[int], list[int]]:
    """Tree speculative sampling with deterministic draft proposals (lossless).

    At the current node with target distribution p, children are tried in order: child c
    (token x) is accepted with probability p(x) / (mass not yet rejected at this node);
    otherwise x is removed from p. child_prob[c] is p(token of c) at c's parent. Greedy
    verification is the case p = one-hot(argmax) with uniforms all 0.
    Returns (accepted nodes after the root, nodes rejected at the final node).
    """
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    path, cur = [], 0
    while True:
        rejected, rejected_mass = [], 0.0
        for c in children[cur]:
            remaining = 1.0 - rejected_mass
            if remaining > 0 and uniforms[c] * remaining < child_prob[c]:
                break
            rejected.append(c)
            rejected_mass += child_prob[c]
        else:
            return path, rejected
        path.append(c)
        cur = c
