"""Speculative runs through sglang.Engine for tests (CPU)."""

from __future__ import annotations

import sglang as sgl


def greedy_with_accept_length(
    model_dir: str, prompts: list[list[int]], max_new: int, **engine_args
) -> tuple[list[list[int]], float]:
    """(each prompt's greedy output ids, DP rank 0's average accept length) of one engine run."""
    with sgl.Engine(model_path=model_dir, device="cpu", **engine_args) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        )
        accept = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    return [o["output_ids"] for o in outs], accept
