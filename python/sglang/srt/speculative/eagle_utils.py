"""Draft tree bookkeeping and tree verification (no model calls).

Vocabulary used throughout, per request:
- candidate: a drafted token with a cumulative draft score (product of draft probabilities
  along its path) and a parent candidate (-1 for depth 1). Candidates are numbered in the
  order they were drafted, so a parent always has a smaller number than its children.
- verify tree: node 0 is the request's last sampled token (the root, whose target KV is not
  written yet); nodes 1..n-1 are the chosen candidates in candidate order, so parents precede
  children.
- acceptance: the nodes whose KV the request keeps, one per emitted token: emitted token j
  is the target's choice at node nodes[j] (nodes[0] is the root).

The tree and the greedy acceptance are built on the device from shapes alone (no host
reads), so they run inside CUDA graphs and a greedy cycle reads the device once, at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.memory_pool import DUMMY_KV_SLOT
from sglang.srt.utils.device_constants import DeviceConstants
from sglang.srt.utils.transfer import to_host, upload


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
class DraftTree:
    """The verify trees of a batch without their roots, on the device."""

    tokens: torch.Tensor  # [bs, n - 1] tokens of nodes 1..n-1
    parents: torch.Tensor  # [bs, n] parent node (the root is its own parent)
    depths: torch.Tensor  # [bs, n] (0 for the root)
    mask: torch.Tensor  # [bs, n, n] bool: node a sees node c iff c is a or an ancestor of a

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.parents, self.depths, self.mask

    @classmethod
    def from_mask(cls, node_tokens: torch.Tensor, mask: torch.Tensor) -> DraftTree:
        """The tree of a verify batch from its node tokens [bs, n] and tree mask [bs, n, n]
        alone. A node's ancestors are numbered below it, its parent highest among them."""
        n = mask.shape[-1]
        nodes = torch.arange(n, device=mask.device)
        strict = mask & (nodes.view(-1, 1) != nodes)  # [bs, n, n]: the ancestors but itself
        parents = torch.where(strict, nodes, 0).amax(dim=-1)  # the root has none: its own parent 0
        return cls(node_tokens[:, 1:], parents, strict.sum(dim=-1), mask)


def chain_tree(tokens: torch.Tensor, constants: DeviceConstants) -> DraftTree:
    """The verify tree of a chain (topk 1: node j's parent is node j - 1), in closed form:
    what build_draft_tree keeps of a chain's candidates. tokens: [bs, n - 1]. Everything but
    the tokens depends on n alone: views of `constants` (no launches)."""
    bs, n = tokens.shape[0], tokens.shape[1] + 1
    nodes = constants.arange(n)
    parents = constants.get(("chain_parents", n), lambda: (nodes - 1).clamp(min=0))
    mask = constants.get(("chain_mask", n), lambda: nodes.view(-1, 1) >= nodes)
    return DraftTree(tokens, parents.expand(bs, -1), nodes.expand(bs, -1), mask.expand(bs, -1, -1))


def build_draft_tree(
    cand_scores: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor, num_nodes: int, max_depth: int
) -> DraftTree:
    """Keep the num_nodes - 1 best candidates per request (plus the root).

    cand_*: [bs, M]. A child's score never exceeds its parent's and a parent's number is
    smaller, so a stable descending sort ranks every parent before its children: the kept
    set is closed under ancestors. max_depth bounds every node's depth (the draft steps).
    """
    bs, device = cand_scores.shape[0], cand_scores.device
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, : num_nodes - 1]
    chosen = order.sort(dim=1).values
    parent_cand = cand_parents.gather(1, chosen)
    nodes = torch.arange(num_nodes, device=device)
    node_of = torch.zeros_like(cand_parents).scatter_(1, chosen, nodes[1:].expand(bs, -1))
    parent_node = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))
    parents = torch.cat([torch.zeros_like(parent_node[:, :1]), parent_node], dim=1)
    depths = (nodes > 0).long().expand(bs, -1)
    itself = torch.eye(num_nodes, dtype=torch.bool, device=device).expand(bs, -1, -1)
    mask, parent_rows = itself, parents.unsqueeze(-1).expand(-1, -1, num_nodes)
    for _ in range(max_depth):  # each pass reaches one generation further up
        depths = torch.where(nodes > 0, depths.gather(1, parents) + 1, 0)
        mask = itself | mask.gather(1, parent_rows)
    return DraftTree(cand_tokens.gather(1, chosen), parents, depths, mask)


