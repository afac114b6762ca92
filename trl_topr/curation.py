"""Per-prompt curation of TOPR datasets: composition reports, "Anna Karenina" curation and rebalancing.

The baseline and the dataset's composition are two levers on the same quantity, the effective positive fraction (see
[`effective_positive_fraction`]). These helpers read and change the composition itself. They are pure `datasets`
transformations: rows are selected by index, so every other column (`completion`, `behavior_logps`, ...) passes through
untouched and the kept rows stay in their original order. A row is positive when `reward - baseline >= 0`, as in
[`effective_positive_fraction`]; prompts are grouped by content (a list of messages by its JSON form).
"""

import json
import math
import random
from typing import Any

from datasets import Dataset

from .baseline import baseline_for_positive_fraction, effective_positive_fraction


def _rewards(dataset: Dataset, reward_column: str) -> list[float]:
    if reward_column not in dataset.column_names:
        raise ValueError(f"The dataset has no reward column '{reward_column}', only {dataset.column_names}.")
    return [float(r) for r in dataset.with_format(None)[reward_column][:]]


def _groups(dataset: Dataset, reward_column: str, baseline: float) -> tuple[list[float], dict[str, list[list[int]]]]:
    """Rewards, and for each prompt (in order of first appearance) its [positive, negative] row indices."""
    rewards = _rewards(dataset, reward_column)
    if "prompt" not in dataset.column_names:
        raise ValueError(f"The dataset has no 'prompt' column; its columns are {dataset.column_names}.")
    groups: dict[str, list[list[int]]] = {}
    for index, prompt in enumerate(dataset.with_format(None)["prompt"][:]):
        key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
        groups.setdefault(key, [[], []])[0 if rewards[index] - baseline >= 0 else 1].append(index)
    return rewards, groups


def _share(count: int, total: int) -> float:
    return count / total if total else math.nan


def composition_report(dataset: Dataset, baseline: float = 0.0, reward_column: str = "reward") -> dict[str, Any]:
    """
    Composition of a TOPR dataset, overall and per prompt.

    Args:
        dataset (`Dataset`):
            Dataset with a `prompt` column (text or messages) and a reward column.
        baseline (`float`, *optional*, defaults to `0.0`):
            Baseline `c`: a row is positive when `reward - c >= 0`.
        reward_column (`str`, *optional*, defaults to `"reward"`):
            Name of the reward column.

    Returns:
        `dict[str, Any]`: `num_rows`, `num_prompts`, `baseline`, `positive_fraction` (p), `effective_positive_fraction`
        (p_eff), and the fractions of prompts with at least one positive (`prompts_with_positive_fraction`), only
        positives (`prompts_only_positive_fraction`), only negatives (`prompts_only_negative_fraction`) and both
        (`prompts_mixed_fraction`). Fractions are `nan` for an empty dataset.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict({"prompt": ["a", "a", "b", "b"], "reward": [1.0, -1.0, -1.0, -1.0]})
    >>> report = composition_report(dataset, baseline=-0.5)
    >>> report["positive_fraction"], round(report["effective_positive_fraction"], 4), report["prompts_mixed_fraction"]
    (0.25, 0.5, 0.5)

    ```
    """
    rewards, groups = _groups(dataset, reward_column, baseline)
    rows, prompts = len(rewards), len(groups)
    with_positive = sum(1 for positives, _ in groups.values() if positives)
    only_positive = sum(1 for positives, negatives in groups.values() if positives and not negatives)
    only_negative = prompts - with_positive
    return {
        "num_rows": rows,
        "num_prompts": prompts,
        "baseline": baseline,
        "positive_fraction": _share(sum(len(positives) for positives, _ in groups.values()), rows),
        "effective_positive_fraction": effective_positive_fraction(rewards, baseline),
        "prompts_with_positive_fraction": _share(with_positive, prompts),
        "prompts_only_positive_fraction": _share(only_positive, prompts),
        "prompts_only_negative_fraction": _share(only_negative, prompts),
        "prompts_mixed_fraction": _share(with_positive - only_positive, prompts),
    }


