"""Read-only device tensors made once per shape: each would otherwise cost a kernel launch
(host time) per use. Callers never write into them; they are made outside graph captures."""

from __future__ import annotations

from collections.abc import Callable

import torch


class DeviceConstants:
    def __init__(self, device: str | torch.device):
        self.device = device
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """make()'s tensor, made on the first call with this key."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def full(self, shape: tuple[int, ...], value: int | bool, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """`shape` filled with value."""
        return self.get(("full", shape, value, dtype), lambda: torch.full(shape, value, dtype=dtype, device=self.device))

    def arange(self, n: int) -> torch.Tensor:
        return self.get(("arange", n), lambda: torch.arange(n, device=self.device))

    def tiled_eye(self, repeats: int, k: int) -> torch.Tensor:
        """bool [repeats * k, k]: the k x k identity, `repeats` times."""
        return self.get(("tiled_eye", repeats, k), lambda: torch.eye(k, dtype=torch.bool, device=self.device).repeat(repeats, 1))