@dataclass
class Acceptance:
    """What one verify keeps per request, on the device; `width` = steps + 1 columns."""

    accept_len: torch.Tensor  # [bs] accepted draft tokens (emitted tokens - 1)
    nodes: torch.Tensor  # [bs, width] node of each emitted token; past accept_len: the last node
    emitted: torch.Tensor  # [bs, width] target's token at nodes[j]; past accept_len: 0

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.accept_len, self.nodes, self.emitted


def greedy_accept(tree: DraftTree, tokens: torch.Tensor, target_tokens: torch.Tensor, width: int) -> Acceptance:
    """Greedy verification: a node is kept iff its token and every ancestor's equal the
    target's argmax at their parents. Siblings hold distinct tokens, so the kept nodes are
    one path from the root (what walk_tree picks with one-hot probabilities).

    tokens: [bs, n] node tokens (root included); target_tokens: [bs, n] argmax at each node.
    """
    match = tokens == target_tokens.gather(1, tree.parents)
    match[:, 0] = True
    kept = ~(tree.mask & ~match.unsqueeze(1)).any(dim=-1)
    # A real tree keeps its root and at most steps + 1 = width nodes; the bounds matter for
    # padded rows only (their all-true masks), whose outcome is discarded.
    accept_len = (kept.sum(dim=1) - 1).clamp(0, width - 1)
    return _acceptance(kept, tree.depths, accept_len, target_tokens, width)


def greedy_accept_chain(tokens: torch.Tensor, target_tokens: torch.Tensor, width: int) -> Acceptance:
    """greedy_accept for chain trees (chain_tree) in closed form: the accepted drafts are the
    leading nodes whose token equals the target's argmax at the node before."""
    match = tokens[:, 1:] == target_tokens[:, :-1]
    accept_len = match.long().cumprod(dim=1).sum(dim=1).clamp(max=width - 1)
    columns = torch.arange(width, device=tokens.device)
    nodes = torch.minimum(columns, accept_len.view(-1, 1))
    emitted = torch.where(columns <= accept_len.view(-1, 1), target_tokens.gather(1, nodes), 0)
    return Acceptance(accept_len, nodes, emitted)


def _acceptance(
    kept: torch.Tensor, depths: torch.Tensor, accept_len: torch.Tensor, target_tokens: torch.Tensor, width: int
) -> Acceptance:
    columns = torch.arange(width, device=kept.device)
    at_depth = torch.where(kept, depths, -1).unsqueeze(1) == columns.view(1, -1, 1)  # [bs, width, n]
    nodes = at_depth.int().argmax(dim=-1)
    nodes = torch.where(at_depth.any(dim=-1), nodes, nodes.gather(1, accept_len.view(-1, 1)))
    emitted = torch.where(columns <= accept_len.view(-1, 1), target_tokens.gather(1, nodes), 0)
    return Acceptance(accept_len, nodes, emitted)


@dataclass
class VerifyOutcome:
    """What a verify leaves for the rest of its cycle, per request, on the device."""

    acceptance: Acceptance
    extend_slots: torch.Tensor  # [bs, width] the kept nodes' slots, then the dummy slot
    extend_hidden: torch.Tensor  # [bs * width, hidden] target hidden state of each emitted token's node
    extend_logits_rows: torch.Tensor  # [bs] the draft extend's row of each request's last emitted token
    cursors: torch.Tensor  # [bs, 2] the next cycle's RequestStates.cursors: L + accept_len + 1, last emitted token
    host_reads: torch.Tensor  # [bs, 1 + 2 * width] accept_len, nodes, emitted: what the host reads

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return (
            *self.acceptance.as_tuple(),
            self.extend_slots,
            self.extend_hidden,
            self.extend_logits_rows,
            self.cursors,
            self.host_reads,
        )

    @classmethod
    def from_tuple(cls, values: tuple[torch.Tensor, ...]) -> VerifyOutcome:
        accept_len, nodes, emitted, *rest = values
        return cls(Acceptance(accept_len, nodes, emitted), *rest)


