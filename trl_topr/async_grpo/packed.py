"""What TOPR reads of TRL's packed batches: each sample's version, reward and group-centred reward, and the
samples' tokens laid out again as sequences."""

import math
from collections.abc import Callable

import torch

from ..trl_seam.asynchronous import GRPO_STD_EPSILON


# The batch's key of each packed sample's (policy version that drew it, reward, reward less its group's mean), a
# (samples, 3) tensor per process, padded with NaN
SAMPLES = "topr_samples"
ADVANTAGES, BASELINES = "topr_advantages", "topr_baselines"  # each sample's R - c and c (`get_batch_samples`)
MODEL_VERSION = "sample/model_version"  # a sample's metric: the policy version that drew it (logged as a mean too)


def segment_positions(segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # For each trained token of a packed row, its sample (renumbered 0, 1, ... over the samples present) and its
    # position among that sample's trained tokens, in order
    _, rows = torch.unique(segment, return_inverse=True)
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.empty_like(rows)
    positions[order] = torch.arange(rows.numel(), device=rows.device) - starts[rows[order]]
    return rows, positions


class PerSampleCollator:
    # TRL's collator, with each packed sample's (version that drew it, reward, reward less its group's mean) as a
    # (num_processes, samples, 3) tensor, padded with NaN: the version stamped among its metrics as the trainer reads
    # it from the queue, the reward and the group's spread as TRL's worker records them among its metrics
    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, examples):
        batch = self.collate(examples)
        (rows,) = examples
        values = [[per_sample(sample) for sample in row.samples] for row in rows]
        width = max(len(row) for row in values)
        nan = (math.nan,) * 3
        batch[SAMPLES] = torch.tensor([row + [nan] * (width - len(row)) for row in values], dtype=torch.float64)
        return batch


def samples_of(batch: dict) -> torch.Tensor:
    # This process's samples of a batch, (samples, 3): the dispatched row of `SAMPLES`, its padding dropped
    values = batch[SAMPLES].reshape(-1, 3)
    return values[~torch.isnan(values[:, 0])]


def per_sample(sample: dict) -> tuple[float, float, float]:
    """
    What TOPR reads of a sample of TRL's asynchronous trainer (as its dataset yields it): the policy version that drew
    it, its reward, and its reward less the mean reward of its group (the prompt's samples). TRL's worker records the
    reward and the group's standard deviation among the sample's metrics and gives it GRPO's advantage
    (R - mean) / (std + 1e-8), from which R - mean is recovered.

    Args:
        sample (`dict`):
            A sample as TRL's rollout dataset yields it (`advantage`, `metrics`).

    Returns:
        `tuple[float, float, float]`: version, reward, reward less its group's mean (NaN where unscored).
    """
    metrics = sample["metrics"]
    if "reward" not in metrics:
        raise ValueError(
            "A rollout sample carries no `reward` among its `metrics`, from which TOPR's R - c is computed: give "
            "each sample its reward there, as TRL's worker does, or set `use_worker_advantages=True` to train the "
            "worker's `advantage` as it is."
        )
    centred = sample["advantage"] * (metrics.get("reward_std", math.nan) + GRPO_STD_EPSILON)
    return float(metrics[MODEL_VERSION]), float(metrics["reward"]), float(centred)


class StampedQueue:
    # The rollout queue as the trainer reads it: each sample with its `model_version` among its metrics, which TRL's
    # dataset passes on to the collator (the version itself it does not)
    def __init__(self, samples):
        self.samples = samples

    def get(self, *args, **kwargs):
        sample = self.samples.get(*args, **kwargs)
        sample.metrics = {**sample.metrics, MODEL_VERSION: float(sample.model_version)}
        return sample

    def __getattr__(self, name: str):
        return getattr(self.samples, name)
