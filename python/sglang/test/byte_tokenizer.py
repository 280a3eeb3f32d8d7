"""A real (transformers) tokenizer built offline: one token per UTF-8 byte plus specials.

Used by tests that need a tokenizer without downloading one; multi-byte characters span
several tokens, which exercises incremental detokenization.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Vocabulary: the 256 byte symbols of byte-level BPE (ids 0..255), then SPECIAL_TOKENS."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_symbols = sorted(alphabet, key=lambda c: _byte_of_symbol(c))
    vocab = {c: i for i, c in enumerate(byte_symbols)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_of_symbol(symbol: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one symbol."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(symbol)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
