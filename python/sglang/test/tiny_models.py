"""Tiny random checkpoints saved by transformers, with a tiny tokenizer, for offline tests.

Each generator writes a directory the server can load (config.json, safetensors weights,
tokenizer files) and returns its path.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TRAINING_TEXT = (
    """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
What is the capital of France? The capital of France is Paris. Hello, how are you today?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Once upon a time there was a small model that answered questions.
User asks, assistant answers. The sky is blue and the grass is green; water is wet and fire is hot.
"""
    * 4
)


def make_tiny_tokenizer(path: str, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a built-in text, saved to path."""
    fast = train_bpe_tokenizer(_TRAINING_TEXT.splitlines(), vocab_size)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on texts; special tokens bos/eos/pad and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _save(
    path: str,
    model_cls: type[PreTrainedModel],
    config_cls: type,
    vocab_size: int,
    seed: int,
    max_shard_size: Optional[str],
    overrides: dict[str, Any],
) -> str:
    tokenizer = make_tiny_tokenizer(path, vocab_size)
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # larger than the default so greedy choices are not near-ties
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def make_tiny_llama(path: str, vocab_size: int = 384, seed: int = 0, max_shard_size: Optional[str] = None, **overrides) -> str:
    """Tiny LlamaForCausalLM (hidden 64, 2 layers, 4 heads / 2 KV heads); overrides go to LlamaConfig."""
    return _save(path, LlamaForCausalLM, LlamaConfig, vocab_size, seed, max_shard_size, overrides)


def make_tiny_qwen2(path: str, vocab_size: int = 384, seed: int = 0, max_shard_size: Optional[str] = None, **overrides) -> str:
    """Tiny Qwen2ForCausalLM (q/k/v biases), same shape as make_tiny_llama."""
    return _save(path, Qwen2ForCausalLM, Qwen2Config, vocab_size, seed, max_shard_size, overrides)
