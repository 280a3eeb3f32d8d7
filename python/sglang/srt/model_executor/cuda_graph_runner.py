"""CUDA graphs for fixed-shape forwards.

One runner per ModelRunner. A graph is keyed by a frozen `GraphKey` (mode, padded per-rank
batch size, tokens per request, tree width, the program it runs; for a ragged mode, prefill,
its token bucket instead of tokens per request) and replays the
attention-metadata build *and* the model forward together, reading nothing but the runner's
static input buffers, the weights and the KV pool. Because the metadata is rebuilt inside every replay, nothing a graph reads at
replay time lives in the shared memory pool, so all graphs can share one pool safely.

Invariants:
- every graph reads the same static input buffers; `StaticInputs.load` fills them, padding
  rows with valid values (token 0, dummy KV slot 0, request row 0, seq_len = extend_len =
  tokens per request), so a padded row never writes a real request's KV; in a ragged key the
  padding tokens belong to one padding request (KV length = its token count, no prefix) and
  the other padded requests are empty (seq_len = extend_len = 0);
- graphs copy their outputs into static output buffers; `replay` returns fresh copies, so
  nothing handed to callers aliases memory a later replay overwrites, except in modes
  captured with `outputs_as_views`: there the caller consumes (or queues copies of) every
  output before it queues the mode's next replay;
- choosing a graph reads host values only (no device sync);
- under DP attention the choice depends only on the iteration plan (the same on every rank):
  when no DP rank extends, every rank replays the decode graph padded to the largest DP
  rank's batch, idle ranks included, so the gathers inside the graphs line up;
- a program's batch replays only a graph captured with that program: modes share the static
  inputs and the memory pool, never a graph or an output buffer.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol, Union, runtime_checkable

import torch

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.distributed.parallel_state import record_graph_replay
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.mem_cache.memory_pool import DUMMY_KV_SLOT, DUMMY_REQ_ROW
from sglang.srt.model_executor.prefill_graphs import RaggedTokens

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CUDA_GRAPH_MAX_BS = 256
# Values of padded rows: token 0 at position 0 writing the dummy KV slot 0 and reading the
# dummy request row 0 (neither is ever allocated; what a padded row reads is discarded).
PAD_TOKEN_ID = 0
PAD_KV_SLOT = DUMMY_KV_SLOT
PAD_REQ_ROW = DUMMY_REQ_ROW
# Rows of StaticInputs.int_rows: input ids, positions, KV slots (per token), then table rows,
# seq_lens, extend_lens (per request).
_TOKEN_ROWS = 3
_INT_ROWS = 6
_MIB = 1 << 20


@runtime_checkable
class GraphCapturableBackend(Protocol):
    """An attention backend whose metadata build can be captured with static shapes."""

    def init_cuda_graph_state(self, max_bs: int, kv_indices_capacity: int, device: torch.device) -> None:
        """Allocate the max-size buffers every captured metadata build writes into."""

    def init_forward_metadata_graph(self, forward_batch: ForwardBatch, max_extend_len: int) -> None:
        """Build metadata from device tensors only (no host lengths), into the static buffers."""


class CudaGraphCaptureError(RuntimeError):
    """Capture failed (typically out of memory); the message names the flags that help."""


class ForwardFn(Protocol):
    """One model forward as a graph runs it (metadata from device tensors, then the model:
    CudaGraphRunner.captured_forward), or as an eager forward runs it (ModelRunner.forward_eager):
    of the model runner that runs the program, or of `runner`."""

    def __call__(self, fb: ForwardBatch, runner: Optional[ModelRunner] = None) -> LogitsProcessorOutput: ...


class GraphProgram(Protocol):
    """Work of several forwards captured as one graph (e.g. the whole draft loop). Called with
    the mode's batch and the forward to run each forward with; returns per-request outputs
    ([batch_size, ...] each). Programs are hashable (graphs are looked up by them): frozen
    dataclasses compared by value, or as objects when they hold state; their repr is the same on
    every rank (it is part of GraphKey's, which --debug-collectives compares)."""

    def __call__(self, fb: ForwardBatch, forward: ForwardFn) -> tuple[torch.Tensor, ...]: ...


@dataclass(frozen=True)
class SpecInfoLayout:
    """The per-token tensors of a mode's ForwardBatch.spec_info, which its graphs read from
    static buffers: (attribute, row shape, dtype) of each, and `make`, which builds the
    spec_info from such tensors passed by attribute name. Modes share the buffer of an
    attribute of the same shape and dtype."""

    fields: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    make: Callable[..., Any]


@dataclass(frozen=True)
class CapturedMode:
    """How the batches of one mode are captured: every request has the same token count, or,
    in a ragged mode, any count (tokens_per_req 0), the batch padded to a token bucket."""

    tokens_per_req: int
    tree_cols: tuple[int, ...] = (0,)  # tree-mask widths, one graph each (0: no mask)
    capture_hidden: CaptureHiddenMode = CaptureHiddenMode.NULL
    logits_at_rows: bool = False  # logits at one given row per request (fb.logits_indices)
    spec_info: Optional[SpecInfoLayout] = None  # what the batch's spec_info carries (None: no spec_info)
    outputs_as_views: bool = False  # replay returns views of the output buffers (no copies)
    slots_only: bool = False  # the batch carries only its table rows and KV slots (all a program reads)
    # Modes of one group are captured together, larger groups first; capture_mib reports the
    # GPU memory each group added under its number (0: the modes of no group).
    group: int = 0
    ragged: Optional[RaggedTokens] = None  # a ragged mode's buckets (None: uniform)
    # Outputs (by position) with a row per token rather than per request: a ragged target
    # prefill's hidden states of every token. Replay returns the batch's num_tokens rows of them.
    per_token_outputs: tuple[int, ...] = ()


class ModeKey(NamedTuple):
    """A captured mode: the forward mode of its batches and the program that runs them (None:
    one model forward). Several programs may be captured for one forward mode."""

    mode: ForwardMode
    program: Optional[GraphProgram] = None


@dataclass(frozen=True)
class GraphKey:
    """What makes two forwards replayable by the same graph."""

    mode: ForwardMode
    batch_size: int  # padded requests on this rank
    tokens_per_req: int
    tree_cols: int = 0  # tree-mask width (0: no tree mask)
    program: Optional[GraphProgram] = None  # the captured work (None: one model forward)
    ragged_tokens: int = 0  # a ragged key's token bucket (tokens_per_req is 0); 0: uniform

    @property
    def mode_key(self) -> ModeKey:
        return ModeKey(self.mode, self.program)

    @property
    def num_tokens(self) -> int:
        return self.ragged_tokens or self.batch_size * self.tokens_per_req

    @property
    def pad_seq_len(self) -> int:
        """A padded request's KV length: its new tokens and, under a tree mask, its tree (0 in
        a ragged key, whose padding tokens belong to the padding request alone)."""
        return max(self.tokens_per_req, self.tree_cols)

    def padding_lengths(self, rows: int, tokens: int) -> tuple[list[int], list[int]]:
        """(KV lengths, new-token lengths) of the padded requests rows..batch_size after real
        requests of `tokens` tokens: each (pad_seq_len, tokens_per_req); in a ragged key the
        first padded request holds the num_tokens - tokens padding tokens, the others none."""
        pad = self.batch_size - rows
        if not self.ragged_tokens:
            return [self.pad_seq_len] * pad, [self.tokens_per_req] * pad
        lens = [self.ragged_tokens - tokens] + [0] * (pad - 1) if pad else []
        return lens, list(lens)


# ---------------------------------------------------------------------- batch sizes
def default_capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 1, 8))
    return sorted(set(sizes + [max_bs]))


