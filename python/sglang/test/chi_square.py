"""Chi-square goodness of fit for sampling tests: observed token counts against a law."""

from __future__ import annotations

import math

import torch


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: dict[int, int], expected: torch.Tensor, n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells expecting fewer than 5 samples are pooled."""
    big = [t for t in range(expected.numel()) if expected[t] * n >= 5]
    cells = [(counts.get(t, 0), float(expected[t]) * n) for t in big]
    rest_obs = n - sum(o for o, _ in cells)
    rest_exp = n - sum(e for _, e in cells)
    if rest_exp > 1e-9:
        cells.append((rest_obs, rest_exp))
    else:
        assert rest_obs == 0, "tokens outside the target's support"
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def fits(counts: dict[int, int], expected: torch.Tensor, n: int) -> bool:
    """Whether counts (n samples) fit the law `expected` at p = 0.001."""
    stat, df = chi_square(counts, expected, n)
    return df == 0 or stat < chi_square_critical(df)
