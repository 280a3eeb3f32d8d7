"""Read-only device tensors made once per shape: each would otherwise cost a kernel launch
(host time) per use. Callers never write into them; they are made outside graph captures."""

from __future__ import annotations

import torch


class DeviceConstants:
    def __init__(self, device: str | torch.device):
        self.device = device
        self._cache: dict[tuple, torch.Tensor] = {}

    def full(self, shape: tuple[int, ...], value: int) -> torch.Tensor:
        """int64 `shape` filled with value."""
        key = ("full", shape, value)
        if key not in self._cache:
            self._cache[key] = torch.full(shape, value, dtype=torch.int64, device=self.device)
        return self._cache[key]

    def arange(self, n: int) -> torch.Tensor:
        key = ("arange", n)
        if key not in self._cache:
            self._cache[key] = torch.arange(n, device=self.device)
        return self._cache[key]

    def tiled_eye(self, repeats: int, k: int) -> torch.Tensor:
        """bool [repeats * k, k]: the k x k identity, `repeats` times."""
        key = ("tiled_eye", repeats, k)
        if key not in self._cache:
            self._cache[key] = torch.eye(k, dtype=torch.bool, device=self.device).repeat(repeats, 1)
        return self._cache[key]