def capture_batch_sizes(
    cuda_graph_bs: Optional[Sequence[int]], cuda_graph_max_bs: Optional[int], max_running_requests: int
) -> list[int]:
    """Per-rank batch sizes to capture, ascending.

    --cuda-graph-bs gives the list (default: `default_capture_sizes(--cuda-graph-max-bs)`);
    --cuda-graph-max-bs (default 256, or the largest --cuda-graph-bs) caps it. Nothing above
    the running-request cap is captured; when the cap cuts the list, the cap itself is added
    so the fullest batch still has a graph.
    """
    if cuda_graph_max_bs is None:
        cuda_graph_max_bs = max(cuda_graph_bs) if cuda_graph_bs else DEFAULT_CUDA_GRAPH_MAX_BS
    sizes = sorted(set(cuda_graph_bs)) if cuda_graph_bs else default_capture_sizes(cuda_graph_max_bs)
    limit = min(cuda_graph_max_bs, max_running_requests)
    kept = [b for b in sizes if b <= limit]
    if len(kept) < len(sizes) and limit not in kept and limit == max_running_requests:
        kept.append(limit)
    return kept


def padded_batch_size(batch_size: int, captured: Sequence[int], disable_padding: bool) -> Optional[int]:
    """The captured size a batch of `batch_size` requests replays, or None (run eagerly).

    `captured` is ascending. With --disable-cuda-graph-padding only exact sizes replay.
    """
    if batch_size < 1:
        return None
    i = bisect.bisect_left(captured, batch_size)
    if i == len(captured):
        return None
    if disable_padding and captured[i] != batch_size:
        return None
    return captured[i]