def verify_outcome(
    acceptance: Acceptance, kv_len: torch.Tensor, slots: torch.Tensor, target_hidden: torch.Tensor
) -> VerifyOutcome:
    """kv_len: [bs] L; slots: the verify's [bs, n]; target_hidden: its [bs * n, hidden] output.
    The draft extend's row j of request b holds emitted token j (pads past accept_len write
    the dummy slot)."""
    accept_len, nodes, emitted = acceptance.as_tuple()
    bs, n, width = slots.shape[0], slots.shape[1], nodes.shape[1]
    arange_bs = torch.arange(bs, device=slots.device)
    real = torch.arange(width, device=slots.device) <= accept_len.view(-1, 1)
    last_token = emitted.gather(1, accept_len.view(-1, 1))
    return VerifyOutcome(
        acceptance,
        torch.where(real, slots.gather(1, nodes), DUMMY_KV_SLOT),
        target_hidden[(arange_bs.view(-1, 1) * n + nodes).flatten()],  # fresh (never a view of a gathered buffer)
        arange_bs * width + accept_len,
        torch.cat([(kv_len + accept_len + 1).view(-1, 1), last_token], dim=1),
        torch.cat([accept_len.view(-1, 1), nodes, emitted], dim=1),
    )


def chain_verify_outcome(
    tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    target_hidden: torch.Tensor,
    width: int,
) -> VerifyOutcome:
    """verify_outcome(greedy_accept_chain(tokens, target_tokens, width), kv_len, slots,
    target_hidden): on CUDA one Triton launch and an index_select instead of ~25 small ops."""
    if not tokens.is_cuda:
        return verify_outcome(greedy_accept_chain(tokens, target_tokens, width), kv_len, slots, target_hidden)
    from sglang.srt.kernels.spec_ops import chain_outcome  # triton ships with CUDA builds of torch

    return VerifyOutcome.from_tuple(chain_outcome(tokens, target_tokens, kv_len, slots, target_hidden, width, DUMMY_KV_SLOT))


def agree_on_acceptance(acceptance: Acceptance, group, src: int) -> Acceptance:
    """The acceptance of global rank `src` on every rank of `group` (attention TP: its ranks
    sample with their own random numbers; one broadcast of a few ints per request)."""
    accept_len, nodes, emitted = acceptance.as_tuple()
    packed = torch.cat([accept_len.view(-1, 1), nodes, emitted], dim=1).contiguous()
    torch.distributed.broadcast(packed, src=src, group=group)
    width = nodes.shape[1]
    return Acceptance(packed[:, 0].contiguous(), packed[:, 1 : 1 + width].contiguous(), packed[:, 1 + width :].contiguous())


def path_token_counts(tree: DraftTree, vocab_size: int) -> torch.Tensor:
    """[bs * n, vocab_size]: how often each token lies on node v's path, v included and the
    root not (the root is the request's newest output token, already in its history). Node v's
    penalties count these with the history: its logits continue that path."""
    bs, n = tree.mask.shape[:2]
    on_path = tree.mask[:, :, 1:].float()  # [bs, n, n - 1]: node c (>= 1) is v or an ancestor
    counts = torch.zeros((bs, n, vocab_size), dtype=torch.float32, device=tree.mask.device)
    counts.scatter_add_(2, tree.tokens.unsqueeze(1).expand(-1, n, -1), on_path)
    return counts.flatten(0, 1)


