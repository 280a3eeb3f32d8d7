"""Per-request sampling parameters, with SGLang's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

_GREEDY_EPS = 1e-6
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

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
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

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid field."""
        _check_type("max_new_tokens", self.max_new_tokens, int)
        _check_type("min_new_tokens", self.min_new_tokens, int)
        _check_type("top_k", self.top_k, int)
        _check_type("n", self.n, int)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            _check_type(name, getattr(self, name), (int, float))
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


def _check_type(name: str, value: Any, types) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        raise ValueError(f"{name} has the wrong type: {type(value).__name__}")