def baseline_for_target(dataset: Dataset, target_positive_fraction: float, reward_column: str = "reward") -> float:
    """
    Baseline `c` at which the dataset's effective positive fraction equals `target_positive_fraction`.

    Args:
        dataset (`Dataset`):
            Dataset with a reward column holding at least two distinct values.
        target_positive_fraction (`float`):
            Target effective positive fraction, in (0, 1).
        reward_column (`str`, *optional*, defaults to `"reward"`):
            Name of the reward column.

    Returns:
        `float`: the baseline, from [`baseline_for_positive_fraction`].

    Example:
    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict({"prompt": ["a", "a", "b", "b"], "reward": [1.0, -1.0, -1.0, -1.0]})
    >>> round(baseline_for_target(dataset, 0.5), 6)
    -0.5

    ```
    """
    rewards = _rewards(dataset, reward_column)
    if not rewards:
        raise ValueError("Cannot derive a baseline from an empty dataset.")
    return baseline_for_positive_fraction(rewards, target_positive_fraction)


def anna_karenina(dataset: Dataset, reward_column: str = "reward", baseline: float = 0.0) -> Dataset:
    """
    The paper's "Anna Karenina" curation: per prompt, keep the first positive completion and all the negative ones.

    "All happy families are alike": one correct solution per question is enough, every incorrect one is informative.
    Prompts without a positive keep all their negatives. Kept rows stay in their original order.

    Args:
        dataset (`Dataset`):
            Dataset with a `prompt` column (text or messages) and a reward column.
        reward_column (`str`, *optional*, defaults to `"reward"`):
            Name of the reward column.
        baseline (`float`, *optional*, defaults to `0.0`):
            A row is positive when `reward - baseline >= 0` (use e.g. `0.5` for 0/1 rewards).

    Returns:
        `Dataset`: the kept rows, with all their columns.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict({"prompt": ["a", "a", "a", "b"], "reward": [-1.0, 1.0, 1.0, 1.0]})
    >>> anna_karenina(dataset)["reward"][:]
    [-1.0, 1.0, 1.0]

    ```
    """
    _, groups = _groups(dataset, reward_column, baseline)
    kept = [index for positives, negatives in groups.values() for index in positives[:1] + negatives]
    return dataset.select(sorted(kept))


def rebalance(
    dataset: Dataset,
    max_positives_per_prompt: int | None = None,
    max_negatives_per_prompt: int | None = None,
    drop_prompts_without_positive: bool = False,
    drop_prompts_without_negative: bool = False,
    seed: int = 0,
    reward_column: str = "reward",
    baseline: float = 0.0,
) -> Dataset:
    """
    Cap the positives and negatives of each prompt, and optionally drop prompts that are all-negative or all-positive.

    Rows over a cap are dropped at random (deterministic for a given `seed` and dataset); kept rows stay in their
    original order. The drops look at the dataset before capping. [`anna_karenina`] is the case
    `max_positives_per_prompt=1`, except that it keeps the *first* positive rather than a random one.

    Args:
        dataset (`Dataset`):
            Dataset with a `prompt` column (text or messages) and a reward column.
        max_positives_per_prompt (`int` or `None`, *optional*, defaults to `None`):
            Most positives kept per prompt; `None` keeps all.
        max_negatives_per_prompt (`int` or `None`, *optional*, defaults to `None`):
            Most negatives kept per prompt; `None` keeps all.
        drop_prompts_without_positive (`bool`, *optional*, defaults to `False`):
            Drop the prompts whose completions are all negative.
        drop_prompts_without_negative (`bool`, *optional*, defaults to `False`):
            Drop the prompts whose completions are all positive.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the random choice of the kept rows.
        reward_column (`str`, *optional*, defaults to `"reward"`):
            Name of the reward column.
        baseline (`float`, *optional*, defaults to `0.0`):
            A row is positive when `reward - baseline >= 0`.

    Returns:
        `Dataset`: the kept rows, with all their columns.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict({"prompt": ["a", "a", "a", "b"], "reward": [1.0, 1.0, -1.0, -1.0]})
    >>> rebalance(dataset, max_positives_per_prompt=1, drop_prompts_without_positive=True)["reward"][:]
    [1.0, -1.0]

    ```
    """
    caps = {"max_positives_per_prompt": max_positives_per_prompt, "max_negatives_per_prompt": max_negatives_per_prompt}
    for name, cap in caps.items():
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"`{name}` must be None or a non-negative integer, got {cap!r}.")
    _, groups = _groups(dataset, reward_column, baseline)
    rng = random.Random(seed)
    kept = []
    for positives, negatives in groups.values():
        if (drop_prompts_without_positive and not positives) or (drop_prompts_without_negative and not negatives):
            continue
        for indices, cap in ((positives, max_positives_per_prompt), (negatives, max_negatives_per_prompt)):
            kept += indices if cap is None or len(indices) <= cap else rng.sample(indices, cap)
    return dataset.select(sorted(kept))
