"""The TOPR objective as pure tensor functions (no Trainer needed).

Tapered Off-Policy REINFORCE (Le Roux et al., 2025, arXiv:2503.14286). For a completion y of a prompt x, sampled by a
behavior policy mu, with reward R and baseline c, the per-sequence loss is

    alpha = 1                               if R - c >= 0   (positives: SFT-like, no ratio)
    alpha = clip(pi(y|x) / mu(y|x), 0, 1)   if R - c <  0   (negatives: tapered ratio)
    loss  = - sg(alpha) * (R - c) * log pi(y|x) / |y|

where `sg` stops the gradient. The ratio is computed in log space and its log is clamped to the window before `exp`,
so the weight is finite for any gap between pi and mu. The same code computes the paper's comparison family by
changing the ratio window of each sign (`RATIO_BOUNDS`), and PPO's clipped surrogate by zeroing the weight outside the
trust region.
"""

import math

import torch


# Each loss type and its weights of positives / negatives: the one list of them (the configurations' help reads it)
LOSS_TYPE_WEIGHTS = {
    "topr": "1 / clip(pi/mu, 0, 1)",
    "reinforce": "1 / 1",
    "is": "pi/mu / pi/mu",
    "tis": "clip(pi/mu, 0, 1) for both",
    "positives_only": "1 / 0",
    "ppo_clip": "PPO's clipped surrogate",
}
LOSS_TYPES = tuple(LOSS_TYPE_WEIGHTS)
LOSS_TYPES_HELP = ", ".join(f"'{name}' ({weights})" for name, weights in LOSS_TYPE_WEIGHTS.items())
RATIO_LEVELS = ("sequence", "token", "sequence_mean")
LOSS_NORMALIZATIONS = ("sequence_length", "token_mean", "sum")

# Ratio windows (a, b) of each sign: the weight is clip(pi/mu, a, b). A window (1, 1) means weight 1 (no ratio),
# (0, 0) drops the sign.
RATIO_BOUNDS = {
    "topr": ((1.0, 1.0), (0.0, 1.0)),
    "reinforce": ((1.0, 1.0), (1.0, 1.0)),
    "is": ((0.0, math.inf), (0.0, math.inf)),
    "tis": ((0.0, 1.0), (0.0, 1.0)),
    "positives_only": ((1.0, 1.0), (0.0, 0.0)),
}

# exp(20) ~ 4.9e8. Only untruncated windows (upper bound inf, e.g. `loss_type="is"`) ever reach this cap: it keeps
# their weight, and so the loss, finite in float32 whatever the log-ratio.
MAX_LOG_RATIO = 20.0
# A negative counts as tapered when its weight is below this: its ratio 1% or more under 1, not float noise (an
# on-policy sequence's log-ratio is off 0 by about 1e-6 from one forward to another, which `< 1` counted).
TAPERED_BELOW = 0.99
# A weight counts as clamped when its ratio lies 1% or more outside its window (beyond float noise, as above).
CLAMPED_BEYOND = 1.01


