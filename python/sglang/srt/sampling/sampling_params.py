"""Per-request sampling parameters, with SGLang's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

_GREEDY_EPS = 1e-6
# The seeds torch.Generator.manual_seed accepts.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1
_FLOAT32_MAX = 3.4028234663852886e38
# OpenAI's range for a logit_bias value.
LOGIT_BIAS_LIMIT = 100.0
MAX_PARALLEL_SAMPLES = 128  # n: samples of one prompt (each a request of its own)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Optional[int] = None
    n: int = 1
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's `sampling_params`; unknown keys are an error."""
        d = dict(d or {})
        if "seed" in d:  # OpenAI-style alias
            d.setdefault("sampling_seed", d.pop("seed"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
        d = {k: v for k, v in d.items() if v is not None}
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if isinstance(d.get("stop_token_ids"), int):
            d["stop_token_ids"] = [d["stop_token_ids"]]
        if isinstance(d.get("logit_bias"), dict):
            d["logit_bias"] = {_token_id_key(k): v for k, v in d["logit_bias"].items()}
        params = cls(**d)
        params.verify()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens generated so far."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes the model's logits first (penalties or logit_bias)."""
        return self.has_penalties or bool(self.logit_bias)

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid field."""
        _check_type("max_new_tokens", self.max_new_tokens, int)
        _check_type("min_new_tokens", self.min_new_tokens, int)
        _check_type("top_k", self.top_k, int)
        _check_type("n", self.n, int)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            _check_finite(name, getattr(self, name))
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 1 <= self.n <= MAX_PARALLEL_SAMPLES:
            raise ValueError(f"n must be in [1, {MAX_PARALLEL_SAMPLES}], got {self.n}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {vocab_size}")
        if self.sampling_seed is not None:
            _check_type("seed", self.sampling_seed, int)
            if not SEED_MIN <= self.sampling_seed <= SEED_MAX:
                raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.sampling_seed}")
        if self.logit_bias is not None:
            self._verify_logit_bias(vocab_size)

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        for token_id, bias in self.logit_bias.items():
            _check_type("a logit_bias key", token_id, int)
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")
            _check_finite(f"logit_bias[{token_id}]", bias)
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias} for token {token_id}"
                )


def _check_type(name: str, value: Any, types) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        raise ValueError(f"{name} has the wrong type: {type(value).__name__}")


def _check_finite(name: str, value: Any) -> None:
    """A number the sampler's float32 tensors hold as a finite value."""
    _check_type(name, value, (int, float))
    if not -_FLOAT32_MAX <= value <= _FLOAT32_MAX:  # NaN fails both comparisons
        raise ValueError(f"{name} must be a finite number within the float32 range, got {value}")


def _token_id_key(key: Any) -> Any:
    """A logit_bias key as a token id: JSON object keys are strings ("50256")."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20:
        return int(key)
    if isinstance(key, str):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    return key
