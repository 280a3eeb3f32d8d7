"""Which prefill (extend) forwards are captured in CUDA graphs: token buckets and request rows.

A prefill batch's requests bring any number of new tokens, so its graphs are *ragged*: one per
token bucket T, holding R = min(T, max_rows) request rows (max_rows: 16, or one more than the
running-request cap when that is smaller). A batch of n <= T tokens in bs
requests replays the smallest bucket that holds it: its requests fill rows 0..bs-1 and tokens
0..n-1; the T - n padding tokens belong to one padding request on row bs, and the rows after
it are empty requests (no tokens, no KV). So a bucket holds the batch when n <= T and
bs + (1 if n < T else 0) <= R.

A runner names the prefill forwards it captures among its graph modes, with
SERVER_PREFILL_BUCKETS in place of the buckets (ModelRunner puts this server's buckets there,
or drops the mode when prefill graphs are off: --disable-piecewise-cuda-graph, or no decode
graphs): a plain runner its prefill (logits of each request's last row), a speculative target
its prefill keeping every token's hidden state, the draft its extend over the prompt (the
target's hidden states in, the last row's logits and hidden state out). Under DP attention
every rank replays the same bucket in a prefill iteration, chosen from the plan
(CudaGraphRunner._dp_ragged_key), or every rank runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from sglang.srt.server_args import ServerArgs

DEFAULT_MAX_TOKENS = 2048
SMALLEST_DEFAULT_BUCKET = 64
# Request rows of a bucket (the padding request's included): every row costs the attention
# kernel's grid one slice of programs that exit at once when the row is empty.
MAX_ROWS = 16


@dataclass(frozen=True)
class RaggedTokens:
    """The graphs of a ragged mode: one per token bucket (ascending), each of rows(bucket) requests."""

    buckets: tuple[int, ...]
    max_rows: int = MAX_ROWS

    def rows(self, tokens: int) -> int:
        return min(tokens, self.max_rows)

    def bucket_for(self, num_tokens: int, num_requests: int) -> Optional[int]:
        """The smallest bucket holding num_tokens tokens of num_requests requests (and, when
        some of its tokens are padding, the padding request), or None (eager)."""
        return self.bucket_for_all([(num_tokens, num_requests)]) if num_requests >= 1 else None

    def bucket_for_all(self, batches: Sequence[tuple[int, int]]) -> Optional[int]:
        """The smallest bucket holding each (tokens, requests) batch as bucket_for does (an
        empty batch: the padding request alone), or None: what DP ranks replay together."""
        for tokens in self.buckets:
            if all(n <= tokens and r + (n < tokens) <= self.rows(tokens) for n, r in batches):
                return tokens
        return None


# A ragged mode's buckets before the server's are known: ModelRunner replaces them (see above).
SERVER_PREFILL_BUCKETS = RaggedTokens(())


def default_token_buckets(max_tokens: int) -> list[int]:
    """Four buckets per doubling from 64 (64, 80, 96, 112, 128, 160, ...) below max_tokens, and
    max_tokens itself: a prefill of more than 64 tokens pads by less than a quarter of them."""
    buckets, octave = [], SMALLEST_DEFAULT_BUCKET
    while True:
        for tokens in (octave, octave * 5 // 4, octave * 3 // 2, octave * 7 // 4):
            if tokens >= max_tokens:
                return buckets + [max_tokens]
            buckets.append(tokens)
        octave *= 2


def prefill_token_buckets(given: Optional[Sequence[int]], max_tokens: Optional[int], limit: int) -> list[int]:
    """Token buckets to capture, ascending.

    --piecewise-cuda-graph-tokens gives the list (default: `default_token_buckets(max)`);
    --piecewise-cuda-graph-max-tokens (default 2048, or the largest given bucket) caps it.
    Nothing above `limit` is captured (the most tokens one prefill batch feeds the model, and
    the request->token table's row width, which a padding request's KV indices must fit);
    when the limit cuts the list, the limit itself is captured so the largest prefills still
    have a graph.
    """
    if max_tokens is None:
        max_tokens = max(given) if given else DEFAULT_MAX_TOKENS
    buckets = sorted(set(given)) if given else default_token_buckets(max_tokens)
    cap = min(max_tokens, limit)
    kept = [t for t in buckets if t <= cap]
    if len(kept) < len(buckets) and cap == limit and limit not in kept:
        kept.append(limit)
    return kept


def prefill_ragged_tokens(args: ServerArgs, limit: int, max_running_requests: int) -> Optional[RaggedTokens]:
    """The prefill graphs this server captures (limit: see prefill_token_buckets), or None:
    prefill graphs are off (ServerArgs.enable_piecewise_cuda_graph, resolved), or no bucket is
    left. A batch holds at most max_running_requests requests, so no graph has rows for more
    (and the padding request)."""
    if not args.enable_piecewise_cuda_graph:
        return None
    buckets = prefill_token_buckets(args.piecewise_cuda_graph_tokens, args.piecewise_cuda_graph_max_tokens, limit)
    return RaggedTokens(tuple(buckets), min(MAX_ROWS, max_running_requests + 1)) if buckets else None