def non_finite_requests(logits: torch.Tensor, batch_size: int) -> torch.Tensor:
    """[bs] bool: whether any verify logit of request b (its rows b*n .. b*n+n-1) is not finite."""
    return (~torch.isfinite(logits).view(batch_size, -1)).any(dim=1)


def walk_tree(parents: list[int], child_prob: list[float], residual_mass: list[float], uniforms: list[float]) -> list[int]:
    """Tree speculative sampling with deterministic draft proposals (lossless), on the host.

    At node v with target distribution p, one draw u = uniforms[v] picks among v's children
    (in order) by their shares child_prob[c] = p(token of c) of the mass child shares +
    residual_mass[v] (p's mass outside the children's tokens); past the children the walk
    stops at v and the bonus token comes from that residual. This is the law of accepting
    each child with probability p(x) / (mass not yet rejected) in turn, without its 0 / 0:
    where the children cover p's support (residual_mass[v] == 0) rounding cannot stop the
    walk, the last child with positive mass is taken. Greedy verification is the case
    p = one-hot(argmax) with uniforms all 0.
    Returns the accepted nodes after the root; the walk stops at the last one (or the root).
    """
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    path, cur = [], 0
    while True:
        kids = children[cur]
        threshold = uniforms[cur] * (sum(child_prob[c] for c in kids) + residual_mass[cur])
        cumulative, chosen = 0.0, None
        for c in kids:
            cumulative += child_prob[c]
            if threshold < cumulative:
                chosen = c
                break
        if chosen is None and not residual_mass[cur] > 0:
            chosen = next((c for c in reversed(kids) if child_prob[c] > 0), None)
        if chosen is None:
            return path
        path.append(chosen)
        cur = chosen


def sample_acceptance(
    probs: torch.Tensor,
    tree: DraftTree,
    node_tokens: torch.Tensor,
    uniforms: torch.Tensor,
    draw: Callable[[torch.Tensor], torch.Tensor],
    width: int,
) -> Acceptance:
    """Lossless tree sampling of a batch: walk_tree per request on the host, then the bonus
    token at the node where each walk stopped, drawn from p without that node's children.

    probs: [bs * n, V] target probabilities at each node (after penalties and filters);
    node_tokens: [bs, n]; uniforms: [bs, n] one draw per node; draw: samples one token per
    row of a [rows, V] probability tensor (the requests' generators). Two reads of the device.
    """
    bs, n = node_tokens.shape
    parent_rows = (torch.arange(bs, device=probs.device).view(-1, 1) * n + tree.parents).flatten()
    child_prob = probs[parent_rows, node_tokens.flatten()].view(bs, n)
    is_child = torch.zeros_like(probs, dtype=torch.bool)
    is_child[parent_rows.view(bs, n)[:, 1:].flatten(), node_tokens[:, 1:].flatten()] = True
    residual = probs.masked_fill(is_child, 0.0)  # exactly 0 where the children cover the support
    residual_mass = residual.sum(dim=-1).view(bs, n)
    host = to_host(child_prob, residual_mass, uniforms, tree.parents, node_tokens)
    child_prob_h, residual_mass_h, uniforms_h, parents, tokens = host
    paths = [walk_tree(parents[b], child_prob_h[b], residual_mass_h[b], uniforms_h[b]) for b in range(bs)]
    (finals,) = upload([[b * n + (p[-1] if p else 0) for b, p in enumerate(paths)]], probs.device)
    stop = residual[finals]  # positive mass: a walk stops only where its residual is positive
    (bonus,) = to_host(draw(stop / stop.sum(dim=-1, keepdim=True)))
    nodes: list[int] = []
    emitted: list[int] = []
    for b, path in enumerate(paths):
        pad = width - len(path) - 1
        nodes += [0] + path + [path[-1] if path else 0] * pad
        emitted += [tokens[b][c] for c in path] + [bonus[b]] + [0] * pad
    accept_len, nodes_t, emitted_t = upload([[len(p) for p in paths], nodes, emitted], probs.device)
    return Acceptance(accept_len, nodes_t.view(bs, width), emitted_t.view(bs, width))
