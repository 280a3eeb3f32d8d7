"""Request bodies of the admin endpoints (the OpenAI ones are in openai/protocol.py, /generate's
is GenerateReqInput)."""

from __future__ import annotations

from typing import Optional

from pydantic import ConfigDict, Field

from sglang.srt.managers.request_validation import ValidatedRequest

# Longer than any profile anyone reads, short enough to stay an int everywhere.
MAX_PROFILE_STEPS = 1 << 20


class ProfileRequest(ValidatedRequest):
    """POST /start_profile (an empty body: all defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    output_dir: Optional[str] = Field(default=None, min_length=1, pattern=r"^[^\x00]*$")
    num_steps: Optional[int] = Field(default=None, ge=1, le=MAX_PROFILE_STEPS)
    activities: Optional[list[str]] = None
