"""--speculative-token-map: the draft's LM head over a vocabulary subset.

- The layout of a subset over vocabulary shards, and the restricted head's logits (the
  subset's columns of the full head's; padding columns -inf).
- The map file's checks: a clear error naming the flag for each kind of bad file.
- sglang.tools.token_map writes a map of a corpus's most frequent tokens that the server reads.
- Through sglang.Engine (CPU, float32): a perfect draft whose map holds every token it needs
  still has every draft accepted and the target's greedy tokens, also with the head sharded
  over two ranks (uneven shards, padded); a map missing tokens of the output keeps the tokens
  and lowers the accept length.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.linear import linear
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, restricted_head, shard_token_subset
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.token_map import load_token_map
from sglang.test.spec_runs import greedy_with_accept_length
from sglang.tools.token_map import frequent_tokens
from sglang.tools.token_map import main as token_map_main

PROMPTS = [[5, 17, 42, 99, 7, 3, 150, 11], [8, 9, 10], [100, 101, 102, 103, 104]]
MAX_NEW = 12
CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}


def test_subset_layout_over_shards():
    ids = torch.tensor([9, 1, 5, 2, 7])
    assert shard_token_subset(ids, 10, 1).tolist() == [[9, 1, 5, 2, 7]]
    # Shards of 5 tokens: rank 0 holds 1, 2; rank 1 holds 9, 5, 7 (in the given order).
    assert shard_token_subset(ids, 10, 2).tolist() == [[1, 2, -1], [9, 5, 7]]
    # An uneven last shard (vocab 10 over 3 ranks: 4, 4, 2 rows).
    assert shard_token_subset(ids, 10, 3).tolist() == [[1, 2], [5, 7], [9, -1]]


def test_restricted_head_keeps_the_subset_columns():
    torch.manual_seed(0)
    head = ParallelLMHead(12, 8)
    head.weight.data.normal_()
    x = torch.randn(3, 8)
    full = linear(x, head.weight, None, torch.float32)
    layout = torch.tensor([[7, 0, 11, 4, -1]])  # as a shard of a larger group pads its row
    small = restricted_head(head, layout)
    logits = linear(x, small.weight, small.bias, torch.float32)
    assert logits.shape == (3, 5)
    torch.testing.assert_close(logits[:, :4], full[:, [7, 0, 11, 4]])
    assert torch.isneginf(logits[:, 4]).all()
    assert restricted_head(head, layout[:, :4]).bias is None  # nothing to mask


def _save(tmp_path, name: str, value) -> str:
    path = str(tmp_path / name)
    torch.save(value, path)
    return path


def test_token_map_file_checks(tmp_path):
    assert load_token_map(_save(tmp_path, "ok.pt", [3, 1, 2]), 10, 1).tolist() == [3, 1, 2]
    assert load_token_map(_save(tmp_path, "t.pt", torch.tensor([4, 0], dtype=torch.int32)), 10, 2).dtype == torch.int64
    bad = {
        "no such file": str(tmp_path / "missing.pt"),
        "1-D list of integer": _save(tmp_path, "float.pt", torch.tensor([1.0, 2.0])),
        "got torch.int64 of shape": _save(tmp_path, "2d.pt", torch.tensor([[1, 2]])),
        r"must be in \[0, 10\)": _save(tmp_path, "range.pt", [1, 10]),
        "repeat": _save(tmp_path, "dup.pt", [1, 1, 2]),
        "fewer than --speculative-eagle-topk 4": _save(tmp_path, "few.pt", [1, 2]),
    }
    (tmp_path / "text.pt").write_text("not a tensor")
    bad["not a saved tensor"] = str(tmp_path / "text.pt")
    for message, path in bad.items():
        with pytest.raises(ValueError, match=f"--speculative-token-map.*{message}"):
            load_token_map(path, 10, 4)
    with pytest.raises(ValueError, match="--speculative-token-map needs --speculative-algorithm"):
        ServerArgs(model_path="m", device="cpu", speculative_token_map="x.pt")


def test_frequent_tokens_order():
    ids = frequent_tokens([[5, 5, 3, 9], [3, 5, 2]], 10, 6, always=[7])
    assert ids.tolist() == [7, 5, 3, 2, 9, 0]  # special first, by count, ties and unseen by id
    assert frequent_tokens([[1]], 10, 2, always=[4, 8, 9]).tolist() == [4, 8]


def test_token_map_tool(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "a.txt").write_text("the cat sat on the mat. the end.")
    (tmp_path / "b.jsonl").write_text('{"prompt": "the dog"}\n\n{"messages": [{"role": "user", "content": "a cat"}]}\n')
    out = str(tmp_path / "map.pt")
    token_map_main(
        [
            "--model-path",
            tiny_llama_dir,
            "--corpus",
            str(tmp_path / "a.txt"),
            str(tmp_path / "b.jsonl"),
            "--size",
            "40",
            "--output",
            out,
        ]
    )
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = load_token_map(out, _vocab(tiny_llama_dir), 4).tolist()
    assert len(ids) == 40 and ids[: len(tok.all_special_ids)] == sorted(set(tok.all_special_ids))
    the = tok("the", add_special_tokens=False)["input_ids"][0]
    dog = tok("the dog", add_special_tokens=False)["input_ids"][-1]
    assert the in ids and dog in ids
    with pytest.raises(SystemExit):
        token_map_main(["--model-path", tiny_llama_dir, "--corpus", str(tmp_path / "a.txt"), "--size", "0", "--output", out])


def _greedy(model_dir: str, **engine_args) -> tuple[list[list[int]], float]:
    return greedy_with_accept_length(model_dir, PROMPTS, MAX_NEW, **engine_args)


def _map_file(tmp_path, name: str, needed: set[int], vocab: int, extra: int, seed: int) -> str:
    """The needed tokens and `extra` others of the lower half of the vocabulary (so the shards of
    a two-rank head hold unequal counts), shuffled."""
    others = [t for t in torch.randperm(vocab // 2, generator=torch.Generator().manual_seed(seed)).tolist() if t not in needed]
    ids = torch.tensor(sorted(needed) + others[:extra])
    return _save(tmp_path, name, ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))])


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def test_perfect_eagle_draft_with_a_token_map(perfect_llama_pair, tmp_path):
    target, head = perfect_llama_pair
    eagle = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head, **CHAIN)
    expected, full_accept = _greedy(target, **eagle)
    assert full_accept == 4
    outputs = {t for ids in expected for t in ids}
    covering = _map_file(tmp_path, "cover.pt", outputs, _vocab(target), 40, seed=1)
    ids, accept = _greedy(target, speculative_token_map=covering, **eagle)
    assert ids == expected and accept == 4
    # Without the later outputs' tokens the draft misses them: same tokens, fewer accepted.
    kept = {t for ids in expected for t in ids[: MAX_NEW // 3]}
    missing = _map_file(tmp_path, "missing.pt", kept, _vocab(target), 40, seed=2)
    assert {t for t in outputs - kept if t < _vocab(target) // 2}  # the extra tokens cannot refill them all
    ids, accept = _greedy(target, speculative_token_map=missing, **eagle)
    assert ids == expected and 1 <= accept < 4


def test_perfect_nextn_draft_with_a_token_map_over_two_ranks(perfect_deepseek_v3_dir, tmp_path):
    """tp 2: the draft head is sharded over the vocabulary, unevenly (padding columns)."""
    target = perfect_deepseek_v3_dir
    expected, _ = _greedy(target)
    outputs = {t for ids in expected for t in ids}
    covering = _map_file(tmp_path, "cover.pt", outputs, _vocab(target), 60, seed=3)
    nextn = dict(tp_size=2, speculative_algorithm="NEXTN", speculative_token_map=covering)
    ids, accept = _greedy(target, **nextn, **CHAIN)
    assert ids == expected and accept == 4
    # A tree ranks the map's tokens by the draft's softmax over them (its top-k picks map back
    # through the padded layout); the target's tokens stay.
    ids, accept = _greedy(target, **nextn, **TREE)
    assert ids == expected and accept > 1
