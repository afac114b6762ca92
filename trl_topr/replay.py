"""Replay of past rounds in the iterative loop: each round's training rows are kept with the behavior log-probs
recorded when they were sampled, later rounds train on them again, and the metrics by sample age show how far the
policy has moved from each round's behavior policy, and how much the taper of the negatives weighs."""

import json
import math
from pathlib import Path

import torch
from datasets import Dataset

from .data import BEHAVIOR_LOGPS, COMPLETION_IDS, PROMPT_IDS, REWARD, TOOL_MASK, TOPRDataError
from .logprobs import behavior_logps, completion_row, logps_settings
from .loss import ratio_metrics_by


TRAIN_ROWS_FILE = "train.jsonl"
SAMPLE_ROUND = "sample_round"


# What a replayed row needs: the ids trained, the behavior log-probs of its sampling, its reward, its round
REPLAYED_COLUMNS = (PROMPT_IDS, COMPLETION_IDS, BEHAVIOR_LOGPS, REWARD, SAMPLE_ROUND)


def read_train_rows(
    output_dir: Path, round_index: int, recorded_rows: int | None = None, columns: tuple = REPLAYED_COLUMNS
) -> list[dict]:
    """
    The training rows a round saved (`round-<r>/train.jsonl`), checked line by line: what replay trains again.

    Args:
        output_dir (`Path`):
            The loop's folder.
        round_index (`int`):
            The round that saved the rows.
        recorded_rows (`int`, *optional*):
            How many rows the round recorded (`num_new_train_rows` of its line in `metrics.jsonl`): fewer lines
            means the file was cut at a line's end.
        columns (`tuple`, *optional*, defaults to `REPLAYED_COLUMNS`):
            The columns every row must have (with tools, also `tool_mask`).

    Returns:
        `list[dict]`: the rows, in order.

    Raises:
        `FileNotFoundError`: when the file is missing.
        [`~trl_topr.TOPRDataError`]: naming the file and the line, for a line that is not a JSON row with the
        columns replay needs (a file cut mid-line), and for a file with fewer rows than the round recorded.
    """
    path = Path(output_dir) / f"round-{round_index}" / TRAIN_ROWS_FILE
    recovery = (
        f"Restore it from a copy, or go on without replaying round {round_index} (a lower `replay_rounds`, "
        "or a new `output_dir`)."
    )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: round {round_index}'s training rows, which replay trains again. {recovery}"
        )
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise TOPRDataError(
                f"{path}, line {number}: not a JSON row ({error}); the file was cut or damaged. {recovery}"
            ) from error
        missing = [c for c in columns if not isinstance(row, dict) or row.get(c) is None]
        if missing:
            raise TOPRDataError(f"{path}, line {number}: no {missing} (replay needs {list(columns)}). {recovery}")
        rows.append(row)
    if recorded_rows is not None and len(rows) != recorded_rows:
        raise TOPRDataError(
            f"{path} has {len(rows)} rows where round {round_index} recorded {recorded_rows}: the "
            f"file was cut after line {len(rows)}. {recovery}"
        )
    return rows


def replayed_rounds(round_index: int, replay_rounds: int) -> range:
    """
    The earlier rounds whose rows round `round_index` trains again: the `replay_rounds` rounds before it (rounds
    before 1 do not exist).

    Args:
        round_index (`int`):
            The round.
        replay_rounds (`int`):
            How many earlier rounds to replay.

    Returns:
        `range`: the rounds, oldest first.
    """
    return range(max(1, round_index - replay_rounds), round_index)


