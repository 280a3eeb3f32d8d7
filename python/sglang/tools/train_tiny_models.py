"""Train small models whose speculative drafts really predict their target, from offline text.

    python -m sglang.tools.train_tiny_models --out DIR --device cuda --minutes 6

Text: the Python standard library's .py sources (every HOLDOUT_EVERY-th file held out).
Writes, under DIR:
- deepseek-v3-mtp/: a small DeepSeek-V3 (MLA, MoE with noaux_tc routing, one MTP layer) with
  its own byte-level BPE tokenizer, in the DeepSeek checkpoint layout (the MTP layer at
  model.layers.{num_hidden_layers}.*), so `--speculative-algorithm NEXTN` loads it. Trained
  jointly, as in DeepSeek-V3: next-token loss + MTP_WEIGHT x the MTP layer's loss on x_{t+2}
  from the main hidden state at t and the embedding of x_{t+1}; then the MTP layer alone is
  distilled from the frozen main model (DISTILL_FRACTION of the time), unrolled like the
  draft steps it will run.
- eagle-<target>/: an EAGLE head (models/llama_eagle.py format) for --eagle-target (a Llama
  checkpoint or SmolLM2-135M-Instruct), distilled from the target on the same text.
- heldout_prompts.jsonl: prompts from the held-out files ({"prompt": ...} per line), for
  `python -m sglang.bench_serving --dataset-name file`.

--minutes is the training budget of each model; --max-steps caps the steps (CPU tests).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sysconfig
import tempfile
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

from sglang.test.tiny_models import train_bpe_tokenizer
from sglang.tools.draft_heads import EagleHead, MTPHead, draft_loss

HOLDOUT_EVERY = 10
MTP_WEIGHT = 0.3
DISTILL_FRACTION = 0.3
HIDDEN_WEIGHT = 0.5  # smooth-L1 pull of the draft's output towards the target's next hidden state
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"

# Model shapes: "small" for the GPU figures, "tiny" for CPU tests.
DEEPSEEK_SHAPES = {
    # 12 layers for one MTP layer: a draft step must cost a small part of a target step, as in
    # DeepSeek-V3 (61 layers); with 3, a speculative cycle costs 3 plain steps and cannot pay.
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=192,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
    ),
}


# ---------------------------------------------------------------------------- text
def stdlib_sources(max_files: Optional[int]) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the stdlib's .py files, every HOLDOUT_EVERY-th held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if "site-packages" not in p)
    if max_files:
        files = files[:: max(1, len(files) // max_files)][:max_files]
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    train = [t for i, t in enumerate(texts) if i % HOLDOUT_EVERY and t.strip()]
    heldout = [t for i, t in enumerate(texts) if not i % HOLDOUT_EVERY and t.strip()]
    return train, heldout


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenized and concatenated, each followed by eos: [N] int64."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += encoded + [eos]
    return torch.tensor(ids, dtype=torch.int64)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator, device: str) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()]).to(device)


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str) -> PreTrainedTokenizerFast:
    """Byte-level BPE on the training texts, with bos/eos/pad and a chat template, saved to out_dir."""
    fast = train_bpe_tokenizer(texts, vocab_size)
    fast.save_pretrained(out_dir)
    return fast


def write_heldout_prompts(texts: list[str], path: str, num: int = 64, chars: int = 800) -> None:
    """The opening `chars` characters of up to `num` held-out files, one JSON object a line."""
    with open(path, "w") as f:
        for text in texts[:num]:
            f.write(json.dumps({"prompt": text[:chars]}) + "\n")


# ---------------------------------------------------------------------------- training
class Schedule:
    """Linear warm-up, then cosine decay to 10% over the budget (time or steps, whichever ends first)."""

    def __init__(self, lr: float, budget_s: float, max_steps: Optional[int], warmup: int):
        self.lr, self.budget_s, self.max_steps, self.warmup = lr, budget_s, max_steps, warmup
        self.start = time.monotonic()

    def progress(self, step: int) -> float:
        by_time = (time.monotonic() - self.start) / self.budget_s
        return max(by_time, step / self.max_steps if self.max_steps else 0.0)

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup)
        return self.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, self.progress(step)))))


def run_training(
    name: str,
    params: list[nn.Parameter],
    step_fn: Callable[[], tuple[torch.Tensor, str]],
    lr: float,
    budget_s: float,
    max_steps: Optional[int],
    log_every: int = 50,
) -> int:
    """AdamW on params until the budget is spent; step_fn returns (loss, log text). Returns steps run."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = Schedule(lr, budget_s, max_steps, warmup=min(100, max_steps or 100))
    step = 0
    while schedule.progress(step) < 1.0:
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        loss, text = step_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % log_every == 0 or step == 1:
            print(f"[{name}] step {step} {time.monotonic() - schedule.start:.0f}s loss {loss.item():.3f} {text}", flush=True)
    return step


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def accuracy_text(accs: list[float]) -> str:
    return "draft top-1 per pass " + " ".join(f"{a:.3f}" for a in accs)


