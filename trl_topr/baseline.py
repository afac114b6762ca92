"""How the baseline sets a dataset's effective composition (TOPR paper, section "The baseline").

With rewards +1/-1 and baseline c, positives weigh (1 - c) and negatives (1 + c), so a dataset with a fraction p of
positives trains like one with a fraction

    p_eff = p (1 - c) / (1 + c (1 - 2p))

of positives. For any rewards, p_eff is the share of the total |R - c| that the positives (R - c >= 0) hold, which
reduces to the formula above for +1/-1 rewards. [`topr_advantages`] turns a set of rewards into TOPR's R - c, the one
definition every trainer calls (over the set each documents); the other helpers are shared with dataset curation code.
"""

import math
from collections.abc import Sequence

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)


def topr_baseline(
    rewards: Sequence[float] | torch.Tensor,
    *,
    baseline: float | None = None,
    target_positive_fraction: float | None = None,
) -> float:
    """
    TOPR's baseline c of a set of rewards: `baseline` (`None`: 0, the paper's setting), or with
    `target_positive_fraction` the c at which the positives (R - c >= 0) carry that share of the set's total weight
    |R - c| ([`baseline_for_positive_fraction`]). NaN rewards (completions no reward function could score) are left
    out. Where every reward is equal, no baseline changes the set's composition (its effective positive fraction is 0
    or 1 whatever c): the target then gives c = 0, with a warning (once per process), rather than an error.

    Args:
        rewards (`Sequence[float]` or `torch.Tensor`):
            Rewards of the set.
        baseline (`float`, *optional*):
            A constant baseline.
        target_positive_fraction (`float`, *optional*):
            Target effective positive fraction, in (0, 1); exclusive with `baseline`.

    Returns:
        `float`: c.

    Example:
    ```python
    >>> round(topr_baseline([1.0, -1.0, -1.0, -1.0], target_positive_fraction=0.5), 4)
    -0.5
    >>> topr_baseline([-1.0, -1.0], target_positive_fraction=0.5)  # one-sided: baseline 0
    0.0

    ```
    """
    if baseline is not None and target_positive_fraction is not None:
        raise ValueError("Set `baseline` or `target_positive_fraction`, not both: each sets the baseline.")
    if target_positive_fraction is None:
        return float(baseline) if baseline is not None else 0.0
    values = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    values = values[~torch.isnan(values)]
    if values.unique().numel() < 2:
        logger.warning_once(
            "Every reward of a set TOPR centres is equal, so no baseline meets `target_positive_fraction`: the set "
            "trains with baseline 0 (its positives or its negatives alone)."
        )
        return 0.0
    return baseline_for_positive_fraction(values, target_positive_fraction)


def topr_advantages(
    rewards: Sequence[float] | torch.Tensor,
    *,
    baseline: float | None = None,
    target_positive_fraction: float | None = None,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    TOPR's advantages R - c of a set of rewards, and the baseline c of each: the one definition every trainer uses,
    each over the set it documents.

    c is [`topr_baseline`] of the set (from `baseline` or `target_positive_fraction`), or with `group_size` the mean
    reward of each run of `group_size` consecutive rewards (a prompt's completions, sampled together): GRPO's
    baseline, without its scaling. At most one of the three is set, as [`TOPRArguments`] checks. A NaN reward (a
    completion no reward function could score) gets advantage 0; a group whose rewards are all equal gets advantages
    0; a set whose rewards are all equal trains with c = 0 ([`topr_baseline`]). Nothing raises, nothing is NaN.

    Args:
        rewards (`Sequence[float]` or `torch.Tensor`):
            Rewards of the set, one per completion.
        baseline (`float`, *optional*):
            A constant baseline.
        target_positive_fraction (`float`, *optional*):
            Target effective positive fraction, in (0, 1).
        group_size (`int`, *optional*):
            Centre each group of this many consecutive rewards on its mean.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: the advantages R - c and the baselines c, one per reward (float64 when
        `rewards` is not a tensor, else in its dtype and on its device).

    Example:
    ```python
    >>> advantages, baselines = topr_advantages([1.0, -1.0, -1.0, -1.0], target_positive_fraction=0.5)
    >>> [round(a, 4) for a in advantages.tolist()], round(baselines[0].item(), 4)
    ([1.5, -0.5, -0.5, -0.5], -0.5)
    >>> topr_advantages([1.0, 0.0, 1.0, 1.0], group_size=2)[0].tolist()
    [0.5, -0.5, 0.0, 0.0]

    ```
    """
    rewards = torch.as_tensor(rewards, dtype=None if torch.is_tensor(rewards) else torch.float64)
    if group_size is not None:
        if baseline is not None or target_positive_fraction is not None:
            raise ValueError("Set one baseline: a group's mean, `baseline` or `target_positive_fraction`.")
        if rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (`group_size`).")
        baselines = torch.nanmean(rewards.view(-1, group_size), 1).repeat_interleave(group_size)
    else:
        c = topr_baseline(rewards.detach().cpu(), baseline=baseline, target_positive_fraction=target_positive_fraction)
        baselines = torch.full_like(rewards, c)
    advantages = torch.where(torch.isnan(rewards), 0.0, rewards - baselines).nan_to_num(0.0)
    return advantages, baselines


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
