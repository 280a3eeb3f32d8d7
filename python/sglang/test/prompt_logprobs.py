"""Prompt (input) logprobs against transformers' log_softmax of the prompt on the same weights."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

TOP_N = 3


def reference_logprobs(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log_softmax over every prompt position: [len(prompt), vocab] per prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def check_input_logprobs(meta: dict[str, Any], prompt: list[int], ref: torch.Tensor, start: int, top_n: int = TOP_N) -> None:
    """input_token_logprobs covers prompt[start:], the first without a logprob; each other token's
    logprob is the reference's at the position before it, and its top logprobs are the
    reference's top_n of that position."""
    tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in tokens] == prompt[start:]
    assert tokens[0][0] is None and tops[0] is None and len(tops) == len(tokens)
    rows = ref[start : len(prompt) - 1]
    expected = rows.gather(1, torch.tensor(prompt[start + 1 :]).view(-1, 1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in tokens[1:]]), expected, atol=1e-4, rtol=0)
    for row, top in zip(rows, tops[1:]):
        values = torch.tensor([v for v, _, _ in top])
        torch.testing.assert_close(values, row.topk(top_n).values, atol=1e-4, rtol=0)
        torch.testing.assert_close(row[[t for _, t, _ in top]], values, atol=1e-4, rtol=0)  # the ids go with the values