def _tree_cols(fb: ForwardBatch) -> int:
    return fb.custom_mask.shape[1] if fb.custom_mask is not None else 0


# ---------------------------------------------------------------------- static inputs
class StaticInputs:
    """The input buffers every graph reads, sized for the largest key."""

    def __init__(
        self,
        max_bs: int,
        max_tokens_per_req: int,
        device: torch.device | str,
        dp_size: Optional[int] = None,
        max_tree_cols: int = 0,
        spec_info_layouts: Sequence[SpecInfoLayout] = (),
        max_ragged_tokens: int = 0,
    ):
        """dp_size: DP attention's rank count (every rank contributes the same padded rows);
        max_tree_cols: widest tree mask; spec_info_layouts: those of the captured modes;
        max_ragged_tokens: the largest token bucket of the ragged modes."""
        self.dp_size = dp_size
        max_tokens = max_bs * max_tokens_per_req
        self.device = device
        # One int64 buffer, so that a load copies all its rows at once: per token (input id,
        # position, KV slot), then per request in the first max_bs columns (table row,
        # seq_len, extend_len).
        columns = max(max_tokens, max_ragged_tokens, max_bs)
        self.int_rows = torch.empty((_INT_ROWS, columns), dtype=torch.int64, device=device)
        self.pad_columns: dict[tuple[int, int], torch.Tensor] = {}  # see _pad_column
        self.int_rows.copy_(self._pad_column(max_tokens_per_req, max_tokens_per_req).expand_as(self.int_rows))
        self.input_ids, self.positions, self.out_cache_loc = self.int_rows[:_TOKEN_ROWS]
        self.req_pool_indices, self.seq_lens, self.extend_seq_lens = self.int_rows[_TOKEN_ROWS:, :max_bs]
        self.logits_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.custom_mask = torch.ones(max_tokens * max_tree_cols, dtype=torch.bool, device=device)
        # One buffer per spec_info attribute (of a shape and dtype), for every mode that carries it.
        self.spec_buffers = {
            f: torch.zeros((columns, *f[1]), dtype=f[2], device=device) for layout in spec_info_layouts for f in layout.fields
        }

    def load(self, fb: ForwardBatch, key: GraphKey, mode: CapturedMode) -> ForwardBatch:
        """Copy fb into the buffers, pad rows fb.batch_size..key.batch_size, and return the
        padded batch as a ForwardBatch over the buffers (host lengths padded too)."""
        self.fill(fb, key, mode)
        pad_seq_lens, pad_extend_lens = key.padding_lengths(fb.batch_size, fb.num_tokens)
        return replace(
            self.batch(key, mode),
            seq_lens_cpu=list(fb.seq_lens_cpu) + pad_seq_lens,
            extend_seq_lens_cpu=list(fb.extend_seq_lens_cpu) + pad_extend_lens,
        )

    def fill(self, fb: ForwardBatch, key: GraphKey, mode: CapturedMode) -> None:
        """load without building the padded batch (what a replay needs)."""
        bs, n = fb.batch_size, fb.num_tokens
        # An IDLE batch (DP attention) has no rows to copy: everything is padding.
        if bs and mode.slots_only:
            self.out_cache_loc[:n].copy_(fb.out_cache_loc)
            self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        elif bs:
            tokens = (fb.input_ids, fb.positions, fb.out_cache_loc)
            requests = (fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens)
            if n == bs:  # one token per request: every row in one copy
                self.int_rows[:, :bs].copy_(torch.stack(tokens + requests))
            else:
                self.int_rows[:_TOKEN_ROWS, :n].copy_(torch.stack(tokens))
                self.int_rows[_TOKEN_ROWS:, :bs].copy_(torch.stack(requests))
            if key.tree_cols:
                self.custom_mask[: n * key.tree_cols].copy_(fb.custom_mask.flatten())
            for f, buffer in self._spec_buffers(mode):
                buffer[:n].copy_(getattr(fb.spec_info, f[0]))
            if mode.logits_at_rows:
                self.logits_indices[:bs].copy_(fb.logits_indices)
        self._pad(key, mode, bs, n)

    def padding_batch(self, key: GraphKey, mode: CapturedMode) -> ForwardBatch:
        """A batch of key's shape holding padding rows only (what a graph is captured with).
        The buffers may hold another key's rows (lengths of another token count): all are reset."""
        self._pad(key, mode, 0, 0)
        return self.batch(key, mode)

    def _pad(self, key: GraphKey, mode: CapturedMode, rows: int, tokens: int) -> None:
        """Fill requests rows..key.batch_size (tokens tokens..key.num_tokens) with padding."""
        bs, n, tpr = key.batch_size, key.num_tokens, key.tokens_per_req
        if rows == bs and tokens == n:  # nothing to pad
            return
        column = self._pad_column(key.pad_seq_len, tpr)
        if n == bs and not key.ragged_tokens:  # one token per request: token and request rows pad the same columns
            self.int_rows[:, rows:bs].copy_(column.expand(-1, bs - rows))
        else:
            self.int_rows[:_TOKEN_ROWS, tokens:n].copy_(column[:_TOKEN_ROWS].expand(-1, n - tokens))
            self.int_rows[_TOKEN_ROWS:, rows:bs].copy_(column[_TOKEN_ROWS:].expand(-1, bs - rows))
        if key.ragged_tokens and tokens < n:  # the padding request: seq_len = extend_len = its tokens
            self.int_rows[_TOKEN_ROWS + 1 :, rows].fill_(n - tokens)
        if key.tree_cols:  # padded rows see their whole (padding) tree
            self.custom_mask[tokens * key.tree_cols : n * key.tree_cols].fill_(True)
        for _, buffer in self._spec_buffers(mode):
            buffer[tokens:n].zero_()
        if mode.logits_at_rows:  # a padded request's logits row: its own last token
            pad = torch.arange(rows, bs, device=self.logits_indices.device)
            self.logits_indices[rows:bs].copy_(pad * tpr + tpr - 1)

    def _spec_buffers(self, mode: CapturedMode) -> list[tuple[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor]]:
        """(field, buffer) of each spec_info attribute the mode's batches carry."""
        return [] if mode.spec_info is None else [(f, self.spec_buffers[f]) for f in mode.spec_info.fields]

    def _spec_info(self, n: int, mode: CapturedMode) -> Any:
        """The spec_info over the buffers' first n rows (None for a mode without one)."""
        if mode.spec_info is None:
            return None
        return mode.spec_info.make(**{f[0]: buffer[:n] for f, buffer in self._spec_buffers(mode)})

    def _pad_column(self, seq_len: int, tokens_per_req: int) -> torch.Tensor:
        """A padded row's int_rows column [6, 1]: token 0 at position 0 writing the dummy slot,
        request row 0, the given seq_len and extend_len = tokens per request. Made on first use,
        which is at capture, so that a replay uploads nothing."""
        column = self.pad_columns.get((seq_len, tokens_per_req))
        if column is None:
            values = [PAD_TOKEN_ID, 0, PAD_KV_SLOT, PAD_REQ_ROW, seq_len, tokens_per_req]
            column = torch.tensor(values, dtype=torch.int64, device=self.device).view(_INT_ROWS, 1)
            self.pad_columns[(seq_len, tokens_per_req)] = column
        return column

    def batch(self, key: GraphKey, mode: CapturedMode) -> ForwardBatch:
        """The buffers' first rows as the batch a graph of `key` was captured with (of a
        slots-only mode: its table rows and KV slots alone, as its eager batch has)."""
        bs, n = key.batch_size, key.num_tokens
        tokens, requests = (0, 0) if mode.slots_only else (n, bs)
        seq_lens_cpu, extend_seq_lens_cpu = key.padding_lengths(0, 0)
        return ForwardBatch(
            mode=key.mode,
            batch_size=bs,
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            out_cache_loc=self.out_cache_loc[:n],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:requests],
            extend_seq_lens=self.extend_seq_lens[:requests],
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            custom_mask=self.custom_mask[: n * key.tree_cols].view(n, key.tree_cols) if key.tree_cols else None,
            capture_hidden_mode=mode.capture_hidden,
            logits_indices=self.logits_indices[:bs] if mode.logits_at_rows else None,
            spec_info=self._spec_info(n, mode),
            global_num_tokens=None if self.dp_size is None else [n] * self.dp_size,
            global_forward_mode=None if self.dp_size is None else key.mode,
        )