def resolve_ratio_bounds(
    loss_type: str = "topr",
    positive_ratio_bounds: tuple[float, float] | None = None,
    negative_ratio_bounds: tuple[float, float] | None = None,
) -> tuple[tuple[float, float], tuple[float, float]]:
    """
    Ratio windows `(a+, b+)` and `(a-, b-)` for a `loss_type`, with custom windows taking precedence.

    Args:
        loss_type (`str`, *optional*, defaults to `"topr"`):
            One of `LOSS_TYPES` except `"ppo_clip"`, whose weight is not a clipped ratio.
        positive_ratio_bounds (`tuple[float, float]`, *optional*):
            Window of the ratio for sequences with `R - c >= 0`. Defaults to the preset of `loss_type`.
        negative_ratio_bounds (`tuple[float, float]`, *optional*):
            Window of the ratio for sequences with `R - c < 0`. Defaults to the preset of `loss_type`.

    Returns:
        `tuple[tuple[float, float], tuple[float, float]]`: the positive and negative windows.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown `loss_type` {loss_type!r}: expected one of {LOSS_TYPES}.")
    if loss_type == "ppo_clip":
        if positive_ratio_bounds is not None or negative_ratio_bounds is not None:
            raise ValueError(
                "`positive_ratio_bounds` and `negative_ratio_bounds` do not apply to `loss_type='ppo_clip'`, whose "
                "trust region is set by `epsilon`."
            )
        return (0.0, 1.0), (0.0, 1.0)  # unused by ppo_clip
    preset_positive, preset_negative = RATIO_BOUNDS[loss_type]
    bounds = (
        tuple(float(b) for b in (positive_ratio_bounds or preset_positive)),
        tuple(float(b) for b in (negative_ratio_bounds or preset_negative)),
    )
    for name, (low, high) in zip(("positive_ratio_bounds", "negative_ratio_bounds"), bounds, strict=True):
        if not (0.0 <= low <= high) or math.isnan(high):
            raise ValueError(f"`{name}` must satisfy 0 <= low <= high, got ({low}, {high}).")
    return bounds


def check_loss_options(
    loss_type: str = "topr",
    ratio_level: str = "sequence",
    loss_normalization: str = "sequence_length",
    positive_ratio_bounds=None,
    negative_ratio_bounds=None,
    epsilon: float = 0.2,
) -> None:
    """
    Check the options of the TOPR objective, as [`topr_loss`] and the configurations take them: each by its name.

    Args:
        loss_type (`str`, *optional*, defaults to `"topr"`):
            One of `LOSS_TYPES`.
        ratio_level (`str`, *optional*, defaults to `"sequence"`):
            One of `RATIO_LEVELS`.
        loss_normalization (`str`, *optional*, defaults to `"sequence_length"`):
            One of `LOSS_NORMALIZATIONS`.
        positive_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window `[low, high]` of the positives' ratio.
        negative_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window `[low, high]` of the negatives' ratio.
        epsilon (`float`, *optional*, defaults to `0.2`):
            Trust region of `"ppo_clip"`, in (0, 1).

    Raises:
        `ValueError`: naming the first option with a wrong value.
    """
    for name, value, allowed in (
        ("loss_type", loss_type, LOSS_TYPES),
        ("ratio_level", ratio_level, RATIO_LEVELS),
        ("loss_normalization", loss_normalization, LOSS_NORMALIZATIONS),
    ):
        if value not in allowed:
            raise ValueError(f"Unknown `{name}` {value!r}: expected one of {allowed}.")
    for name, bounds in (
        ("positive_ratio_bounds", positive_ratio_bounds),
        ("negative_ratio_bounds", negative_ratio_bounds),
    ):
        if bounds is not None and len(bounds) != 2:
            raise ValueError(f"`{name}` must be two numbers [low, high], got {bounds}.")
    resolve_ratio_bounds(loss_type, positive_ratio_bounds, negative_ratio_bounds)
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"`epsilon` must be in (0, 1), got {epsilon}.")


def _clipped_ratio(log_ratio: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    # clip(exp(log_ratio), a, b) computed as exp(clamp(log_ratio, log a, log b)): never overflows.
    low, high = bounds
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = min(math.log(high), MAX_LOG_RATIO) if high > 0 else -math.inf
    return log_ratio.clamp(min=log_low, max=log_high).exp()


def topr_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_type: str = "topr",
    positive_ratio_bounds: tuple[float, float] | None = None,
    negative_ratio_bounds: tuple[float, float] | None = None,
    epsilon: float = 0.2,
) -> torch.Tensor:
    """
    Importance weight `alpha` of each sequence (or token) from its log-ratio `log pi - log mu` and advantage `R - c`.

    Args:
        log_ratio (`torch.Tensor`):
            Log of the importance ratio pi/mu, any shape. Should carry no gradient.
        advantages (`torch.Tensor`):
            `R - c`, broadcastable to `log_ratio`. Its sign selects the window.
        loss_type (`str`, *optional*, defaults to `"topr"`):
            Preset of the windows, see [`topr_loss`].
        positive_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window for `R - c >= 0`.
        negative_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window for `R - c < 0`.
        epsilon (`float`, *optional*, defaults to `0.2`):
            Trust region of `loss_type="ppo_clip"`.

    Returns:
        `torch.Tensor`: the weights, shaped like `log_ratio`, finite and non-negative.
    """
    positive = advantages >= 0
    if loss_type == "ppo_clip":
        # d/dtheta of min(r A, clip(r, 1-eps, 1+eps) A) is r A grad log pi inside the trust region, 0 outside it.
        resolve_ratio_bounds(loss_type, positive_ratio_bounds, negative_ratio_bounds)
        ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp()
        active = torch.where(positive, log_ratio <= math.log1p(epsilon), log_ratio >= math.log1p(-epsilon))
        return ratio * active
    positive_bounds, negative_bounds = resolve_ratio_bounds(loss_type, positive_ratio_bounds, negative_ratio_bounds)
    return torch.where(
        positive, _clipped_ratio(log_ratio, positive_bounds), _clipped_ratio(log_ratio, negative_bounds)
    )


def clamped_ratios(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_type: str = "topr",
    positive_ratio_bounds: tuple[float, float] | None = None,
    negative_ratio_bounds: tuple[float, float] | None = None,
    epsilon: float = 0.2,
) -> torch.Tensor:
    """
    Which sequences (or tokens) have an importance ratio pi/mu that the loss's window clamps: 1% or more outside a
    window that uses the ratio (`a < b`: TOPR's negatives and TIS above 1, IS past its `MAX_LOG_RATIO` cap), or, for
    `loss_type="ppo_clip"`, where its surrogate is clipped (past `1 + epsilon` for a positive, under `1 - epsilon` for
    a negative: no gradient). A fixed weight (`a = b`: TOPR's and REINFORCE's weight 1,
    positives-only's 0 for negatives) does not use the ratio and is never clamped.

    Args:
        log_ratio (`torch.Tensor`):
            Log of the importance ratio pi/mu, any shape.
        advantages (`torch.Tensor`):
            `R - c`, broadcastable to `log_ratio`. Its sign selects the window.
        loss_type (`str`, *optional*, defaults to `"topr"`):
            Preset of the windows, see [`topr_loss`].
        positive_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window for `R - c >= 0`.
        negative_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window for `R - c < 0`.
        epsilon (`float`, *optional*, defaults to `0.2`):
            Trust region of `loss_type="ppo_clip"`.

    Returns:
        `torch.Tensor`: a boolean tensor shaped like `log_ratio`.
    """
    positive = advantages >= 0
    if loss_type == "ppo_clip":
        inside = torch.where(positive, log_ratio <= math.log1p(epsilon), log_ratio >= math.log1p(-epsilon))
        return ~inside
    margin = math.log(CLAMPED_BEYOND)

    def outside(bounds: tuple[float, float]) -> torch.Tensor:
        low, high = bounds
        if low == high:
            return torch.zeros_like(log_ratio, dtype=torch.bool)
        above = log_ratio > min(math.log(high), MAX_LOG_RATIO) + margin
        return above | (log_ratio < math.log(low) - margin) if low > 0 else above

    positive_bounds, negative_bounds = resolve_ratio_bounds(loss_type, positive_ratio_bounds, negative_ratio_bounds)
    return torch.where(positive, outside(positive_bounds), outside(negative_bounds))


def effective_sample_size(log_ratio: torch.Tensor) -> float:
    """
    Effective sample size of importance weights, as a fraction of their number: `(sum w)^2 / (n sum w^2)` with
    `w = pi/mu`, in `(0, 1]`. It is 1 on-policy (every ratio equal) and falls towards `1/n` as a few ratios dominate;
    computed in log space, so any log-ratio gives a finite value.

    Args:
        log_ratio (`torch.Tensor`):
            Logs of the importance ratios pi/mu, any shape (every element is one weight).

    Returns:
        `float`: the fraction, `nan` for no weights.

    Example:
    ```python
    >>> import torch
    >>> from trl_topr.loss import effective_sample_size

    >>> effective_sample_size(torch.zeros(4))  # on-policy: every weight 1
    1.0
    >>> round(effective_sample_size(torch.tensor([0.0, 0.0, 0.0, 50.0])), 6)  # one weight dominates: 1 of 4
    0.25

    ```
    """
    values = log_ratio.detach().double().flatten()
    if values.numel() == 0:
        return math.nan
    return (2 * torch.logsumexp(values, 0) - torch.logsumexp(2 * values, 0)).exp().item() / values.numel()


def ratio_metrics_by(
    groups: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, prefix: str, **weight_options
) -> dict[str, float]:
    """
    The importance weights of sequences, per group (a sample's age in rounds in the loop, its staleness in policy
    versions in the asynchronous trainer): for each group value k, `<prefix>_<k>/...` with the group's rows, mean and
    smallest log-ratio log pi - log mu, mean raw ratio pi/mu (before truncation), fraction of negatives whose weight is
    tapered (below 0.99), fraction of rows whose ratio the window clamps ([`clamped_ratios`]), effective sample size
    of the raw ratios ([`effective_sample_size`]), mean weight of its positives and of its negatives ([`topr_weights`])
    and share of the total weight x |R - c|; and `effective_sample_size` and `clamped_fraction` of all the rows.

    Args:
        groups (`torch.Tensor` of shape `(N,)`):
            Each sequence's group, integers.
        log_ratio (`torch.Tensor` of shape `(N,)`):
            Each sequence's log pi - log mu.
        advantages (`torch.Tensor` of shape `(N,)`):
            Each sequence's `R - c`.
        prefix (`str`):
            The name of the groups in the metrics' names (`"age"`, `"staleness"`).
        **weight_options:
            The loss's windows ([`topr_weights`]: `loss_type`, the ratio bounds, `epsilon`).

    Returns:
        `dict[str, float]`: the metrics (`nan` for a mean over no sequence).
    """
    log_ratio, advantages = log_ratio.detach().double(), advantages.detach().double()
    weights = topr_weights(log_ratio, advantages, **weight_options)
    clamped = clamped_ratios(log_ratio, advantages, **weight_options).double()
    mass = weights * advantages.abs()

    def mean(values: torch.Tensor) -> float:
        return values.mean().item() if values.numel() else math.nan

    metrics = {"effective_sample_size": effective_sample_size(log_ratio), "clamped_fraction": mean(clamped)}
    for group in sorted(set(groups.tolist())):
        at = groups == group
        negatives, positives = at & (advantages < 0), at & (advantages >= 0)
        name = f"{prefix}_{group}"
        metrics |= {
            f"{name}/rows": int(at.sum()),
            f"{name}/log_ratio_mean": log_ratio[at].mean().item(),
            f"{name}/log_ratio_min": log_ratio[at].min().item(),
            f"{name}/ratio_mean": log_ratio[at].clamp(max=50).exp().mean().item(),
            f"{name}/negative_tapered_fraction": mean((weights[negatives] < TAPERED_BELOW).double()),
            f"{name}/clamped_fraction": clamped[at].mean().item(),
            f"{name}/effective_sample_size": effective_sample_size(log_ratio[at]),
            f"{name}/positive_weight_mean": mean(weights[positives]),
            f"{name}/negative_weight_mean": mean(weights[negatives]),
            f"{name}/weight_share": (mass[at].sum() / mass.sum()).item() if mass.sum() > 0 else math.nan,
        }
    return metrics


def topr_loss(
    per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    rewards: torch.Tensor,
    behavior_logps: torch.Tensor,
    *,
    loss_type: str = "topr",
    baseline: float = 0.0,
    ratio_level: str = "sequence",
    loss_normalization: str = "sequence_length",
    positive_ratio_bounds: tuple[float, float] | None = None,
    negative_ratio_bounds: tuple[float, float] | None = None,
    epsilon: float = 0.2,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""
    Tapered Off-Policy REINFORCE loss of a batch of completions.

    `loss = - mean_i [ sg(alpha_i) (R_i - c) log pi(y_i|x_i) / |y_i| ]` with `alpha_i = 1` for `R_i - c >= 0` and
    `alpha_i = clip(pi(y_i|x_i) / mu(y_i|x_i), 0, 1)` otherwise. Only the weight is detached: on-policy (pi = mu) the
    loss equals REINFORCE's in value and gradient.

    Args:
        per_token_logps (`torch.Tensor` of shape `(B, T)`):
            Log-probabilities `log pi(y_t | x, y_<t)` of the completion tokens under the trained policy, with gradient.
            Masked positions may hold any value (-inf, NaN included): they affect neither the loss nor its gradient.
        completion_mask (`torch.Tensor` of shape `(B, T)`):
            1 on completion tokens, 0 elsewhere.
        rewards (`torch.Tensor` of shape `(B,)`):
            Scalar reward of each completion.
        behavior_logps (`torch.Tensor` of shape `(B,)` or `(B, T)`):
            Log-probabilities under the behavior policy mu: one sum over the completion tokens per sequence, or one
            value per token (aligned with `per_token_logps`, any value on masked positions). `ratio_level="token"`
            needs per-token values.
        loss_type (`str`, *optional*, defaults to `"topr"`):
            Weighting of positives / negatives:
            - `"topr"`: 1 / clip(pi/mu, 0, 1), the paper's method.
            - `"reinforce"`: 1 / 1, naive REINFORCE.
            - `"is"`: pi/mu / pi/mu, untruncated importance sampling.
            - `"tis"`: clip(pi/mu, 0, 1) / clip(pi/mu, 0, 1), truncated importance sampling.
            - `"positives_only"`: 1 / 0, SFT on the positives, negatives dropped.
            - `"ppo_clip"`: PPO's clipped surrogate with trust region `[1 - epsilon, 1 + epsilon]`.
        baseline (`float`, *optional*, defaults to `0.0`):
            Baseline `c` subtracted from the rewards; the sign of `R - c` selects the window.
        ratio_level (`str`, *optional*, defaults to `"sequence"`):
            `"sequence"`: ratio of the whole completion, exp(sum_t log pi - log mu) (the paper). `"token"`: one ratio
            per token. `"sequence_mean"`: exp of the length-normalized log-ratio.
        loss_normalization (`str`, *optional*, defaults to `"sequence_length"`):
            `"sequence_length"`: each sequence's weighted log-likelihood divided by its length, then averaged over the
            batch (the paper). `"token_mean"`: summed over the batch's tokens, divided by their count. `"sum"`: summed
            over each sequence's tokens, averaged over the batch.
        positive_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window `(a+, b+)` for `R - c >= 0`; defaults to the preset of `loss_type`.
        negative_ratio_bounds (`tuple[float, float]`, *optional*):
            Custom window `(a-, b-)` for `R - c < 0`; defaults to the preset of `loss_type`.
        epsilon (`float`, *optional*, defaults to `0.2`):
            Trust region of `loss_type="ppo_clip"`.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            What the mean is over when this batch is one part of a larger one (an optimizer step's micro-batches,
            several processes): its completion tokens for `loss_normalization="token_mean"`, its completions for the
            others. The loss is then this part's share of the large batch's mean, and the parts' losses add up to
            it, so that a completion's weight does not depend on how the batch is split. Defaults to this batch's
            count.

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar loss and a dict of detached scalar metrics
        (`nan` where a metric is undefined for the batch, e.g. the negative weight of a batch without negatives).
        The `count/...` entries say how many sequences, tokens or how much |R - c| each mean is over
        (`METRIC_SUPPORT`), so that means of several batches combine exactly.

    Example:
    ```python
    >>> import torch
    >>> from trl_topr import topr_loss

    >>> logps = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], requires_grad=True)
    >>> mask = torch.ones(2, 2)
    >>> loss, metrics = topr_loss(logps, mask, torch.tensor([1.0, -1.0]), torch.tensor([-2.0, -3.0]))
    >>> # positive: -(1)(1)(-2)/2; negative, pi/mu = e^(-4 + 3): -(e^-1)(-1)(-4)/2; mean of the two
    >>> round(loss.item(), 4)
    0.1321
    >>> round(metrics["negative_weight_mean"].item(), 4)  # e^-1
    0.3679

    ```
    """
    check_loss_options(
        loss_type, ratio_level, loss_normalization, positive_ratio_bounds, negative_ratio_bounds, epsilon
    )
    if ratio_level == "token" and behavior_logps.dim() != 2:
        raise ValueError("`ratio_level='token'` needs per-token `behavior_logps` of shape (B, T).")

    # Masked positions are selected away, not multiplied by 0: whatever they hold (-inf, NaN) reaches neither the
    # loss nor its gradient.
    valid = completion_mask.bool()
    logps = torch.where(valid, per_token_logps.float(), 0.0)
    mask = valid.to(logps.dtype)
    lengths = mask.sum(-1)
    advantages = rewards.to(logps.dtype) - baseline  # (B,)
    sequence_logps = logps.sum(-1)  # (B,)

    # The log-ratio is computed without gradient: only the weight uses it.
    with torch.no_grad():
        if behavior_logps.dim() == 2:
            token_log_ratio = torch.where(valid, logps - behavior_logps.to(logps.dtype), 0.0)
            sequence_log_ratio = token_log_ratio.sum(-1)
        else:
            sequence_log_ratio = sequence_logps - behavior_logps.to(logps.dtype)
        if ratio_level == "token":
            log_ratio = token_log_ratio
        elif ratio_level == "sequence_mean":
            log_ratio = sequence_log_ratio / lengths.clamp(min=1)
        else:
            log_ratio = sequence_log_ratio
        windows = {
            "loss_type": loss_type,
            "positive_ratio_bounds": positive_ratio_bounds,
            "negative_ratio_bounds": negative_ratio_bounds,
            "epsilon": epsilon,
        }
        item_advantages = advantages if ratio_level != "token" else advantages[:, None]
        weights = topr_weights(log_ratio, item_advantages, **windows)
        clamped = clamped_ratios(log_ratio, item_advantages, **windows)

    # Per-token objective sg(alpha) (R - c) log pi, zero outside the completion.
    token_weights = weights if ratio_level == "token" else weights[:, None]
    per_token_objective = token_weights * advantages[:, None] * logps  # logps is 0 outside the completion
    if loss_normalization == "token_mean":
        summed, count = per_token_objective.sum(), mask.sum()
    else:  # each completion's objective, over its length (the paper's) or summed, then a mean over completions
        per_sequence = per_token_objective.sum(-1)
        if loss_normalization == "sequence_length":
            per_sequence = per_sequence / lengths.clamp(min=1)
        summed, count = per_sequence.sum(), float(per_sequence.numel())
    count = torch.as_tensor(count if num_items_in_batch is None else num_items_in_batch, device=logps.device)
    loss = -summed / count.to(logps.dtype).clamp(min=1)

    metrics = _metrics(rewards, advantages, baseline, weights, log_ratio, clamped, mask, lengths, ratio_level)
    return loss, metrics


# What each averaged metric is a mean over: the `count/...` metric holding that number in the same batch. Weighting
# each batch's mean by it combines batches (gradient accumulation, processes, logging steps) into the exact mean.
METRIC_SUPPORT = {
    "reward": "count/sequences",
    "positive_fraction": "count/sequences",
    "baseline": "count/sequences",
    "completion_length": "count/sequences",
    "effective_positive_fraction": "count/abs_advantage",
    "positive_weight_mean": "count/positive_items",
    "negative_weight_mean": "count/negative_items",
    "negative_tapered_fraction": "count/negative_items",
    "negative_weight_share": "count/weighted_abs_advantage",
    "log_ratio_mean": "count/items",
    "clamped_fraction": "count/items",
    # each batch's own effective sample size (the weights of one update), averaged over the batches by their items
    "effective_sample_size": "count/items",
    "entropy": "count/tokens",  # logged by the trainers
}


def combine_metrics(metrics: dict[str, list[float]]) -> dict[str, float]:
    """
    Combine the metrics of several batches (micro-batches, processes, logging steps) into their exact values over all
    of them: each mean weighted by what it averages over (its `count/...` entry, see `METRIC_SUPPORT`; sequences by
    default), `_min` / `_max` entries as the minimum / maximum. Batches where a metric is undefined (`nan`, e.g. the
    negative weight of a batch without negatives) are left out of it; a metric undefined everywhere is left out.

    Args:
        metrics (`dict[str, list[float]]`):
            One list per metric name, with one value per batch, as returned by [`topr_loss`] (`count/...` entries
            included, in the same order).

    Returns:
        `dict[str, float]`: the combined metrics, without the `count/...` entries.

    Example:
    ```python
    >>> from trl_topr.loss import combine_metrics

    >>> # a batch with 1 negative of weight 0.2, then one with 3 negatives of mean weight 0.6
    >>> combined = combine_metrics({"negative_weight_mean": [0.2, 0.6], "count/negative_items": [1.0, 3.0]})
    >>> round(combined["negative_weight_mean"], 6)  # (0.2 * 1 + 0.6 * 3) / 4, not the mean of 0.2 and 0.6
    0.5

    ```
    """
    combined = {}
    for name, values in metrics.items():
        if name.startswith("count/"):
            continue
        if name.endswith(("_min", "_max")):
            values = [v for v in values if not math.isnan(v)]
            if values:
                combined[name] = (min if name.endswith("_min") else max)(values)
            continue
        support = metrics[METRIC_SUPPORT.get(name, "count/sequences")]
        pairs = [(v, w) for v, w in zip(values, support, strict=True) if w > 0 and not math.isnan(v)]
        if pairs:
            combined[name] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    return combined


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    count = mask.sum()
    return (values * mask).sum() / count if count > 0 else values.new_tensor(math.nan)


@torch.no_grad()
def _metrics(
    rewards, advantages, baseline, weights, log_ratio, clamped, mask, lengths, ratio_level
) -> dict[str, torch.Tensor]:
    positive = (advantages >= 0).to(mask.dtype)
    negative = 1.0 - positive
    absolute = advantages.abs().sum()
    if ratio_level == "token":  # weights and log-ratios are per token: average them over the tokens of each sign
        valid, positive_items, negative_items = mask, mask * positive[:, None], mask * negative[:, None]
    else:
        valid, positive_items, negative_items = torch.ones_like(positive), positive, negative
    valid_log_ratio = log_ratio[valid > 0]
    nan = log_ratio.new_tensor(math.nan)
    # How hard each sequence is pushed: its weight (per token: averaged over the completion) times |R - c|
    sequence_weights = weights if ratio_level != "token" else (weights * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    push = sequence_weights * advantages.abs()
    return {
        "reward": rewards.float().mean(),
        # a sequence at the baseline (R = c) is pushed neither way: not counted as a positive (all-zero rewards: 0)
        "positive_fraction": (advantages > 0).to(mask.dtype).mean(),
        "effective_positive_fraction": (advantages.clamp(min=0).sum() / absolute) if absolute > 0 else nan,
        "baseline": log_ratio.new_tensor(float(baseline)),
        "positive_weight_mean": _masked_mean(weights, positive_items),
        "negative_weight_mean": _masked_mean(weights, negative_items),
        "negative_tapered_fraction": _masked_mean((weights < TAPERED_BELOW).to(mask.dtype), negative_items),
        "negative_weight_share": (push * negative).sum() / push.sum() if push.sum() > 0 else nan,
        "log_ratio_mean": valid_log_ratio.mean() if valid_log_ratio.numel() else nan,
        "log_ratio_min": valid_log_ratio.min() if valid_log_ratio.numel() else nan,
        "log_ratio_max": valid_log_ratio.max() if valid_log_ratio.numel() else nan,
        "clamped_fraction": _masked_mean(clamped.to(mask.dtype), valid),
        "effective_sample_size": log_ratio.new_tensor(effective_sample_size(valid_log_ratio)),
        "completion_length": lengths.mean(),
        # what the means above average over (items are sequences, or tokens for `ratio_level="token"`)
        "count/sequences": lengths.new_tensor(float(lengths.numel())),
        "count/abs_advantage": absolute,
        "count/weighted_abs_advantage": push.sum(),
        "count/positive_items": positive_items.sum(),
        "count/negative_items": negative_items.sum(),
        "count/items": valid.sum(),
        "count/tokens": mask.sum(),
    }
