"""How the baseline sets a dataset's effective composition (TOPR paper, section "The baseline").

With rewards +1/-1 and baseline c, positives weigh (1 - c) and negatives (1 + c), so a dataset with a fraction p of
positives trains like one with a fraction

    p_eff = p (1 - c) / (1 + c (1 - 2p))

of positives. For any rewards, p_eff is the share of the total |R - c| that the positives (R - c >= 0) hold, which
reduces to the formula above for +1/-1 rewards. These helpers are shared by [`TOPRTrainer`] (for
`target_positive_fraction`) and by dataset curation code.
"""

import math
from collections.abc import Sequence

import torch


def effective_positive_fraction(rewards: Sequence[float], baseline: float = 0.0) -> float:
    """
    Share of the total weight `|R - c|` that falls on the positives (`R - c >= 0`).

    Args:
        rewards (`Sequence[float]`):
            Rewards of the dataset.
        baseline (`float`, *optional*, defaults to `0.0`):
            Baseline `c`.

    Returns:
        `float`: p_eff in [0, 1]; `nan` when every reward equals the baseline (nothing is weighted).

    Example:
    ```python
    >>> effective_positive_fraction([1, -1, -1, -1], baseline=0.0)
    0.25
    >>> round(effective_positive_fraction([1, -1, -1, -1], baseline=-0.5), 4)  # p (1 - c) / (1 + c (1 - 2p))
    0.5

    ```
    """
    return _effective_positive_fraction(torch.as_tensor(rewards, dtype=torch.float64), baseline)


def _effective_positive_fraction(rewards: torch.Tensor, baseline: float) -> float:
    advantages = rewards - baseline
    total = advantages.abs().sum().item()
    return advantages.clamp(min=0).sum().item() / total if total > 0 else math.nan


def baseline_for_positive_fraction(rewards: Sequence[float], target: float) -> float:
    """
    Baseline `c` at which a dataset's effective positive fraction equals `target`.

    p_eff falls continuously from 1 to 0 as c rises from the lowest to the highest reward, so c is found by bisection
    on that interval; for +1/-1 rewards it agrees with the closed form `c = (p - t) / (p + t - 2 p t)`.

    Args:
        rewards (`Sequence[float]`):
            Rewards of the dataset. Needs rewards on both sides of the sought baseline: at least two distinct values.
        target (`float`):
            Target effective positive fraction, in (0, 1).

    Returns:
        `float`: the baseline.

    Example:
    ```python
    >>> round(baseline_for_positive_fraction([1, -1, -1, -1], target=0.5), 6)  # p = 0.25: (p - t) / (p + t - 2pt)
    -0.5

    ```
    """
    if not 0.0 < target < 1.0:
        raise ValueError(f"`target_positive_fraction` must be in (0, 1), got {target}.")
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    low, high = rewards.min().item(), rewards.max().item()
    if low == high:
        raise ValueError(
            f"`target_positive_fraction` needs at least two distinct rewards to derive a baseline, but every reward "
            f"is {low}."
        )
    for _ in range(200):  # p_eff(low) = 1 > target > 0 = p_eff(high)
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if _effective_positive_fraction(rewards, middle) > target:
            low = middle
        else:
            high = middle
    return (low + high) / 2
