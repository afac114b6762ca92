"""Replay of past rounds in the iterative loop: each round's training rows are kept with the behavior log-probs
recorded when they were sampled, later rounds train on them again, and the metrics by sample age show how far the
policy has moved from each round's behavior policy, and how much the taper of the negatives weighs."""

import json
import math
from pathlib import Path

import torch
from datasets import Dataset

from .behavior import behavior_logps
from .data import BEHAVIOR_LOGPS, COMPLETION_IDS, PROMPT_IDS, REWARD
from .loss import TAPERED_BELOW, topr_weights
from .precision import training_autocast


TRAIN_ROWS_FILE = "train.jsonl"
SAMPLE_ROUND = "sample_round"


def with_replayed_rows(rows: Dataset, output_dir: Path, round_index: int, replay_rounds: int) -> Dataset:
    """
    A round's own training rows followed by those of the `replay_rounds` rounds before it, as they were saved
    (`round-<r>/train.jsonl`: curated, with the behavior log-probs of their sampling and their `sample_round`).

    Args:
        rows ([`~datasets.Dataset`]):
            The round's own (curated) rows, with a `sample_round` column.
        output_dir (`Path`):
            The loop's folder.
        round_index (`int`):
            The round.
        replay_rounds (`int`):
            How many earlier rounds to replay (rounds before 1 do not exist).

    Returns:
        [`~datasets.Dataset`]: the rows to train on.
    """
    earlier = []
    for previous in range(max(1, round_index - replay_rounds), round_index):
        lines = (output_dir / f"round-{previous}" / TRAIN_ROWS_FILE).read_text().splitlines()
        earlier += [json.loads(line) for line in lines if line.strip()]
    # one table from all the rows, its types inferred from them all (a column that is empty in one round, e.g. a
    # reward function that returned None for every sample, takes the others' type)
    return Dataset.from_list(rows.to_list() + earlier) if earlier else rows


def metrics_by_age(policy, rows: Dataset, round_index: int, args, baseline: float, pad_token_id: int,
                   batch_size: int = 16) -> dict[str, float]:  # fmt: skip
    """
    Per sample age (0: sampled this round, k: k rounds ago), at the start of the round's training: the rows, the
    mean and smallest sequence log-ratio log pi - log mu (pi: the round's starting policy; mu: the recorded behavior
    log-probs), the mean raw importance ratio pi/mu before truncation, the fraction of negatives whose weight is
    tapered (below 0.99), and the age's share of the total weight x |R - c|.

    Args:
        policy ([`~transformers.PreTrainedModel`]):
            The round's starting policy. Every process must call this (the forward is split between them).
        rows ([`~datasets.Dataset`]):
            The rows the round trains on, with `sample_round`, `prompt_ids`, `completion_ids`, `behavior_logps`,
            `reward`.
        round_index (`int`):
            The round.
        args ([`~trl_topr.TOPRConfig`]):
            The training configuration (its `loss_type`, ratio bounds and precision).
        baseline (`float`):
            The baseline c of the round.
        pad_token_id (`int`):
            The tokenizer's padding id.
        batch_size (`int`, *optional*, defaults to `16`):
            Rows per forward.

    Returns:
        `dict[str, float]`: `age_<k>/rows`, `age_<k>/log_ratio_mean`, `age_<k>/log_ratio_min`, `age_<k>/ratio_mean`,
        `age_<k>/negative_tapered_fraction` (`nan` without negatives) and `age_<k>/weight_share`.
    """
    tokenized = [{"input_ids": p + c, "labels": [-100] * len(p) + c}
                 for p, c in zip(rows[PROMPT_IDS], rows[COMPLETION_IDS], strict=True)]  # fmt: skip
    pi = behavior_logps(policy, tokenized, pad_token_id=pad_token_id, batch_size=batch_size,
                        autocast=training_autocast(args, next(policy.parameters()).device),
                        padding_free=args.padding_free)  # fmt: skip
    log_ratio = torch.tensor([math.fsum(p) - math.fsum(m[: len(p)]) for p, m in zip(pi, rows[BEHAVIOR_LOGPS])])
    advantages = torch.tensor(rows[REWARD], dtype=torch.float64) - baseline
    weights = topr_weights(log_ratio, advantages, loss_type=args.loss_type, epsilon=args.epsilon,
                           positive_ratio_bounds=args.positive_ratio_bounds,
                           negative_ratio_bounds=args.negative_ratio_bounds)  # fmt: skip
    mass = weights * advantages.abs()
    ages = torch.tensor([round_index - r for r in rows[SAMPLE_ROUND]])
    metrics = {}
    for age in sorted(set(ages.tolist())):
        at = ages == age
        negatives = at & (advantages < 0)
        metrics.update({
            f"age_{age}/rows": int(at.sum()),
            f"age_{age}/log_ratio_mean": log_ratio[at].mean().item(),
            f"age_{age}/log_ratio_min": log_ratio[at].min().item(),
            f"age_{age}/ratio_mean": log_ratio[at].clamp(max=50).exp().mean().item(),
            f"age_{age}/negative_tapered_fraction": (weights[negatives] < TAPERED_BELOW).double().mean().item()
            if negatives.any() else math.nan,
            f"age_{age}/weight_share": (mass[at].sum() / mass.sum()).item() if mass.sum() > 0 else math.nan,
        })  # fmt: skip
    return metrics