def with_replayed_rows(
    rows: Dataset, output_dir: Path, round_index: int, replay_rounds: int, recorded_rows: dict[int, int] | None = None
) -> Dataset:
    """
    A round's own training rows followed by those of the `replay_rounds` rounds before it, as they were saved
    (`round-<r>/train.jsonl`: curated, with the behavior log-probs of their sampling and their `sample_round`), read
    with [`read_train_rows`].

    Args:
        rows ([`~datasets.Dataset`]):
            The round's own (curated) rows, with a `sample_round` column.
        output_dir (`Path`):
            The loop's folder.
        round_index (`int`):
            The round.
        replay_rounds (`int`):
            How many earlier rounds to replay (rounds before 1 do not exist).
        recorded_rows (`dict[int, int]`, *optional*):
            How many rows each earlier round recorded, to catch a file cut at a line's end.

    Returns:
        [`~datasets.Dataset`]: the rows to train on.
    """
    earlier = []
    # trajectories sampled with tools are replayed with their tool mask: the policy's tokens only
    columns = REPLAYED_COLUMNS + ((TOOL_MASK,) if TOOL_MASK in rows.column_names else ())
    for previous in replayed_rounds(round_index, replay_rounds):
        earlier += read_train_rows(output_dir, previous, (recorded_rows or {}).get(previous), columns)
    # one table from all the rows, its types inferred from them all (a column that is empty in one round, e.g. a
    # reward function that returned None for every sample, takes the others' type)
    return Dataset.from_list(rows.to_list() + earlier) if earlier else rows


def metrics_by_age(
    policy, rows: Dataset, round_index: int, args, baseline: float, processing_class, batch_size: int = 16
) -> dict[str, float]:
    """
    Per sample age (0: sampled this round, k: k rounds ago), at the start of the round's training: the rows, the
    mean and smallest sequence log-ratio log pi - log mu (mu: the recorded behavior log-probs; pi: the round's
    starting policy, computed for the replayed rows, while the rows of age 0 were sampled by that policy, so their
    log-ratio is 0: pi = mu, up to the sampler's numerics where mu is vLLM's own), the mean raw importance ratio pi/mu
    before truncation, the fraction of negatives whose weight is tapered (below 0.99), the fraction of rows whose
    ratio the loss's window clamps ([`~trl_topr.loss.clamped_ratios`]), the effective sample size of the raw ratios
    ([`~trl_topr.loss.effective_sample_size`]) and the age's share of the total weight x |R - c|; and the effective
    sample size and clamped fraction of all the rows.

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
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer (its padding id).
        batch_size (`int`, *optional*, defaults to `16`):
            Rows per forward.

    Returns:
        `dict[str, float]`: `age_<k>/rows`, `age_<k>/log_ratio_mean`, `age_<k>/log_ratio_min`, `age_<k>/ratio_mean`,
        `age_<k>/negative_tapered_fraction` (`nan` without negatives), `age_<k>/clamped_fraction`,
        `age_<k>/effective_sample_size`, `age_<k>/positive_weight_mean`, `age_<k>/negative_weight_mean` and
        `age_<k>/weight_share`; `effective_sample_size` and `clamped_fraction` ([`~trl_topr.loss.ratio_metrics_by`]).
    """
    # The rows sampled this round were sampled by this very policy (pi = mu): only the replayed ones need a forward
    masks = rows[TOOL_MASK] if TOOL_MASK in rows.column_names else [None] * len(rows)
    replayed = [i for i, sampled in enumerate(rows[SAMPLE_ROUND]) if sampled < round_index]
    tokenized = [completion_row(rows[PROMPT_IDS][i], rows[COMPLETION_IDS][i], masks[i]) for i in replayed]
    settings = logps_settings(args, processing_class, next(policy.parameters()).device, batch_size=batch_size)
    pi = behavior_logps(policy, tokenized, settings) if replayed else []
    log_ratio = torch.zeros(len(rows), dtype=torch.float64)
    mu = rows[BEHAVIOR_LOGPS]
    for i, values in zip(replayed, pi, strict=True):
        log_ratio[i] = math.fsum(values) - math.fsum(mu[i][: len(values)])
    advantages = torch.tensor(rows[REWARD], dtype=torch.float64) - baseline
    ages = torch.tensor([round_index - r for r in rows[SAMPLE_ROUND]])
    return ratio_metrics_by(ages, log_ratio, advantages, "age", **args.weight_options())