# ---------------------------------------------------------------------- runner
class CudaGraphRunner:
    """Captures one graph per key and replays the one a batch fits."""

    def __init__(
        self,
        model_runner: ModelRunner,
        modes: dict[ModeKey, CapturedMode],
        batch_sizes: Sequence[int],
        disable_padding: bool,
        dp_size: Optional[int] = None,
    ):
        """modes: how each captured mode is captured; batch_sizes: per-rank sizes (identical
        on every rank); dp_size: set under DP attention."""
        if not batch_sizes:
            raise ValueError("no CUDA graph batch sizes to capture")
        self.model_runner = model_runner
        self.modes = dict(modes)
        self.batch_sizes = sorted(batch_sizes)
        self.disable_padding = disable_padding
        self.keys = [key for m, spec in self.modes.items() for key in self._mode_keys(m, spec)]
        self.max_bs = max(key.batch_size for key in self.keys)  # the most request rows of any key
        self.max_tokens_per_req = max(spec.tokens_per_req for spec in self.modes.values())
        self.inputs = StaticInputs(
            self.max_bs,
            self.max_tokens_per_req,
            model_runner.device,
            dp_size,
            max(cols for spec in self.modes.values() for cols in spec.tree_cols),
            list(dict.fromkeys(spec.spec_info for spec in self.modes.values() if spec.spec_info is not None)),
            max((key.ragged_tokens for key in self.keys), default=0),
        )
        # Graphs bake in this table's address; a batch over a replaced table runs eagerly.
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        # Per mode, the static buffers its graphs copy their outputs into, each with its rows
        # per request (sized for the largest batch; a replay's outputs are their first rows).
        self.outputs: dict[ModeKey, list[tuple[torch.Tensor, int]]] = {}
        self.num_replays = 0  # idle DP ranks replay too: they count here
        # GPU memory the capture took per group (CapturedMode.group), in capture order: a
        # group's figure is what it added to the groups captured before it.
        self.capture_mib: dict[int, float] = {}

    def _mode_keys(self, mode_key: ModeKey, spec: CapturedMode) -> list[GraphKey]:
        """The keys captured for a mode: one per token bucket of a ragged mode, else one per tree
        width and batch size."""
        if spec.ragged is not None:
            return [
                GraphKey(mode_key.mode, spec.ragged.rows(t), 0, 0, mode_key.program, ragged_tokens=t) for t in spec.ragged.buckets
            ]
        return [
            GraphKey(mode_key.mode, b, spec.tokens_per_req, cols, mode_key.program)
            for cols in spec.tree_cols
            for b in self.batch_sizes
        ]

    # ------------------------------------------------------------------ choice
    def key_for(self, fb: ForwardBatch, program: Optional[GraphProgram] = None) -> Optional[GraphKey]:
        """The captured key that replays fb run by `program` (None: one model forward), or None.
        Host values only."""
        if fb.req_to_token_pool.req_to_token is not self.req_to_token:
            return None
        if fb.global_num_tokens is not None:
            global_mode = self.modes.get(ModeKey(fb.global_forward_mode, program)) if fb.global_forward_mode else None
            if global_mode is not None and global_mode.ragged is not None:
                return self._dp_ragged_key(fb, global_mode, program)
            key = self.dp_key(fb.global_forward_mode, fb.global_num_tokens, _tree_cols(fb), program)
            fits = (
                key is not None
                and fb.mode in (key.mode, ForwardMode.IDLE)
                and fb.num_tokens == fb.batch_size * key.tokens_per_req
                and self._matches(fb, self.modes[key.mode_key], key.tree_cols)
            )
            return key if fits else None
        mode = self.modes.get(ModeKey(fb.mode, program))
        if mode is not None and mode.ragged is not None:
            return self._ragged_key(fb, mode, program)
        if mode is None or fb.batch_size < 1 or fb.num_tokens != fb.batch_size * mode.tokens_per_req:
            return None
        tree_cols = _tree_cols(fb)
        if tree_cols not in mode.tree_cols or not self._matches(fb, mode, tree_cols):
            return None
        bs = padded_batch_size(fb.batch_size, self.batch_sizes, self.disable_padding)
        return None if bs is None else GraphKey(fb.mode, bs, mode.tokens_per_req, tree_cols, program)

    def _ragged_key(self, fb: ForwardBatch, mode: CapturedMode, program: Optional[GraphProgram]) -> Optional[GraphKey]:
        """The key of the smallest token bucket that holds fb's tokens and requests, or None."""
        if _tree_cols(fb) or not self._matches(fb, mode, 0):
            return None
        tokens = mode.ragged.bucket_for(fb.num_tokens, fb.batch_size)
        if tokens is None:
            return None
        return GraphKey(fb.mode, mode.ragged.rows(tokens), 0, 0, program, ragged_tokens=tokens)

    def _dp_ragged_key(self, fb: ForwardBatch, mode: CapturedMode, program: Optional[GraphProgram]) -> Optional[GraphKey]:
        """DP attention, a prefill iteration: the token bucket every rank replays, chosen from
        the plan alone (the smallest that holds every DP rank's batch; an idle rank's is the
        padding request alone), or None (every rank eager). A rank that decodes in this
        iteration replays it too: its requests extend by one token each. `_matches` reads this
        rank's batch only; every rank agrees on it because hidden capture, spec inputs and
        logits rows are server-wide settings, and prompt logprobs, the one per-rank difference,
        reach every rank through the plan (all eager)."""
        reqs = fb.global_num_reqs
        if self.inputs.dp_size is None or reqs is None or not self._matches(fb, mode, 0) or _tree_cols(fb):
            return None
        if fb.mode not in (fb.global_forward_mode, ForwardMode.DECODE, ForwardMode.IDLE):
            return None
        tokens = mode.ragged.bucket_for_all(list(zip(fb.global_num_tokens, reqs)))
        if tokens is None:
            return None
        return GraphKey(fb.global_forward_mode, mode.ragged.rows(tokens), 0, 0, program, ragged_tokens=tokens)

    @staticmethod
    def _matches(fb: ForwardBatch, mode: CapturedMode, tree_cols: int) -> bool:
        """fb has exactly the inputs and outputs the mode's graphs were captured with (no mode
        captures prompt logprobs)."""
        if fb.mode == ForwardMode.IDLE:  # zero rows: only its DP sizes matter
            return True
        return (
            fb.input_logprob_rows is None
            and (fb.custom_mask is not None) == (tree_cols > 0)
            and fb.capture_hidden_mode == mode.capture_hidden
            and (fb.spec_info is not None) == (mode.spec_info is not None)
            and (fb.logits_indices is not None) == mode.logits_at_rows
        )

    def dp_key(
        self,
        global_mode: Optional[ForwardMode],
        global_num_tokens: Sequence[int],
        tree_cols: int = 0,
        program: Optional[GraphProgram] = None,
    ) -> Optional[GraphKey]:
        """DP attention: the key every rank replays in this forward, from the plan alone (so all
        ranks choose alike; tree_cols and the program too are the same on every rank, idle ones
        included): the graph of the largest DP rank's batch, or None (all eager)."""
        mode = self.modes.get(ModeKey(global_mode, program)) if global_mode is not None else None
        if self.inputs.dp_size is None or mode is None or mode.ragged is not None or tree_cols not in mode.tree_cols:
            return None
        tpr = mode.tokens_per_req
        if any(n % tpr for n in global_num_tokens):
            return None
        bs = padded_batch_size(max(global_num_tokens) // tpr, self.batch_sizes, self.disable_padding)
        return None if bs is None else GraphKey(global_mode, bs, tpr, tree_cols, program)

    # ------------------------------------------------------------------ capture
    def group(self, key: GraphKey) -> int:
        return self.modes[key.mode_key].group

    def capture_order(self) -> list[GraphKey]:
        """Largest group first, and in each group the largest key first (later, smaller graphs
        reuse the pool's memory)."""
        return sorted(self.keys, key=lambda k: (self.group(k), k.num_tokens, k.tree_cols, k.batch_size), reverse=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every key (capture_order) into one memory pool; log progress and the memory
        each group took."""
        runner = self.model_runner
        device = torch.device(runner.device)
        runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.req_to_token.shape[1], device)
        torch.cuda.synchronize(device)
        free_before = free = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        ordered = self.capture_order()
        for i, key in enumerate(ordered):
            try:
                self.graphs[key] = self._capture_one(key, pool, stream)
            except torch.OutOfMemoryError as e:
                free = torch.cuda.mem_get_info(device)[0]
                smaller = (
                    "Lower --piecewise-cuda-graph-max-tokens (or pass --disable-piecewise-cuda-graph)"
                    if key.ragged_tokens
                    else "Lower --cuda-graph-max-bs"
                )
                raise CudaGraphCaptureError(
                    f"Out of GPU memory capturing CUDA graph {key} ({i}/{len(ordered)} done, "
                    f"{free / _MIB:.0f} MiB free). {smaller}, lower "
                    f"--mem-fraction-static, or pass --disable-cuda-graph."
                ) from e
            logger.info("Captured CUDA graph %d/%d: %s", i + 1, len(ordered), key)
            if i + 1 == len(ordered) or self.group(ordered[i + 1]) != self.group(key):  # the group's last graph
                torch.cuda.synchronize(device)
                free, before = torch.cuda.mem_get_info(device)[0], free
                self.capture_mib[self.group(key)] = (before - free) / _MIB
        groups = ", ".join(f"{group}: {mib:.0f} MiB" for group, mib in self.capture_mib.items() if group)
        buckets = sorted(key.ragged_tokens for key in self.keys if key.ragged_tokens)
        logger.info(
            "CUDA graphs: %d captured (batch sizes %s,%s modes %s) in %.1f s, %.0f MiB of GPU memory%s",
            len(ordered),
            self.batch_sizes,
            f" prefill token buckets {buckets}," if buckets else "",
            sorted({m.mode.name for m in self.modes}),
            time.perf_counter() - start,
            (free_before - free) / _MIB,
            f" (per group: {groups})" if groups else "",
        )

    def captured_forward(
        self, fb: ForwardBatch, runner: Optional[ModelRunner] = None, max_extend_len: Optional[int] = None
    ) -> LogitsProcessorOutput:
        """One forward as a graph holds it: metadata from device tensors, then the model (of
        this runner, or of `runner`, whose backend has its graph state from its own capture).
        The longest query: max_extend_len (a ragged key's bucket), else the tokens per request
        (every uniform batch gives each request the same number)."""
        runner = runner or self.model_runner
        runner.attach(fb)
        runner.attn_backend.init_forward_metadata_graph(fb, max_extend_len or fb.num_tokens // fb.batch_size)
        return runner.model.forward(fb.input_ids, fb.positions, fb)

    def _run(self, fb: ForwardBatch, key: GraphKey) -> tuple[torch.Tensor, ...]:
        """The captured work of key's mode: its program, or one forward (logits[, hidden])."""
        if key.program is not None:
            return key.program(fb, self.captured_forward)
        out = self.captured_forward(fb, max_extend_len=key.ragged_tokens or None)
        return (out.next_token_logits,) if out.hidden_states is None else (out.next_token_logits, out.hidden_states)

    def ensure_outputs(self, key: GraphKey, warm: tuple[torch.Tensor, ...]) -> None:
        """The static output buffers of key's mode, shaped after a warm-up run's outputs (rows
        for the mode's largest key), each with its rows per request; 0: a row per token (the
        mode's per_token_outputs)."""
        if key.mode_key in self.outputs:
            return
        keys = [k for k in self.keys if k.mode_key == key.mode_key]
        per_token = self.modes[key.mode_key].per_token_outputs
        buffers = []
        for i, t in enumerate(warm):
            if i in per_token:
                rows, per_req = max(k.num_tokens for k in keys), 0
            else:
                per_req = t.shape[0] // key.batch_size
                rows = max(k.batch_size for k in keys) * per_req
            buffers.append((t.new_empty((rows, *t.shape[1:])), per_req))
        self.outputs[key.mode_key] = buffers

    def _capture_one(self, key: GraphKey, pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        fb = self.inputs.padding_batch(key, self.modes[key.mode_key])
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels and create library workspaces outside the capture
                warm = self._run(fb, key)
        torch.cuda.current_stream().wait_stream(stream)
        self.ensure_outputs(key, warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.run_into_outputs(fb, key)
        return graph

    def run_into_outputs(self, fb: ForwardBatch, key: GraphKey) -> None:
        """What a graph holds: the captured work, its outputs copied into the static buffers."""
        for (buffer, _), out in zip(self.outputs[key.mode_key], self._run(fb, key)):
            buffer[: out.shape[0]].copy_(out)

    # ------------------------------------------------------------------ replay
    def replay(self, fb: ForwardBatch, key: GraphKey) -> Union[LogitsProcessorOutput, tuple[torch.Tensor, ...]]:
        """Run fb through the graph of key (from key_for); outputs are fresh tensors (views
        under `outputs_as_views`): the program's outputs, or the forward's logits (and hidden states)."""
        mode = self.modes[key.mode_key]
        self.inputs.fill(fb, key, mode)
        self.graphs[key].replay()
        self.num_replays += 1
        record_graph_replay(key)
        outs = tuple(buffer[: fb.batch_size * per_req or fb.num_tokens] for buffer, per_req in self.outputs[key.mode_key])
        if not mode.outputs_as_views:
            outs = tuple(t.clone() for t in outs)
        if key.program is not None:
            return outs
        return LogitsProcessorOutput(next_token_logits=outs[0], hidden_states=outs[1] if len(outs) > 1 else None)
