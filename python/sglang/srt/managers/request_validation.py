"""What every request model of every API shares: the checks that pydantic's field types do not
express by themselves.

Invariants of a request that passes `ValidatedRequest`: its float fields are finite, and every
string anywhere in its body (prompts, messages, stop strings, ids, nested dicts) encodes as
UTF-8, i.e. holds no lone surrogate such as the JSON escape "\\ud800" (a tokenizer raises on
one, and no response containing it could be encoded).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sglang.srt.sampling.sampling_params import SEED_MAX, SEED_MIN

Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]


def lone_surrogate_path(value: Any, path: str = "") -> Optional[str]:
    """The path (e.g. "messages.0.content") of the first string in `value` (nested dicts and
    lists, keys included) that does not encode as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{path or 'body'} (character {e.start})"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # the error message must encode
            where = f"{path}.{name}" if path else name
            found = lone_surrogate_path(key, where) or lone_surrogate_path(item, where)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


class ValidatedRequest(BaseModel):
    """Base of every request body model: finite floats, valid Unicode everywhere."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _reject_lone_surrogates(cls, data: Any) -> Any:
        where = lone_surrogate_path(data)
        if where is not None:
            raise ValueError(f"{where}: the text contains a lone UTF-16 surrogate (not valid Unicode)")
        return data
