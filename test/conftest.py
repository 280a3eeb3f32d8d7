"""Shared fixtures: tiny random checkpoints written once per test session. Tests only read
these directories (a test that changes a checkpoint builds its own).

Under TRITON_INTERPRET=1 the interpreter is patched for NumPy >= 2.4 here, before any test
module is imported."""

from __future__ import annotations

import pytest

from sglang.test.tiny_models import make_tiny_llama, make_tiny_qwen2
from sglang.test.triton_harness import patch_interpreter_for_numpy2

patch_interpreter_for_numpy2()

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """Tiny Llama, sharded safetensors (exercises model.safetensors.index.json)."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")), max_shard_size="50KB")


@pytest.fixture(scope="session")
def tiny_llama3_tied_dir(tmp_path_factory) -> str:
    """Tiny Llama 3.1 style: llama3 rope scaling, tied embeddings, explicit head_dim, single file."""
    return make_tiny_llama(
        str(tmp_path_factory.mktemp("tiny_llama3")),
        tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE,
        head_dim=32,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def tiny_llama_unsharded_dir(tmp_path_factory) -> str:
    """Tiny Llama, one safetensors file (make_tiny_llama's defaults)."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_unsharded")))


@pytest.fixture(scope="session")
def tiny_llama_eagle_head_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """A random EAGLE head for tiny_llama_dir: few drafts accepted."""
    from sglang.test.spec_models import make_eagle_head

    return make_eagle_head(tiny_llama_dir, str(tmp_path_factory.mktemp("tiny_llama_eagle_head")))


@pytest.fixture(scope="session")
def tiny_llama_unsharded_eagle_pair(tiny_llama_unsharded_dir, tmp_path_factory) -> tuple[str, str]:
    """(tiny_llama_unsharded_dir, a random EAGLE head for it)."""
    from sglang.test.spec_models import make_eagle_head

    head = make_eagle_head(tiny_llama_unsharded_dir, str(tmp_path_factory.mktemp("tiny_llama_unsharded_eagle_head")))
    return tiny_llama_unsharded_dir, head


@pytest.fixture(scope="session")
def perfect_llama_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, EAGLE head) of one-layer Llamas where the head predicts exactly the target's
    next token: every draft is accepted."""
    from sglang.test.spec_models import make_perfect_llama_pair

    return make_perfect_llama_pair(str(tmp_path_factory.mktemp("perfect_llama")))


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory) -> str:
    """Tiny DeepSeek-V3 (MLA, MoE, noaux_tc routing) with an MTP layer."""
    from sglang.test.tiny_deepseek import make_tiny_deepseek_v3

    return make_tiny_deepseek_v3(str(tmp_path_factory.mktemp("tiny_deepseek_v3")))


@pytest.fixture(scope="session")
def tiny_deepseek_v3_no_mtp_dir(tmp_path_factory) -> str:
    """Tiny DeepSeek-V3 without an MTP layer: MLA + a dense layer + 2 MoE layers with a shared expert."""
    from sglang.test.tiny_deepseek import make_tiny_deepseek_v3

    return make_tiny_deepseek_v3(str(tmp_path_factory.mktemp("tiny_deepseek_v3_no_mtp")), with_mtp=False)


@pytest.fixture(scope="session")
def perfect_deepseek_v3_dir(tmp_path_factory) -> str:
    """One-layer DeepSeek-V3 whose MTP layer predicts exactly its next token: accept length
    steps + 1."""
    from sglang.test.spec_models import make_perfect_deepseek_v3

    return make_perfect_deepseek_v3(str(tmp_path_factory.mktemp("perfect_deepseek_v3")))


@pytest.fixture(scope="session")
def partial_deepseek_v3_dir(tmp_path_factory) -> str:
    """perfect_deepseek_v3_dir with noise on the MTP layer's input projection: the draft agrees
    with the target on part of the tokens (accept ~2.5 of 4 at 3 steps)."""
    from sglang.test.spec_models import make_perfect_deepseek_v3

    return make_perfect_deepseek_v3(str(tmp_path_factory.mktemp("partial_deepseek_v3")), draft_noise=0.04)