# ---------------------------------------------------------------------------- DeepSeek-V3 + MTP
def deepseek_config(tokenizer: PreTrainedTokenizerFast, shape: str, seq_len: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        **DEEPSEEK_SHAPES[shape],
        vocab_size=len(tokenizer),
        max_position_embeddings=max(2048, 2 * seq_len),
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def experts_implementation(device: str) -> str:
    """transformers' grouped_mm MoE (one grouped GEMM per projection) where this transformers
    has it and it trains on `device`; else its eager loop, which waits for the device once per
    expert and layer."""
    probe = DeepseekV3Config(**DEEPSEEK_SHAPES["tiny"], vocab_size=64)
    probe._experts_implementation = "grouped_mm"
    try:
        model = DeepseekV3ForCausalLM(probe).to(device)
        ids = torch.randint(0, 64, (2, 8), device=device)
        with autocast(device):
            model(input_ids=ids, labels=ids).loss.backward()
    except Exception as e:  # a capability probe: an older transformers, or no grouped GEMM here
        print(f"[deepseek] experts: transformers' eager loop ({type(e).__name__}: {e})", flush=True)
        return "eager"
    return "grouped_mm"


def train_deepseek(args: argparse.Namespace, train_texts: list[str], heldout_texts: list[str]) -> str:
    out_dir = os.path.join(args.out, "deepseek-v3-mtp")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_tokenizer(train_texts, args.vocab_size, out_dir)
    stream, heldout = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    print(f"[deepseek] vocab {len(tokenizer)}, {len(stream)} training tokens, {len(heldout)} held out", flush=True)
    config = deepseek_config(tokenizer, args.shape, args.seq_len)
    config._experts_implementation = experts_implementation(args.device)  # the MTP head's copy too
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(config).to(args.device).train()
    head = MTPHead(config)
    head.apply(model._init_weights)  # HF's init (bare MoE experts start uninitialized)
    head = head.to(args.device).train()
    gen = torch.Generator().manual_seed(args.seed)
    embed, lm_head = model.model.embed_tokens, model.lm_head

    def joint_step() -> tuple[torch.Tensor, str]:
        ids = sample_batch(stream, args.batch_size, args.seq_len, gen, args.device)
        with autocast(args.device):
            hidden = model.model(input_ids=ids).last_hidden_state
            main = F.cross_entropy(lm_head(hidden[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
            mtp, accs = draft_loss(head, embed, lm_head, ids, hidden)
        return main + MTP_WEIGHT * mtp, f"main {main.item():.3f} mtp {mtp.item():.3f} {accuracy_text(accs)}"

    distill_step = distillation_step(model, head, stream, gen, args)
    budget = args.minutes * 60
    steps = args.max_steps
    params = list(model.parameters()) + list(head.parameters())
    run_training("deepseek joint", params, joint_step, args.lr, budget * (1 - DISTILL_FRACTION), steps)
    model.eval().requires_grad_(False)
    run_training("deepseek mtp distill", list(head.parameters()), distill_step, args.lr / 3, budget * DISTILL_FRACTION, steps)
    evaluate("deepseek", lambda ids: distill_step(ids)[1], heldout, args)
    save_deepseek(model, head, out_dir, save_dtype(args.device))
    return out_dir


def distillation_step(
    target: nn.Module, head: nn.Module, stream: torch.Tensor, gen: torch.Generator, args: argparse.Namespace
) -> Callable[[Optional[torch.Tensor]], tuple[torch.Tensor, str]]:
    """One step of distilling a draft head from a frozen target: the head's loss against the
    target's argmax and hidden states on a batch (sampled from stream unless given)."""
    embed, lm_head = target.model.embed_tokens, target.lm_head

    def step(batch: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, str]:
        ids = sample_batch(stream, args.batch_size, args.seq_len, gen, args.device) if batch is None else batch
        with autocast(args.device):
            with torch.no_grad():
                hidden = target.model(input_ids=ids).last_hidden_state
                logits = lm_head(hidden)
            loss, accs = draft_loss(head, embed, lm_head, ids, hidden, logits, args.unroll, HIDDEN_WEIGHT)
        return loss, accuracy_text(accs)

    return step


def save_deepseek(model: DeepseekV3ForCausalLM, head: MTPHead, out_dir: str, dtype: torch.dtype) -> None:
    """The DeepSeek layout: main weights as HF saves them, plus the MTP layer at model.layers.{N}.*
    (its decoder layer saved by HF as layer N of an (N+1)-layer model, so names match HF's)."""
    config = model.config
    n = config.num_hidden_layers
    bigger = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict({**config.to_dict(), "num_hidden_layers": n + 1}))
    bigger.load_state_dict(model.state_dict(), strict=False)
    bigger.model.layers[n].load_state_dict(head.layer.state_dict())
    prefix = f"model.layers.{n}."
    with tempfile.TemporaryDirectory() as tmp:
        bigger.to(dtype).save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "model.safetensors"), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    state.update({prefix + k: v.detach().to("cpu", dtype) for k, v in head.checkpoint_extras().items()})
    state[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(
        {k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"}
    )
    config.dtype = dtype
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(out_dir)


# ---------------------------------------------------------------------------- EAGLE head
def load_llama_target(path: str, device: str) -> tuple[nn.Module, PreTrainedTokenizerFast]:
    """The target as a transformers Llama, with the weights the engine serves (GGUF dequantized too)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import iterate_weights, resolve_load_format
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    config = ModelConfig(path, dtype="float32", device="cpu")
    model = AutoModelForCausalLM.from_config(config.hf_config, dtype=torch.float32)
    weights = dict(iterate_weights(config, resolve_load_format(config.model_path, "auto")))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"target weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval().requires_grad_(False), get_tokenizer(path)


def eagle_dir_name(target: str) -> str:
    name = os.path.basename(os.path.normpath(target))
    return "eagle-" + name.removesuffix(".gguf").lower()


def train_eagle(args: argparse.Namespace, train_texts: list[str], heldout_texts: list[str]) -> str:
    out_dir = os.path.join(args.out, eagle_dir_name(args.eagle_target))
    target, tokenizer = load_llama_target(args.eagle_target, args.device)
    stream, heldout = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    print(f"[eagle] target {args.eagle_target}: {len(stream)} training tokens, {len(heldout)} held out", flush=True)
    torch.manual_seed(args.seed)
    head = EagleHead(target.config)
    head.apply(target._init_weights)
    head = head.to(args.device).train()
    step = distillation_step(target, head, stream, torch.Generator().manual_seed(args.seed), args)
    run_training("eagle", list(head.parameters()), step, args.lr, args.minutes * 60, args.max_steps)
    evaluate("eagle", lambda ids: step(ids)[1], heldout, args)
    save_eagle(head, target.config, out_dir, save_dtype(args.device))
    return out_dir


def save_eagle(head: EagleHead, target_config, out_dir: str, dtype: torch.dtype) -> None:
    os.makedirs(out_dir, exist_ok=True)
    config = target_config.to_dict()
    config.update(architectures=[EAGLE_ARCHITECTURE], num_hidden_layers=1, dtype=str(dtype).removeprefix("torch."))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.checkpoint_state().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------------------- common
def save_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@torch.no_grad()
def evaluate(name: str, describe: Callable[[torch.Tensor], str], heldout: torch.Tensor, args: argparse.Namespace) -> None:
    """Draft agreement with the target's argmax on held-out windows (teacher-forced)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = sample_batch(heldout, args.batch_size, args.seq_len, gen, args.device)
    print(f"[{name}] held-out {describe(ids)}", flush=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=5.0, help="training budget of each model")
    p.add_argument("--max-steps", type=int, help="cap on the steps of each training phase")
    p.add_argument("--models", nargs="+", choices=("deepseek", "eagle"), default=["deepseek", "eagle"])
    p.add_argument("--eagle-target", default="SmolLM2-135M-Instruct", help="Llama-family target of the EAGLE head")
    p.add_argument("--shape", choices=sorted(DEEPSEEK_SHAPES), default="small", help="DeepSeek model size")
    p.add_argument("--vocab-size", type=int, default=2048, help="DeepSeek tokenizer vocabulary")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--unroll", type=int, default=2, help="draft passes per distillation step")
    p.add_argument("--max-files", type=int, help="use only this many stdlib files (tests)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)
    train_texts, heldout_texts = stdlib_sources(args.max_files)
    write_heldout_prompts(heldout_texts, os.path.join(args.out, "heldout_prompts.jsonl"))
    for name in args.models:
        out_dir = (train_deepseek if name == "deepseek" else train_eagle)(args, train_texts, heldout_texts)
        print(f"[{name}] saved {out_dir}", flush=True)


if __name__ == "__main__":
    main()
