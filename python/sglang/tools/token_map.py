"""Write a --speculative-token-map file: the most frequent tokens of a corpus.

    python -m sglang.tools.token_map --model-path M --corpus data.jsonl notes.txt --size 32768 --output map.pt

A corpus file is plain text (counted whole) or JSON Lines (every string value of each record
is counted, e.g. {"prompt": ...}; a chat's "messages" contents included). The map holds the
tokenizer's special tokens (so a draft can guess the end of a reply), then the corpus's tokens
by falling count, ties and never-seen tokens by id, `--size` tokens in all.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator

import torch
from transformers import AutoConfig, AutoTokenizer


def corpus_texts(path: str) -> Iterator[str]:
    """The texts of a corpus file (see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
            yield f.read()
            return
        for line in f:
            if line.strip():
                yield from _strings(json.loads(line))


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def frequent_tokens(token_lists: Iterable[list[int]], vocab_size: int, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """`size` token ids (int64): `always` first, then the rest by falling count, ties by id."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in token_lists:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    first = sorted({t for t in always if 0 <= t < vocab_size})
    counts[first] = -1  # placed first below, not again by count
    # Stable sort on falling counts keeps ties in id order.
    by_count = torch.sort(-counts, stable=True).indices
    rest = by_count[: max(size - len(first), 0)]
    return torch.cat([torch.tensor(first, dtype=torch.int64), rest])[:size]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="the target model (its tokenizer and vocabulary size)")
    parser.add_argument("--corpus", nargs="+", required=True, help="text or .jsonl files")
    parser.add_argument("--size", type=int, default=32768, help="tokens in the map")
    parser.add_argument("--output", required=True, help="the .pt file to write")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    vocab_size = AutoConfig.from_pretrained(args.model_path).vocab_size
    if not 1 <= args.size <= vocab_size:
        parser.error(f"--size must be in [1, {vocab_size}] (the vocabulary size), got {args.size}")
    texts = (text for path in args.corpus for text in corpus_texts(path))
    token_lists = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts)
    ids = frequent_tokens(token_lists, vocab_size, args.size, tokenizer.all_special_ids)
    torch.save(ids, args.output)
    print(f"wrote {ids.numel()} token ids to {args.output}")


if __name__ == "__main__":
    main()
