"""Server arguments: one dataclass; the argparse parser is generated from its fields.

Each field's metadata carries its help text and, where SGLang has them, extra flag
spellings (e.g. --tp-size for --tensor-parallel-size). argparse's prefix matching stays
on, so `--speculative-algo` resolves to `--speculative-algorithm` as in SGLang.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
# (steps, topk, num_draft_tokens) when none of the three is given.
AUTO_SPECULATIVE_PARAMS = (3, 1, 4)
# --speculative-adaptive's tiers (draft steps) when --speculative-adaptive-steps is not given.
DEFAULT_ADAPTIVE_STEPS = "1,3,5"
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "gguf")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
# Flags that parse but whose feature this engine does not implement: a clear error at startup.
# Each entry: (predicate on ServerArgs, message).
_NOT_SUPPORTED_YET: list[tuple[typing.Callable[[ServerArgs], bool], str]] = []


def _arg(help: str, *, flags: tuple[str, ...] = (), choices: tuple | None = None, **extra) -> dict:
    return {"help": help, "flags": flags, "choices": choices, **extra}


@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: str = field(
        metadata=_arg("Path of the model: an HF directory, a GGUF file, or SmolLM2-135M-Instruct.", required=True)
    )
    tokenizer_path: Optional[str] = field(default=None, metadata=_arg("Path of the tokenizer (defaults to the model path)."))
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=_arg(
            "Load no tokenizer: requests give input_ids, outputs carry output_ids (empty text); the OpenAI endpoints are refused."
        ),
    )
    load_format: str = field(
        default="auto", metadata=_arg("Weight format; 'dummy' makes random weights from the config.", choices=LOAD_FORMATS)
    )
    trust_remote_code: bool = field(default=False, metadata=_arg("Allow custom model code from the hub (configs only here)."))
    dtype: str = field(
        default="auto", metadata=_arg("Weight and activation dtype; auto is bfloat16 on CUDA, float32 on CPU.", choices=DTYPES)
    )
    device: Optional[str] = field(
        default=None, metadata=_arg("cuda or cpu; defaults to cuda when available.", choices=("cuda", "cpu"))
    )
    context_length: Optional[int] = field(default=None, metadata=_arg("Maximum context length (defaults to the model config's)."))
    served_model_name: Optional[str] = field(
        default=None, metadata=_arg("Model name reported by the OpenAI API (defaults to the model path).")
    )
    revision: Optional[str] = field(default=None, metadata=_arg("Accepted for SGLang compatibility; local paths only."))

    # HTTP server
    host: str = field(default="127.0.0.1", metadata=_arg("HTTP host."))
    port: int = field(default=30000, metadata=_arg("HTTP port."))
    api_key: Optional[str] = field(
        default=None,
        metadata=_arg(
            "Require this key as a Bearer token on every endpoint but the probes /health, /health_generate and /metrics; no endpoint returns it."
        ),
    )
    stream_output: bool = field(default=False, metadata=_arg("Stream only the new text of each chunk (SGLang's stream_output)."))
    stream_interval: int = field(
        default=1,
        metadata=_arg(
            "Send a streaming request's new tokens once this many have gathered (its first token at once): fewer, larger chunks."
        ),
    )
    skip_server_warmup: bool = field(
        default=False, metadata=_arg("Skip the warm-up generation at startup: /health answers 200 as soon as HTTP is up.")
    )

    # Memory and scheduling
    mem_fraction_static: Optional[float] = field(default=None, metadata=_arg("Fraction of GPU memory for weights and KV cache."))
    max_total_tokens: Optional[int] = field(
        default=None, metadata=_arg("Size of the KV pool in tokens (overrides the memory-based size).")
    )
    max_running_requests: Optional[int] = field(default=None, metadata=_arg("Maximum running requests per DP rank."))
    chunked_prefill_size: Optional[int] = field(
        default=None, metadata=_arg("Maximum prefill tokens per chunk; -1 disables chunking.")
    )
    max_prefill_tokens: int = field(default=16384, metadata=_arg("Maximum tokens in one prefill batch."))
    schedule_policy: str = field(default="fcfs", metadata=_arg("Request ordering for prefill.", choices=("fcfs", "lpm")))
    disable_radix_cache: bool = field(default=False, metadata=_arg("Turn prefix caching off."))
    page_size: int = field(default=1, metadata=_arg("Tokens per KV page."))
    num_continuous_decode_steps: int = field(
        default=1,
        metadata=_arg(
            "While requests decode, prefill new ones only after this many decode steps (or speculative cycles) in a row since the last prefill; 1 prefills waiting requests at once. Fewer, larger prefills when requests arrive one by one, for up to that many steps more time to first token."
        ),
    )
    enable_mixed_chunk: bool = field(
        default=False,
        metadata=_arg(
            "Run the running requests' decode step in the same forward as a prefill (each running request extends by its one new token), so they keep producing tokens while new requests are prefilled. Under speculative decoding their decode cycle is queued in the same iteration, right after the prefill."
        ),
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata=_arg(
            "Wait for each step's tokens before scheduling the next one (by default the next step, or speculative cycle, is scheduled while the device runs this one)."
        ),
    )
    watchdog_timeout: float = field(
        default=300, metadata=_arg("Seconds a scheduler may be stuck in one step before the server exits.")
    )
    scheduler_stall_timeout: float = field(
        default=20,
        metadata=_arg(
            "/health answers 503 while a scheduler has not finished an iteration for this many seconds (an idle one finishes one every 0.1 s)."
        ),
    )

    # Kernels and CUDA graphs
    attention_backend: Optional[str] = field(
        default=None, metadata=_arg("Attention kernels; triton on CUDA, torch_native on CPU.", choices=ATTENTION_BACKENDS)
    )
    disable_cuda_graph: bool = field(default=False, metadata=_arg("Run every forward eagerly."))
    disable_cuda_graph_padding: bool = field(
        default=False, metadata=_arg("Use CUDA graphs only for batch sizes captured exactly (no padding).")
    )
    cuda_graph_max_bs: Optional[int] = field(default=None, metadata=_arg("Largest per-rank batch size captured in a CUDA graph."))
    cuda_graph_bs: Optional[list[int]] = field(default=None, metadata=_arg("Batch sizes to capture.", nargs="+", type=int))
    disable_piecewise_cuda_graph: bool = field(
        default=False,
        metadata=_arg(
            "Run prefill (extend) forwards eagerly. By default a CUDA server with CUDA graphs also captures prefills at token buckets, attention included: a prefill of up to --piecewise-cuda-graph-max-tokens tokens is one graph replay."
        ),
    )
    enable_piecewise_cuda_graph: Optional[bool] = field(
        default=None,
        metadata=_arg(
            "Prefill CUDA graphs are on by default (see --disable-piecewise-cuda-graph); this flag is accepted for SGLang command lines that still pass it. Resolved: whether prefills are captured."
        ),
    )
    piecewise_cuda_graph_max_tokens: Optional[int] = field(
        default=None,
        metadata=_arg(
            "Largest prefill token count captured (default 2048, or the largest --piecewise-cuda-graph-tokens); larger prefills run eagerly."
        ),
    )
    piecewise_cuda_graph_tokens: Optional[list[int]] = field(
        default=None,
        metadata=_arg(
            "Prefill token buckets to capture (default four per doubling, 64, 80, 96, 112, 128, 160, ... below the max, and the max).",
            nargs="+",
            type=int,
        ),
    )
    enable_nan_detection: bool = field(default=False, metadata=_arg("Detect NaN logits and report them instead of sampling."))

    # Parallelism
    tp_size: int = field(default=1, metadata=_arg("Tensor-parallel size.", flags=("--tensor-parallel-size", "--tp-size")))
    dp_size: int = field(default=1, metadata=_arg("Data-parallel size.", flags=("--data-parallel-size", "--dp-size")))
    enable_dp_attention: bool = field(default=False, metadata=_arg("Data-parallel attention with tensor-parallel MLP/MoE."))
    dp_prefill_align_iters: int = field(
        default=0,
        metadata=_arg(
            "DP attention: a rank with requests to prefill may hold them while its peers decode, for up to this many iterations, until the other ranks want to prefill too, so that one prefill iteration serves several ranks (0: prefill at once)."
        ),
    )
    load_balance_method: Optional[str] = field(
        default=None,
        metadata=_arg(
            "How the DP controller picks a DP rank for each request: ranks in turn, fewest outstanding requests, or fewest outstanding tokens (prompt not yet prefilled plus max_new_tokens not yet generated); defaults to minimum_tokens with --enable-dp-attention, else round_robin.",
            choices=LOAD_BALANCE_METHODS,
        ),
    )
    dist_init_addr: Optional[str] = field(default=None, metadata=_arg("host:port of rank 0 for torch.distributed across nodes."))
    nnodes: int = field(default=1, metadata=_arg("Number of nodes."))
    node_rank: int = field(default=0, metadata=_arg("Rank of this node."))
    base_gpu_id: int = field(
        default=0, metadata=_arg("GPU of this node's first rank; rank r of the node uses GPU base_gpu_id + r * gpu_id_step.")
    )
    gpu_id_step: int = field(
        default=1,
        metadata=_arg(
            "GPU id step between a node's ranks; 0 puts every rank on one GPU (collectives then go through the IPC buffers, never NCCL)."
        ),
    )
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata=_arg("Run every GPU collective through NCCL instead of the IPC buffers between the ranks of one node."),
    )
    custom_collective_buffer_mb: Optional[float] = field(
        default=None,
        metadata=_arg(
            "MiB per data slot of the IPC collective buffers (two slots per group and rank); defaults to the largest message the engine sends, capped at 64 when NCCL can take larger ones."
        ),
    )

    # Speculative decoding
    speculative_algorithm: Optional[str] = field(
        default=None, metadata=_arg("Speculative decoding algorithm.", choices=SPECULATIVE_ALGORITHMS)
    )
    speculative_draft_model_path: Optional[str] = field(
        default=None, metadata=_arg("Draft model path (NEXTN defaults to the target checkpoint).")
    )
    speculative_token_map: Optional[str] = field(
        default=None,
        metadata=_arg(
            "A file of token ids (torch.save of a 1-D tensor or list, e.g. the most frequent tokens): the draft's LM head keeps only their rows and guesses among them; outputs do not change."
        ),
    )
    speculative_num_steps: Optional[int] = field(default=None, metadata=_arg("Draft steps per cycle."))
    speculative_eagle_topk: Optional[int] = field(default=None, metadata=_arg("Branching factor of the draft tree per step."))
    speculative_num_draft_tokens: Optional[int] = field(default=None, metadata=_arg("Tokens verified per request per cycle."))
    speculative_accept_check: bool = field(
        default=False,
        metadata=_arg(
            "At startup, run a fixed prompt set speculatively (with and without CUDA graphs) on every DP rank; fail unless the outputs equal the non-speculative ones and no rank's accept length falls behind the others."
        ),
    )
    speculative_adaptive: bool = field(
        default=False,
        metadata=_arg(
            "Switch the draft steps per cycle between the tiers of --speculative-adaptive-steps by the recent accept length and batch size; every DP rank takes the same decision (topk 1 chains only)."
        ),
    )
    speculative_adaptive_steps: Optional[str] = field(
        default=None,
        metadata=_arg(
            "--speculative-adaptive: the tiers' draft steps, comma-separated (each tier verifies steps + 1 tokens); --speculative-num-steps is the starting tier and must be one of them (default: the largest)."
        ),
    )
    speculative_adaptive_schedule: Optional[str] = field(
        default=None,
        metadata=_arg(
            "Testing: replace the adaptive decision by a fixed schedule of steps:cycles pairs, repeated (e.g. 3:4,1:2,5:3: four decode cycles at 3 steps, two at 1, three at 5, again)."
        ),
    )

    # Observability
    log_level: str = field(default="info", metadata=_arg("Logging level.", choices=("debug", "info", "warning", "error")))
    log_requests: bool = field(default=False, metadata=_arg("Log the metadata of every request."))
    enable_metrics: bool = field(default=False, metadata=_arg("Serve Prometheus metrics at /metrics."))
    random_seed: Optional[int] = field(default=None, metadata=_arg("Seed for weight init (dummy) and sampling."))
    decode_log_interval: int = field(default=40, metadata=_arg("Log a decode line every this many decode steps."))
    debug_collectives: bool = field(
        default=False, metadata=_arg("Check every step that all ranks agree on the batch plan and on what each collective moved.")
    )

    def __post_init__(self) -> None:
        self._resolve_defaults()
        self.check()

    # ------------------------------------------------------------------ defaults
    def _resolve_defaults(self) -> None:
        if self.device is None:
            self.device = "cuda" if _cuda_available() else "cpu"
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        default_backend = "triton" if self.device == "cuda" else "torch_native"
        if self.attention_backend == "flashinfer":
            self._fall_back_from_flashinfer(default_backend)
        if self.attention_backend is None:
            self.attention_backend = default_backend
        if self.random_seed is None:
            self.random_seed = 42
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if self.device == "cuda" else 2048
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88
        if self.device == "cpu":
            self.disable_cuda_graph = True
        self._resolve_piecewise_cuda_graph()
        if self.load_balance_method is None:
            self.load_balance_method = "minimum_tokens" if self.enable_dp_attention else "round_robin"
        if self.speculative_algorithm is not None:
            self._resolve_speculative_defaults()

    def _resolve_piecewise_cuda_graph(self) -> None:
        """Prefill graphs are on wherever decode graphs are (CUDA, no --disable-cuda-graph)
        unless --disable-piecewise-cuda-graph; an explicit --enable-piecewise-cuda-graph that
        cannot be honoured says why (one warning)."""
        asked = self.enable_piecewise_cuda_graph
        if asked and self.disable_piecewise_cuda_graph:
            raise ValueError("--enable-piecewise-cuda-graph and --disable-piecewise-cuda-graph contradict each other")
        if asked and self.device == "cpu":
            logger.warning("--enable-piecewise-cuda-graph is ignored on CPU: CUDA graphs need CUDA")
        elif asked and self.disable_cuda_graph:
            logger.warning("--enable-piecewise-cuda-graph is ignored under --disable-cuda-graph")
        self.enable_piecewise_cuda_graph = (
            self.device == "cuda" and not self.disable_cuda_graph and not self.disable_piecewise_cuda_graph
        )

    def _fall_back_from_flashinfer(self, fallback: str) -> None:
        """SGLang command lines name flashinfer; this server has no flashinfer backend, so they
        run on the device's default backend (one warning, here at parse time)."""
        installed = importlib.util.find_spec("flashinfer") is not None
        reason = "this server has no flashinfer backend" if installed else "the flashinfer package is not importable"
        logger.warning("--attention-backend flashinfer: %s; using the %s backend instead", reason, fallback)
        self.attention_backend = fallback

    def _resolve_speculative_defaults(self) -> None:
        """SGLang's rules: NEXTN drafts from the target checkpoint; all three sizes unset means
        the automatic choice (--speculative-adaptive: a chain of its largest tier); topk defaults
        to 1; topk 1 forces num_draft_tokens = steps + 1."""
        if self.speculative_algorithm == "NEXTN" and self.speculative_draft_model_path is None:
            self.speculative_draft_model_path = self.model_path
        if self.speculative_adaptive and self.speculative_adaptive_steps is None:
            self.speculative_adaptive_steps = DEFAULT_ADAPTIVE_STEPS
        sizes = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        if sizes == (None, None, None) and self.speculative_adaptive:
            self.speculative_num_steps = max(_parse_steps_list(self.speculative_adaptive_steps, "--speculative-adaptive-steps"))
        elif sizes == (None, None, None):
            self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens = AUTO_SPECULATIVE_PARAMS
            return
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        if self.speculative_eagle_topk == 1 and self.speculative_num_steps is not None:
            self.speculative_num_draft_tokens = self.speculative_num_steps + 1

    # ------------------------------------------------------------------ validation
    def check(self) -> None:
        """Fail with a message that names the offending flag."""
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.enable_dp_attention:
            if self.dp_size == 1:
                raise ValueError("--enable-dp-attention needs --dp-size > 1")
            if self.tp_size % self.dp_size != 0:
                raise ValueError(
                    f"--tp-size ({self.tp_size}) must be divisible by --dp-size ({self.dp_size}) with --enable-dp-attention"
                )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes); got {self.node_rank} with --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port")
        if self.tp_size % self.nnodes != 0:
            raise ValueError(f"--tp-size ({self.tp_size}) must be divisible by --nnodes ({self.nnodes})")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context-length must be >= 1, got {self.context_length}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens must be >= 1, got {self.max_total_tokens}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"--chunked-prefill-size must be -1 or positive, got {self.chunked_prefill_size}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.dp_prefill_align_iters < 0:
            raise ValueError(f"--dp-prefill-align-iters must be >= 0, got {self.dp_prefill_align_iters}")
        if self.num_continuous_decode_steps < 1:
            raise ValueError(f"--num-continuous-decode-steps must be >= 1, got {self.num_continuous_decode_steps}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.watchdog_timeout <= 0:
            raise ValueError(f"--watchdog-timeout must be positive, got {self.watchdog_timeout}")
        if self.scheduler_stall_timeout <= 0:
            raise ValueError(f"--scheduler-stall-timeout must be positive, got {self.scheduler_stall_timeout}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and any(b < 1 for b in self.cuda_graph_bs):
            raise ValueError("--cuda-graph-bs values must be >= 1")
        if self.piecewise_cuda_graph_max_tokens is not None and self.piecewise_cuda_graph_max_tokens < 1:
            raise ValueError(f"--piecewise-cuda-graph-max-tokens must be >= 1, got {self.piecewise_cuda_graph_max_tokens}")
        if self.piecewise_cuda_graph_tokens is not None and (
            not self.piecewise_cuda_graph_tokens or min(self.piecewise_cuda_graph_tokens) < 1
        ):
            raise ValueError(f"--piecewise-cuda-graph-tokens values must be >= 1, got {self.piecewise_cuda_graph_tokens}")
        self._check_gpu_placement()
        self._check_speculative()

    def _check_gpu_placement(self) -> None:
        if self.base_gpu_id < 0:
            raise ValueError(f"--base-gpu-id must be >= 0, got {self.base_gpu_id}")
        if self.gpu_id_step < 0:
            raise ValueError(f"--gpu-id-step must be >= 0, got {self.gpu_id_step}")
        if self.custom_collective_buffer_mb is not None and not self.custom_collective_buffer_mb > 0:
            raise ValueError(f"--custom-collective-buffer-mb must be positive, got {self.custom_collective_buffer_mb}")
        if self.ranks_share_gpu:
            if self.nnodes > 1:
                raise ValueError(
                    "--gpu-id-step 0 (ranks sharing one GPU) needs --nnodes 1: NCCL, which links nodes, refuses two ranks on one GPU"
                )
            if self.disable_custom_all_reduce:
                raise ValueError(
                    "--disable-custom-all-reduce cannot be used with --gpu-id-step 0: NCCL refuses two ranks on one GPU"
                )

    def _check_speculative(self) -> None:
        spec_flags = {
            "--speculative-draft-model-path": self.speculative_draft_model_path,
            "--speculative-num-steps": self.speculative_num_steps,
            "--speculative-eagle-topk": self.speculative_eagle_topk,
            "--speculative-num-draft-tokens": self.speculative_num_draft_tokens,
        }
        other_flags = {"--speculative-token-map": self.speculative_token_map}
        if self.speculative_algorithm is None:
            given = [k for k, v in {**spec_flags, **other_flags}.items() if v is not None]
            given += ["--speculative-accept-check"] if self.speculative_accept_check else []
            given += ["--speculative-adaptive"] if self.speculative_adaptive else []
            if given:
                raise ValueError(f"{given[0]} needs --speculative-algorithm")
        if not self.speculative_adaptive:
            for name, value in [
                ("--speculative-adaptive-steps", self.speculative_adaptive_steps),
                ("--speculative-adaptive-schedule", self.speculative_adaptive_schedule),
            ]:
                if value is not None:
                    raise ValueError(f"{name} needs --speculative-adaptive")
        if self.speculative_algorithm is None:
            return
        for name, value in list(spec_flags.items())[1:]:
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.speculative_algorithm in ("EAGLE", "EAGLE3") and self.speculative_draft_model_path is None:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} needs --speculative-draft-model-path")
        steps, topk, draft = self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens
        if steps is None:
            raise ValueError(
                "--speculative-num-steps is needed when --speculative-eagle-topk or --speculative-num-draft-tokens is set"
            )
        if draft is None:
            raise ValueError(f"--speculative-num-draft-tokens is needed with --speculative-eagle-topk {topk}")
        max_draft = 1 + topk + (steps - 1) * topk * topk  # the root plus every drafted candidate
        if not 2 <= draft <= max_draft:
            raise ValueError(
                f"--speculative-num-draft-tokens must be in [2, {max_draft}] for --speculative-num-steps {steps} "
                f"and --speculative-eagle-topk {topk}, got {draft}"
            )
        if self.speculative_adaptive:
            self._check_adaptive()

    def _check_adaptive(self) -> None:
        if self.speculative_eagle_topk != 1:
            raise ValueError(
                f"--speculative-adaptive switches between chains: it needs --speculative-eagle-topk 1, "
                f"got {self.speculative_eagle_topk}"
            )
        tiers = self.speculative_tiers
        if len(tiers) < 2:
            raise ValueError(f"--speculative-adaptive-steps needs at least two tiers, got {self.speculative_adaptive_steps!r}")
        if self.speculative_num_steps not in tiers:
            raise ValueError(
                f"--speculative-num-steps {self.speculative_num_steps} must be one of --speculative-adaptive-steps "
                f"{','.join(map(str, tiers))} (it is the starting tier)"
            )
        for steps, _ in self.speculative_adaptive_schedule_pairs:
            if steps not in tiers:
                raise ValueError(
                    f"--speculative-adaptive-schedule: {steps} steps is not a tier of --speculative-adaptive-steps "
                    f"{','.join(map(str, tiers))}"
                )

    def _check_gpus_exist(self) -> None:
        import torch

        per_node = self.ranks_per_node
        last = self.base_gpu_id + (per_node - 1) * self.gpu_id_step
        count = torch.cuda.device_count()
        if last >= count:
            raise ValueError(
                f"--base-gpu-id {self.base_gpu_id} and --gpu-id-step {self.gpu_id_step} put this node's "
                f"{per_node} ranks up to GPU {last}, but {count} GPU(s) are visible"
            )

    def not_supported_yet(self) -> Optional[str]:
        """The message for the first requested feature that is not implemented yet."""
        for predicate, message in _NOT_SUPPORTED_YET:
            if predicate(self):
                return message
        return None

    def check_launchable(self) -> None:
        """Checks that depend on this machine and on what is implemented; run at launch, not parse."""
        if self.device == "cpu" and self.attention_backend != "torch_native":
            raise ValueError(f"--attention-backend {self.attention_backend} needs CUDA; use torch_native on CPU")
        if self.device == "cuda" and not _cuda_available():
            raise ValueError("--device cuda was given but CUDA is not available")
        if self.device == "cuda":
            self._check_gpus_exist()
        message = self.not_supported_yet()
        if message:
            raise ValueError(message)

    # ------------------------------------------------------------------ helpers
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ranks_share_gpu(self) -> bool:
        """The ranks of one model replica on one GPU (--gpu-id-step 0 on CUDA): their collectives
        go through the IPC buffers only."""
        return self.device == "cuda" and self.gpu_id_step == 0 and self.tp_size // self.nnodes > 1

    @property
    def ranks_per_gpu(self) -> int:
        """Scheduler processes of this node on each GPU (all of them with --gpu-id-step 0)."""
        return self.ranks_per_node if self.device == "cuda" and self.gpu_id_step == 0 else 1

    @property
    def ranks_per_node(self) -> int:
        """Scheduler processes on each node (DP replicas without DP attention included)."""
        return self.tp_size // self.nnodes * (1 if self.enable_dp_attention else self.dp_size)

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def speculative_tiers(self) -> tuple[int, ...]:
        """Draft steps of each speculative tier, ascending: --speculative-adaptive-steps, else
        --speculative-num-steps alone (empty without speculation)."""
        if self.speculative_algorithm is None:
            return ()
        if not self.speculative_adaptive:
            return (self.speculative_num_steps,)
        return tuple(sorted(set(_parse_steps_list(self.speculative_adaptive_steps, "--speculative-adaptive-steps"))))

    @property
    def speculative_adaptive_schedule_pairs(self) -> list[tuple[int, int]]:
        """--speculative-adaptive-schedule as (steps, cycles) pairs (empty when not given)."""
        text = self.speculative_adaptive_schedule
        if text is None:
            return []
        pairs = []
        for item in text.split(","):
            steps, sep, cycles = item.partition(":")
            try:
                pair = (int(steps), int(cycles))
            except ValueError:
                pair = None
            if not sep or pair is None or min(pair) < 1:
                raise ValueError(
                    f"--speculative-adaptive-schedule takes steps:cycles pairs of positive integers, e.g. 3:4,1:2; got {text!r}"
                )
            pairs.append(pair)
        return pairs


_NOT_SUPPORTED_YET.extend(
    [
        (lambda a: a.page_size != 1, "--page-size other than 1 is not supported yet"),
        (
            lambda a: a.nnodes > 1 and a.dp_size > 1 and not a.enable_dp_attention,
            "--dp-size replicas across --nnodes > 1 are not supported yet (use --enable-dp-attention)",
        ),
        (
            lambda a: a.speculative_algorithm == "EAGLE3",
            "--speculative-algorithm EAGLE3 is not supported yet; use EAGLE or NEXTN",
        ),
    ]
)


def _parse_steps_list(text: str, flag: str) -> list[int]:
    """Comma-separated positive integers (a flag's value), or a ValueError naming the flag."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes comma-separated positive integers, e.g. 1,3,5; got {text!r}")
    return values


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _flag_names(f: dataclasses.Field) -> list[str]:
    return list(f.metadata.get("flags") or ()) or ["--" + f.name.replace("_", "-")]


def _help_suffix(f: dataclasses.Field, resolved: ServerArgs) -> str:
    """--help's default: the field's value, or 'auto' when ServerArgs derives it at parse time
    (from the device, the model path...), 'unset' when it stays None."""
    if f.metadata.get("required"):
        return "(required)"
    if f.default is not None:
        return f"(default: {f.default})"
    return "(default: auto)" if getattr(resolved, f.name) is not None else "(default: unset)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server", allow_abbrev=True)
    hints = typing.get_type_hints(ServerArgs)
    resolved = ServerArgs(model_path="model", device="cpu")  # which None defaults get derived
    for f in dataclasses.fields(ServerArgs):
        meta = dict(f.metadata)
        help_text = f"{meta.get('help')} {_help_suffix(f, resolved)}".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if meta.get("required"):
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
        base = _base_type(hints[f.name])
        if base is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = meta.get("type", base)
            if "nargs" in meta:
                kwargs["nargs"] = meta["nargs"]
        parser.add_argument(*_flag_names(f), **kwargs)
    return parser


def _base_type(hint) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return list
    if args:
        return _base_type(args[0])
    return hint


def prepare_server_args(argv: list[str]) -> ServerArgs:
    """Parse a command line into ServerArgs; invalid values exit with the flag named."""
    parser = build_parser()
    return server_args_from_namespace(parser, parser.parse_args(argv))


def server_args_from_namespace(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ServerArgs:
    """ServerArgs from parsed flags; invalid values exit with the flag named."""
    try:
        return ServerArgs(**vars(ns))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


@dataclass(frozen=True)
class PortArgs:
    """ZMQ endpoints between the processes: ipc:// paths in a private temp dir on one node,
    tcp:// ports next to --dist-init-addr when ranks span several nodes."""

    # TokenizerManager -> DataParallelController or scheduler (requests, control)
    scheduler_input_ipc_name: str
    # DataParallelController -> entry rank of each DP rank (one per DP rank; unused at dp 1)
    dp_input_ipc_names: tuple[str, ...]
    # Entry rank of each DP rank -> DataParallelController (RankLoad reports; unused at dp 1)
    dp_load_ipc_name: str
    # Schedulers -> DetokenizerManager (BatchTokenIDOut)
    detokenizer_ipc_name: str
    # DetokenizerManager and schedulers -> TokenizerManager (BatchStrOut, control replies)
    tokenizer_ipc_name: str
    # torch.distributed rendezvous port of each model replica (one per DP replica)
    nccl_ports: tuple[int, ...]
    run_dir: str

    @property
    def nccl_port(self) -> int:
        return self.nccl_ports[0]

    @classmethod
    def init_new(cls, server_args: ServerArgs) -> PortArgs:
        import tempfile

        run_dir = tempfile.mkdtemp(prefix="sglang-")
        replicas = 1 if server_args.enable_dp_attention else server_args.dp_size
        if server_args.nnodes > 1:
            host, port = server_args.dist_init_addr.rsplit(":", 1)
            base = int(port)
            tcp = lambda offset: f"tcp://{host}:{base + offset}"
            return cls(
                scheduler_input_ipc_name=tcp(1),
                dp_input_ipc_names=tuple(tcp(4 + r) for r in range(server_args.dp_size)),
                dp_load_ipc_name=tcp(4 + server_args.dp_size),
                detokenizer_ipc_name=tcp(2),
                tokenizer_ipc_name=tcp(3),
                nccl_ports=(base,),
                run_dir=run_dir,
            )
        ipc = lambda name: f"ipc://{run_dir}/{name}"
        return cls(
            scheduler_input_ipc_name=ipc("scheduler_input"),
            dp_input_ipc_names=tuple(ipc(f"dp_input_{r}") for r in range(server_args.dp_size)),
            dp_load_ipc_name=ipc("dp_load"),
            detokenizer_ipc_name=ipc("detokenizer"),
            tokenizer_ipc_name=ipc("tokenizer"),
            nccl_ports=tuple(_free_port() for _ in range(replicas)),
            run_dir=run_dir,
        )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
