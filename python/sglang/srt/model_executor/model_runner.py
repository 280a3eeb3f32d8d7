"""Owns one model on one device: weights, KV memory, attention backend, and the forward call."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from sglang.srt.batch.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import init_ipc_collectives, max_over_ranks, min_over_ranks
from sglang.srt.layers.attention import create_attention_backend
from sglang.srt.layers.attention.base import AttentionBackend
from sglang.srt.layers.dp_attention import gathered_buffer_rows
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import (
    KVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from sglang.srt.model_executor.cuda_graph_runner import (
    CapturedMode,
    CudaGraphRunner,
    ForwardFn,
    GraphCapturableBackend,
    GraphProgram,
    ModeKey,
    capture_batch_sizes,
)
from sglang.srt.model_executor.prefill_graphs import SERVER_PREFILL_BUCKETS, RaggedTokens, prefill_ragged_tokens
from sglang.srt.model_loader import get_model
from sglang.srt.sampling.sampler import greedy_tokens
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The KV pool's size on CPU unless --max-total-tokens says otherwise.
_CPU_KV_BUDGET_BYTES = 1 << 30
_CPU_MAX_KV_TOKENS = 1 << 16
_GIB = 1 << 30
# IPC collective slots when NCCL can take larger messages (ranks on separate GPUs).
_IPC_SLOT_CAP_BYTES = 64 << 20


def ipc_slot_bytes(args: ServerArgs, local_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int]:
    """Data-slot bytes of the TP group's and the attention-TP group's IPC buffers: the largest
    message each sends (the MLP's all-reduce over every DP rank's rows under DP attention; the
    attention-TP group's row-parallel outputs and vocabulary-sharded logits), or
    --custom-collective-buffer-mb. Ranks on separate GPUs cap the slots (NCCL takes larger
    messages); ranks sharing a GPU have no NCCL, so a given size too small is an error."""
    vocab_part = -(-vocab // args.attn_tp_size)
    attn_bytes = local_rows * max(hidden, vocab_part) * itemsize
    tp_bytes = local_rows * args.dp_size * hidden * itemsize if args.enable_dp_attention else attn_bytes
    if args.custom_collective_buffer_mb is not None:
        given = int(args.custom_collective_buffer_mb * (1 << 20))
        largest = max(tp_bytes, attn_bytes)
        if args.ranks_share_gpu and given < largest:
            raise ValueError(
                f"--custom-collective-buffer-mb {args.custom_collective_buffer_mb} is too small for ranks sharing "
                f"a GPU: the largest collective message is {largest / (1 << 20):.2f} MiB (raise it, or lower "
                f"--chunked-prefill-size / --max-running-requests)"
            )
        return given, given
    if args.ranks_share_gpu:
        return tp_bytes, attn_bytes
    return min(tp_bytes, _IPC_SLOT_CAP_BYTES), min(attn_bytes, _IPC_SLOT_CAP_BYTES)


def greedy_decode(fb: ForwardBatch, forward: ForwardFn) -> tuple[torch.Tensor]:
    """A decode forward and its greedy tokens as one program: a batch whose every request
    takes the argmax of its logits (no logits adjustments, no logprobs) needs nothing else of
    the step, so its graph replay hands back only the tokens."""
    return (greedy_tokens(forward(fb).next_token_logits),)


# A plain model's runner: one-token decode (logits, or a greedy batch's tokens), and its
# prefill (logits of each request's last row).
PLAIN_GRAPH_MODES = {
    ModeKey(ForwardMode.DECODE): CapturedMode(1),
    ModeKey(ForwardMode.DECODE, greedy_decode): CapturedMode(1),
    ModeKey(ForwardMode.EXTEND): CapturedMode(0, ragged=SERVER_PREFILL_BUCKETS),
}


@dataclass(frozen=True)
class RunnerShapes:
    """What a runner sizes beyond one token per request and the context (the defaults)."""

    tokens_per_request: int = 1  # most rows one request feeds a forward outside prefill
    table_extra_columns: int = 0  # request->token table columns a request may use past the context
    kv_layers_sharing_slots: int = 0  # KV layers of another runner's pool on this runner's slots


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        server_args: ServerArgs,
        gpu_id: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        req_to_token_pool: Optional[ReqToTokenPool] = None,
        token_allocator: Optional[TokenToKVPoolAllocator] = None,
        gathered_buffer: Optional[torch.Tensor] = None,
        embed_and_head: Optional[tuple[nn.Parameter, nn.Parameter]] = None,
        head_vocab: Optional[torch.Tensor] = None,
        shapes: RunnerShapes = RunnerShapes(),
        graph_modes: Optional[dict[ModeKey, CapturedMode]] = None,
        open_ipc_collectives: bool = True,
    ):
        """A runner that shares another's KV slots passes its req_to_token_pool and allocator,
        under DP attention its gathered buffer (one buffer per rank), and the embedding and LM
        head its model uses instead of its own (all in place before capture); head_vocab: a
        shard_token_subset layout its LM head is restricted to (CausalLM.restrict_head). graph_modes: what
        its CUDA graphs capture (default: PLAIN_GRAPH_MODES); a mode at SERVER_PREFILL_BUCKETS
        is captured at the server's prefill buckets. open_ipc_collectives: False when
        another runner of the process has opened the IPC buffers, sized for its forwards and
        this one's."""
        self.model_config = model_config
        self.server_args = server_args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shapes = shapes
        self.graph_modes = PLAIN_GRAPH_MODES if graph_modes is None else graph_modes
        # KV heads are sharded over the attention-TP group (all of TP unless DP attention).
        self.attn_tp_size = server_args.attn_tp_size
        self.device = f"cuda:{gpu_id}" if server_args.device == "cuda" else "cpu"
        if server_args.device == "cuda":
            torch.cuda.set_device(gpu_id)
        self.dtype = model_config.dtype
        self.attn_backend: AttentionBackend = create_attention_backend(server_args.attention_backend)
        self.model = get_model(model_config, server_args.load_format, self.device, seed=server_args.random_seed)
        if embed_and_head is not None:  # before capture: graphs bake in weight addresses
            self.model.set_embed_and_head(*embed_and_head)
        if head_vocab is not None:
            self.model.restrict_head(head_vocab)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # One KV layer per attention module (a NextN draft has one; its layer id is 0).
        self.num_kv_layers = sum(isinstance(m, RadixAttention) for m in self.model.modules())
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        self.max_total_num_tokens = self._profile_max_num_tokens(token_allocator)
        self.max_running_requests = self._max_running_requests()
        self.req_to_token_pool = req_to_token_pool or ReqToTokenPool(
            self.max_running_requests, model_config.context_len + max(8, shapes.table_extra_columns), self.device
        )
        self.token_allocator = token_allocator or TokenToKVPoolAllocator(self.max_total_num_tokens)
        self.kv_pool = self._make_kv_pool()
        if open_ipc_collectives:
            self._init_ipc_collectives()
        self.gathered_buffer = gathered_buffer
        if server_args.enable_dp_attention and gathered_buffer is None:
            self.gathered_buffer = self._make_gathered_buffer()
        logger.info(
            "KV cache: %d tokens, %.1f KiB per token, %.2f GiB total; max running requests %d",
            self.max_total_num_tokens,
            self.kv_bytes_per_token / 1024,
            self.max_total_num_tokens * self.kv_bytes_per_token / _GIB,
            self.max_running_requests,
        )
        self._warm_up_moe_kernels()
        # Captured last: graphs bake in the addresses of the weights, KV pool and buffers above.
        self.graph_runner = self._make_graph_runner()

    # ------------------------------------------------------------------ memory
    def _kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        itemsize = self.dtype.itemsize
        if cfg.is_mla:
            return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize * self.num_kv_layers
        kv_heads = cfg.get_num_kv_heads(self.attn_tp_size)
        return 2 * kv_heads * cfg.head_dim * itemsize * self.num_kv_layers

    def _profile_max_num_tokens(self, shared_allocator: Optional[TokenToKVPoolAllocator]) -> int:
        if shared_allocator is not None:
            return shared_allocator.size
        if self.server_args.device == "cuda" and self.server_args.ranks_per_gpu > 1:
            # Ranks sharing the GPU load at the same time, so free memory says nothing about
            # this rank: each takes its share of the static fraction, less what it holds.
            total = torch.cuda.mem_get_info()[1]
            share = total * self.server_args.mem_fraction_static / self.server_args.ranks_per_gpu
            budget = share - torch.cuda.memory_reserved()
            if budget <= 0:
                raise RuntimeError(
                    f"Not enough GPU memory for the KV cache: {self.server_args.ranks_per_gpu} ranks share the GPU, "
                    f"{share / _GIB:.1f} GiB each by --mem-fraction-static; raise it"
                )
        elif self.server_args.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            budget = free - total * (1 - self.server_args.mem_fraction_static)
            if budget <= 0:
                raise RuntimeError(
                    f"Not enough GPU memory for the KV cache after loading weights "
                    f"({free / _GIB:.1f} GiB free); raise --mem-fraction-static"
                )
        else:
            budget = min(_CPU_KV_BUDGET_BYTES, _CPU_MAX_KV_TOKENS * self.kv_bytes_per_token)
        # Another runner's KV pool on the same slots (shapes.kv_layers_sharing_slots) makes each
        # slot pay for its layers too.
        layers = self.num_kv_layers + self.shapes.kv_layers_sharing_slots
        per_token = self.kv_bytes_per_token * layers / self.num_kv_layers
        tokens = int(budget // per_token)
        if self.server_args.max_total_tokens is not None:
            tokens = min(tokens, self.server_args.max_total_tokens)
        if tokens < 16:
            raise RuntimeError(f"KV cache too small ({tokens} tokens); raise --mem-fraction-static")
        return tokens

    def _max_running_requests(self) -> int:
        if self.server_args.max_running_requests is not None:
            return self.server_args.max_running_requests
        cap = 4096 if self.server_args.device == "cuda" else 128
        own = max(1, min(cap, self.max_total_num_tokens // 2))
        if self.server_args.enable_dp_attention:
            # Every rank sizes the gathered buffer and its CUDA graphs from it: the cap, which
            # follows each rank's free memory, is agreed at its minimum (one startup collective).
            return min_over_ranks(own)
        return own

    def _make_kv_pool(self) -> KVPool:
        cfg = self.model_config
        size = self.token_allocator.size
        if cfg.is_mla:
            return MLATokenToKVPool(size, self.dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim, self.num_kv_layers, self.device)
        kv_heads = cfg.get_num_kv_heads(self.attn_tp_size)
        return MHATokenToKVPool(size, self.dtype, kv_heads, cfg.head_dim, self.num_kv_layers, self.device)

    def _init_ipc_collectives(self) -> None:
        """The IPC buffers of this replica's groups, sized for the largest message the model
        sends (agreed across ranks): under DP attention the MLP's all-reduce over every rank's
        rows; the attention-TP group's row-parallel outputs and vocabulary-sharded logits."""
        args = self.server_args
        if args.device != "cuda" or args.tp_size == 1 or args.disable_custom_all_reduce:
            return
        if args.nnodes > 1:
            logger.info("IPC collectives off: the replica spans %d nodes (NCCL only)", args.nnodes)
            return
        gpus = sorted({args.base_gpu_id + i * args.gpu_id_step for i in range(args.tp_size)})
        if any(not torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b):
            logger.info("IPC collectives off: GPUs %s lack peer access (NCCL only)", gpus)
            return
        local_rows = max(self.prefill_token_budget(), self.max_running_requests * self.shapes.tokens_per_request)
        cfg = self.model_config
        tp_bytes, attn_bytes = ipc_slot_bytes(
            args, max_over_ranks(local_rows), cfg.hidden_size, cfg.vocab_size, self.dtype.itemsize
        )
        init_ipc_collectives(tp_bytes, attn_bytes, torch.device(self.device))

    def _make_gathered_buffer(self) -> torch.Tensor:
        """The one DP-attention gather buffer of this rank, sized for its largest forward (and
        those of the runners it is passed to)."""
        args = self.server_args
        tokens_per_request = self.shapes.tokens_per_request
        rows = gathered_buffer_rows(self.max_running_requests, tokens_per_request, self.prefill_token_budget(), args.dp_size)
        hidden = self.model_config.hidden_size
        buffer = torch.empty((rows, hidden), dtype=self.dtype, device=self.device)
        logger.info(
            "DP attention gathered buffer: %d rows x %d hidden = %d bytes (%.1f MiB) "
            "(rows = max(max_running_requests %d x tokens/request %d, prefill budget %d) x dp_size %d)",
            rows,
            hidden,
            buffer.numel() * buffer.element_size(),
            buffer.numel() * buffer.element_size() / (1 << 20),
            self.max_running_requests,
            tokens_per_request,
            self.prefill_token_budget(),
            args.dp_size,
        )
        return buffer

    def prefill_token_budget(self) -> int:
        """Most tokens one prefill batch of this rank can feed the model."""
        args = self.server_args
        chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.max_prefill_tokens
        return min(chunk, args.max_prefill_tokens)

    def _warm_up_moe_kernels(self) -> None:
        """Compile every expert-kernel variant an eager batch can meet (prefills, and under DP
        attention the MoE over every rank's rows) before serving; layers of one shape share them."""
        args = self.server_args
        max_tokens = self.prefill_token_budget() * (args.dp_size if args.enable_dp_attention else 1)
        done, batches = set(), 0
        for moe in (m for m in self.model.modules() if isinstance(m, FusedMoE)):
            shape = (moe.w13_weight.shape, moe.w2_weight.shape, moe.w13_weight.dtype, moe.routing.slots)
            if shape not in done:
                done.add(shape)
                batches += moe.warm_up_kernels(max_tokens)
        if batches:
            logger.info("MoE kernels warmed up: %d batch sizes for %d expert shape(s)", batches, len(done))

    # ------------------------------------------------------------------ CUDA graphs
    def _graph_modes(self) -> dict[ModeKey, CapturedMode]:
        """The modes captured in CUDA graphs (empty: no graphs): graph_modes, their prefill
        modes at the prefill buckets (prefill_graphs.py; off under --disable-piecewise-cuda-graph)."""
        args = self.server_args
        if args.disable_cuda_graph or args.device != "cuda":
            return {}
        if not isinstance(self.attn_backend, GraphCapturableBackend):
            logger.info("CUDA graphs off: --attention-backend %s cannot be captured", args.attention_backend)
            return {}
        return self.captured_modes(prefill_ragged_tokens(args, self.prefill_graph_token_limit(), self.max_running_requests))

    def captured_modes(self, prefill: Optional[RaggedTokens]) -> dict[ModeKey, CapturedMode]:
        """graph_modes with `prefill`'s buckets in the modes at SERVER_PREFILL_BUCKETS (None:
        those modes are left out)."""
        modes = {}
        for key, mode in self.graph_modes.items():
            if mode.ragged != SERVER_PREFILL_BUCKETS:
                modes[key] = mode
            elif prefill is not None:
                modes[key] = replace(mode, ragged=prefill)
        return modes

    def prefill_graph_token_limit(self) -> int:
        """The largest prefill graph worth capturing: one prefill batch's tokens, at most one
        request->token table row (a padding request's KV indices are read from one row)."""
        return min(self.prefill_token_budget(), self.req_to_token_pool.req_to_token.shape[1])

    def _make_graph_runner(self) -> Optional[CudaGraphRunner]:
        modes = self._graph_modes()
        if not modes:
            return None
        args = self.server_args
        # Under DP attention every rank captures the same sizes (the replayed graph is chosen
        # from the plan): max_running_requests is agreed across ranks.
        sizes = capture_batch_sizes(args.cuda_graph_bs, args.cuda_graph_max_bs, self.max_running_requests)
        if not sizes:
            logger.info("CUDA graphs off: no batch size to capture")
            return None
        dp_size = args.dp_size if args.enable_dp_attention else None
        runner = CudaGraphRunner(self, modes, sizes, args.disable_cuda_graph_padding, dp_size)
        runner.capture()
        return runner

    # ------------------------------------------------------------------ forward
    def attach(self, forward_batch: ForwardBatch) -> None:
        """Point the batch at this runner's backend, pools and gathered buffer."""
        forward_batch.attn_backend = self.attn_backend
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.kv_pool
        forward_batch.gathered_buffer = self.gathered_buffer

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Replay a captured graph when the batch fits one, else run eagerly."""
        return self.run(forward_batch)

    @torch.inference_mode()
    def run_program(self, forward_batch: ForwardBatch, program: GraphProgram) -> tuple[torch.Tensor, ...]:
        """Several forwards as one unit (e.g. a draft loop): its graph when the batch fits one
        captured with this program, else the program over eager forwards."""
        return self.run(forward_batch, program)

    def run(self, forward_batch: ForwardBatch, program: Optional[GraphProgram] = None):
        self.attach(forward_batch)
        if self.graph_runner is not None:
            key = self.graph_runner.key_for(forward_batch, program)
            if key is not None:
                return self.graph_runner.replay(forward_batch, key)
        if program is not None:
            return program(forward_batch, self.forward_eager)
        return self.forward_eager(forward_batch)

    @torch.inference_mode()
    def forward_eager(self, forward_batch: ForwardBatch, runner: Optional[ModelRunner] = None) -> LogitsProcessorOutput:
        """One eager forward of this runner's model, or of `runner`'s (a program spanning two
        runners)."""
        runner = runner or self
        runner.attach(forward_batch)
        runner.attn_backend.init_forward_metadata(forward_batch)
        return runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
