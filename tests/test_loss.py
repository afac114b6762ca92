"""`topr_loss` against values and gradients computed by hand, for every loss type, ratio level and normalization."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_topr import topr_loss, topr_weights
from trl_topr.loss import LOSS_NORMALIZATIONS, LOSS_TYPES, RATIO_LEVELS, clamped_ratios, effective_sample_size


# Three sequences of lengths 3, 2, 1 (right-padded): a positive, a negative, a negative.
LOGPS = [[-0.5, -1.0, -1.5], [-2.0, -1.0, 0.0], [-0.3, 0.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
REWARDS = [1.0, -1.0, -2.0]
# Per-token behavior log-probs; their sums are -2.5, -4.0, -0.1.
BEHAVIOR = [[-0.5, -0.5, -1.5], [-2.5, -1.5, 0.0], [-0.1, 0.0, 0.0]]


def clip(x, low, high):
    return min(max(x, low), high)


def reference_weight(log_ratio, advantage, loss_type, epsilon=0.2):
    """The paper's table, written out per case with plain floats."""
    ratio = math.exp(log_ratio)
    positive = advantage >= 0
    if loss_type == "topr":
        return 1.0 if positive else clip(ratio, 0.0, 1.0)
    if loss_type == "reinforce":
        return 1.0
    if loss_type == "is":
        return ratio
    if loss_type == "tis":
        return clip(ratio, 0.0, 1.0)
    if loss_type == "positives_only":
        return 1.0 if positive else 0.0
    if loss_type == "ppo_clip":  # gradient weight of min(r A, clip(r, 1 - eps, 1 + eps) A)
        inside = ratio <= 1 + epsilon if positive else ratio >= 1 - epsilon
        return ratio if inside else 0.0
    raise AssertionError(loss_type)


def reference_loss(loss_type, ratio_level, normalization, baseline=0.0, per_token_behavior=True):
    """Loss and d loss / d logp, token by token, with plain Python floats."""
    total, grads, tokens = 0.0, [[0.0] * 3 for _ in LOGPS], sum(map(sum, MASK))
    for i, (logps, mask, reward, behavior) in enumerate(zip(LOGPS, MASK, REWARDS, BEHAVIOR)):
        n = sum(mask)
        advantage = reward - baseline
        sequence_log_ratio = sum((lp - b) for lp, b, m in zip(logps, behavior, mask) if m)
        for t in range(3):
            if not mask[t]:
                continue
            if ratio_level == "token":
                log_ratio = logps[t] - behavior[t]
            elif ratio_level == "sequence_mean":
                log_ratio = sequence_log_ratio / n
            else:
                log_ratio = sequence_log_ratio
            weight = reference_weight(log_ratio, advantage, loss_type)
            scale = {"sequence_length": 1 / (n * len(LOGPS)), "token_mean": 1 / tokens, "sum": 1 / len(LOGPS)}
            total += -weight * advantage * logps[t] * scale[normalization]
            grads[i][t] = -weight * advantage * scale[normalization]
    return total, grads


def run(loss_type, ratio_level, normalization, baseline=0.0, per_token_behavior=True, **kwargs):
    logps = torch.tensor(LOGPS, dtype=torch.float64, requires_grad=True)
    behavior = torch.tensor(BEHAVIOR, dtype=torch.float64)
    if not per_token_behavior:
        behavior = (behavior * torch.tensor(MASK)).sum(-1)
    loss, metrics = topr_loss(
        logps,
        torch.tensor(MASK),
        torch.tensor(REWARDS),
        behavior,
        loss_type=loss_type,
        baseline=baseline,
        ratio_level=ratio_level,
        loss_normalization=normalization,
        **kwargs,
    )
    loss.backward()
    return loss, logps.grad, metrics


@pytest.mark.parametrize("normalization", LOSS_NORMALIZATIONS)
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_value_and_gradient_match_hand_computation(loss_type, ratio_level, normalization):
    loss, grad, _ = run(loss_type, ratio_level, normalization)
    expected_loss, expected_grad = reference_loss(loss_type, ratio_level, normalization)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_topr_literal_values():
    # Sequence log-ratios: -0.5 (positive), +1.0 and -0.2 (negatives; e^1 is capped at 1).
    # loss = -[ 1*1*(-3)/3 + 1*(-1)*(-3)/2 + e^-0.2*(-2)*(-0.3)/1 ] / 3
    loss, grad, metrics = run("topr", "sequence", "sequence_length")
    expected = -(-1.0 + 1.5 + math.exp(-0.2) * 0.6) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert grad[0, 0].item() == pytest.approx(-1 / 9)  # positive: weight 1 although pi/mu = e^-0.5
    assert grad[1, 0].item() == pytest.approx(1 / 6)  # negative pushed down at full weight
    assert grad[2, 0].item() == pytest.approx(2 * math.exp(-0.2) / 3)  # negative pushed down, tapered
    assert grad[2, 1].item() == 0.0  # padding gets no gradient
    assert metrics["negative_weight_mean"].item() == pytest.approx((1 + math.exp(-0.2)) / 2)
    assert metrics["negative_tapered_fraction"].item() == 0.5
    assert metrics["positive_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["effective_positive_fraction"].item() == pytest.approx(1 / 4)  # |A|: 1 vs 1 + 2
    # weight x |A|: the positive 1 x 1, the negatives 1 x 1 and e^-0.2 x 2
    share = (1 + 2 * math.exp(-0.2)) / (2 + 2 * math.exp(-0.2))
    assert metrics["negative_weight_share"].item() == pytest.approx(share)
    assert metrics["log_ratio_min"].item() == pytest.approx(-0.5)
    assert metrics["log_ratio_max"].item() == pytest.approx(1.0)
    assert metrics["completion_length"].item() == pytest.approx(2.0)


def test_tapered_negatives_are_counted_only_when_materially_below_one():
    # Three negatives, one token each: on-policy float noise (log-ratio -4e-6, once counted as tapered), a ratio 0.5%
    # under 1, and e^-0.1 (0.905): only the last is tapered.
    logps = torch.zeros(3, 1, dtype=torch.float64)
    behavior = torch.tensor([[4e-6], [-math.log(0.995)], [0.1]], dtype=torch.float64)
    _, metrics = topr_loss(
        logps, torch.ones(3, 1, dtype=torch.bool), torch.full((3,), -1.0, dtype=torch.float64), behavior
    )
    assert metrics["negative_tapered_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["negative_weight_mean"].item() < 1.0  # every one of them is below 1


@pytest.mark.parametrize(
    "loss_type, clamped",
    # log-ratios 0 (on-policy), 0.005 (float noise above 1), 1 and -1, for a positive and a negative each
    [
        ("topr", [0, 0, 0, 0, 0, 0, 1, 0]),  # negatives above 1 only: positives keep weight 1, never a ratio
        ("tis", [0, 0, 0, 0, 1, 0, 1, 0]),  # both signs above 1
        ("reinforce", [0] * 8),  # weight 1 whatever the ratio
        ("positives_only", [0] * 8),  # negatives dropped whatever the ratio
        ("ppo_clip", [0, 0, 0, 0, 1, 0, 0, 1]),  # past 1.2 for a positive, under 0.8 for a negative
    ],
)
def test_clamped_fraction_counts_ratios_the_window_clamps(loss_type, clamped):
    log_ratio = torch.tensor([0.0, 0.0, 0.005, 0.005, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    assert clamped_ratios(log_ratio, advantages, loss_type=loss_type).tolist() == [bool(c) for c in clamped]
    # topr_loss's metric is their fraction (per-token logps 0 make log pi = 0, so mu sets the log-ratio)
    _, metrics = topr_loss(
        torch.zeros(8, 1, dtype=torch.float64),
        torch.ones(8, 1, dtype=torch.bool),
        advantages,
        -log_ratio,
        loss_type=loss_type,
    )
    assert metrics["clamped_fraction"].item() == pytest.approx(sum(clamped) / 8)


def test_effective_sample_size_is_one_on_policy_and_finite_for_any_log_ratio():
    assert effective_sample_size(torch.zeros(8)) == pytest.approx(1.0)
    w = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    assert effective_sample_size(w.log()) == pytest.approx((w.sum() ** 2 / (3 * (w * w).sum())).item())
    for huge in (1e4, -1e4, 1e30):  # one ratio far above or below the rest: no overflow, no NaN
        value = effective_sample_size(torch.tensor([0.0, 0.0, huge], dtype=torch.float64))
        assert math.isfinite(value) and 1 / 3 - 1e-9 <= value <= 1.0
    assert math.isnan(effective_sample_size(torch.zeros(0)))
    _, metrics = topr_loss(
        torch.zeros(3, 1), torch.ones(3, 1, dtype=torch.bool), torch.tensor([1.0, -1.0, 1.0]), -w.log().float()
    )
    assert metrics["effective_sample_size"].item() == pytest.approx(effective_sample_size(w.log()), rel=1e-5)


def test_sequence_sums_and_per_token_behavior_agree():
    for loss_type in LOSS_TYPES:
        summed = run(loss_type, "sequence", "sequence_length", per_token_behavior=False)
        per_token = run(loss_type, "sequence", "sequence_length", per_token_behavior=True)
        torch.testing.assert_close(summed[0], per_token[0])
        torch.testing.assert_close(summed[1], per_token[1])


def test_token_ratio_needs_per_token_behavior():
    with pytest.raises(ValueError, match="per-token"):
        run("topr", "token", "sequence_length", per_token_behavior=False)


def test_baseline_moves_the_sign_and_scales_the_advantage():
    # c = -1.5: the -1 negative becomes a positive with weight 1 and advantage 0.5.
    loss, grad, metrics = run("topr", "sequence", "sequence_length", baseline=-1.5)
    expected_loss, expected_grad = reference_loss("topr", "sequence", "sequence_length", baseline=-1.5)
    assert loss.item() == pytest.approx(expected_loss)
    assert grad[1, 0].item() == pytest.approx(-0.5 / 6)
    assert metrics["baseline"].item() == -1.5
    assert metrics["positive_fraction"].item() == pytest.approx(2 / 3)


def on_policy_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(4, 5, generator=generator, dtype=torch.float64) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    rewards = torch.tensor([1.0, -1.0, -0.5, 2.0])
    return logps, mask, rewards


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_on_policy_topr_equals_reinforce(ratio_level):
    logps, mask, rewards = on_policy_batch()
    results = []
    for loss_type in ("topr", "reinforce"):
        leaf = logps.clone().requires_grad_(True)
        loss, _ = topr_loss(
            leaf, mask, rewards, logps.clone(), loss_type=loss_type, ratio_level=ratio_level
        )  # behavior = current policy
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_weight_is_detached_gradient_is_weighted_score():
    # d loss / d logp = -alpha (R - c) / |y| / B exactly: no gradient flows through alpha.
    logps, mask, rewards = on_policy_batch()
    behavior = (logps * mask).sum(-1) + torch.tensor([0.0, 0.7, -0.3, 5.0])  # pi/mu = 1, e^-0.7, e^0.3, e^-5
    leaf = logps.clone().requires_grad_(True)
    loss, _ = topr_loss(leaf, mask, rewards, behavior)
    loss.backward()
    weights = torch.tensor([1.0, math.exp(-0.7), 1.0, 1.0], dtype=torch.float64)  # e^0.3 is capped at 1
    expected = -(weights * rewards.double() / mask.sum(-1))[:, None] * mask / 4
    torch.testing.assert_close(leaf.grad, expected)


def test_positives_keep_weight_one_however_far_pi_is_from_mu():
    log_ratio = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4])
    weights = topr_weights(log_ratio, torch.ones(5))
    assert torch.equal(weights, torch.ones(5))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_log_ratios_give_finite_loss_and_gradients(loss_type, dtype):
    logps = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-3.0, -1.0], [-3.0, -1.0]], dtype=dtype)
    behavior = torch.tensor([1e4, -1e4, 1e4, -1e4]) * -1 + logps.float().sum(-1)  # log-ratios -+1e4
    rewards = torch.tensor([1e6, 1e6, -1e6, -1e6])
    for ratio_level in RATIO_LEVELS:
        leaf = logps.clone().requires_grad_(True)
        per_token = behavior[:, None] / 2 if ratio_level == "token" else behavior
        loss, metrics = topr_loss(
            leaf, torch.ones(4, 2), rewards, per_token, loss_type=loss_type, ratio_level=ratio_level
        )
        loss.backward()
        assert torch.isfinite(loss), (loss_type, ratio_level)
        assert torch.isfinite(leaf.grad).all(), (loss_type, ratio_level)
        assert all(torch.isfinite(v) or torch.isnan(v) for v in metrics.values())


def test_all_negative_batch_is_finite_and_pushes_down():
    logps, mask, _ = on_policy_batch()
    leaf = logps.clone().requires_grad_(True)
    loss, metrics = topr_loss(leaf, mask, -torch.ones(4), (logps * mask).sum(-1))
    loss.backward()
    assert torch.isfinite(loss)
    assert (leaf.grad[mask.bool()] > 0).all()  # gradient descent lowers every negative token's log-prob
    assert math.isnan(metrics["positive_weight_mean"].item())  # undefined, reported as nan, never in the loss


def test_empty_completion_row_contributes_nothing():
    logps = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], requires_grad=True)
    loss, _ = topr_loss(logps, torch.tensor([[1, 1], [0, 0]]), torch.tensor([1.0, -1.0]), torch.tensor([-2.0, 0.0]))
    loss.backward()
    assert torch.isfinite(loss)
    assert logps.grad[1].abs().sum() == 0


def test_custom_windows_override_the_preset():
    log_ratio = torch.tensor([math.log(0.1), math.log(0.5), math.log(3.0)])
    weights = topr_weights(log_ratio, -torch.ones(3), negative_ratio_bounds=(0.2, 2.0))
    torch.testing.assert_close(weights, torch.tensor([0.2, 0.5, 2.0]))
    weights = topr_weights(log_ratio, torch.ones(3), loss_type="reinforce", positive_ratio_bounds=(0.0, 1.0))
    torch.testing.assert_close(weights, torch.tensor([0.1, 0.5, 1.0]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "dpo"}, "loss_type"),
        ({"negative_ratio_bounds": (1.0, 0.5)}, "negative_ratio_bounds"),
        ({"positive_ratio_bounds": (-1.0, 1.0)}, "positive_ratio_bounds"),
        ({"loss_type": "ppo_clip", "negative_ratio_bounds": (0.0, 1.0)}, "ppo_clip"),
    ],
)
def test_invalid_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        topr_weights(torch.zeros(2), torch.ones(2), **kwargs)


def test_unknown_level_and_normalization_raise():
    logps, mask, rewards = on_policy_batch()
    with pytest.raises(ValueError, match="ratio_level"):
        topr_loss(logps, mask, rewards, logps.sum(-1), ratio_level="tokens")
    with pytest.raises(ValueError, match="loss_normalization"):
        topr_loss(logps, mask, rewards, logps.sum(-1), loss_normalization="mean")


@settings(max_examples=200, deadline=None)
@given(
    log_ratio=st.floats(-1e4, 1e4),
    advantage=st.floats(-1e6, 1e6),
    loss_type=st.sampled_from(LOSS_TYPES),
)
def test_weights_stay_finite_and_within_their_window(log_ratio, advantage, loss_type):
    advantage = torch.tensor([advantage])  # the sign test sees the float32 value (-1e-250 is -0.0 there)
    weight = topr_weights(torch.tensor([log_ratio]), advantage, loss_type=loss_type).item()
    advantage = advantage.item()
    assert math.isfinite(weight) and weight >= 0
    if loss_type == "topr":
        assert (weight == 1.0) if advantage >= 0 else (0.0 <= weight <= 1.0)
    if loss_type == "tis":
        assert weight <= 1.0
    if loss_type == "positives_only" and advantage < 0:
        assert weight == 0.0


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.sampled_from([1, 2, 7, 64, 2048]),
    log_ratio_scale=st.sampled_from([0.0, 1.0, 1e2, 1e4]),
    reward_scale=st.sampled_from([1.0, 1e6]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    loss_type=st.sampled_from(LOSS_TYPES),
    ratio_level=st.sampled_from(RATIO_LEVELS),
    normalization=st.sampled_from(LOSS_NORMALIZATIONS),
    seed=st.integers(0, 2**16),
)
def test_any_batch_gives_finite_loss_gradients_and_bounded_weights(
    batch, length, log_ratio_scale, reward_scale, dtype, loss_type, ratio_level, normalization, seed
):
    generator = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(batch, length, generator=generator) * 20).to(dtype).requires_grad_(True)
    mask = (torch.rand(batch, length, generator=generator) > 0.3).long()
    mask[:, 0] = 1  # at least one completion token per row
    rewards = (torch.rand(batch, generator=generator) * 2 - 1) * reward_scale
    behavior = logps.detach().float() + torch.randn(batch, length, generator=generator) * log_ratio_scale / length
    loss, metrics = topr_loss(
        logps, mask, rewards, behavior, loss_type=loss_type, ratio_level=ratio_level, loss_normalization=normalization
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logps.grad).all()
    upper = {"topr": 1.0, "reinforce": 1.0, "tis": 1.0, "positives_only": 1.0}.get(loss_type, math.inf)
    for name in ("negative_weight_mean", "positive_weight_mean"):
        value = metrics[name].item()
        assert math.isnan(value) or 0.0 <= value <= upper * (1 + 1e-6), (name, value)
    if loss_type == "topr" and not math.isnan(metrics["positive_weight_mean"].item()):
        assert metrics["positive_weight_mean"].item() == 1.0


GARBAGE = [-math.inf, math.inf, math.nan, 1e30, -1e30, 88.0]


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 6),
    garbage=st.sampled_from(GARBAGE),
    behavior_garbage=st.sampled_from(GARBAGE),
    loss_type=st.sampled_from(LOSS_TYPES),
    ratio_level=st.sampled_from(RATIO_LEVELS),
    normalization=st.sampled_from(LOSS_NORMALIZATIONS),
    per_token_behavior=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_masked_positions_affect_neither_loss_nor_gradient(
    batch, length, garbage, behavior_garbage, loss_type, ratio_level, normalization, per_token_behavior, seed
):
    # The same batch twice: with zeros and with garbage (-inf, NaN, huge) on the masked positions of the policy's and
    # the behavior's per-token log-probs. Loss and gradient must be identical, and finite.
    if ratio_level == "token":
        per_token_behavior = True
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=generator) > 0.4  # rows may have no completion token at all
    clean = torch.where(mask, -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3, 0.0)
    behavior = torch.where(mask, clean + torch.randn(batch, length, generator=generator, dtype=torch.float64), 0.0)
    rewards = torch.randn(batch, generator=generator)
    results = []
    for fill, behavior_fill in ((0.0, 0.0), (garbage, behavior_garbage)):
        logps = torch.where(mask, clean, fill).requires_grad_(True)
        mu = torch.where(mask, behavior, behavior_fill) if per_token_behavior else behavior.sum(-1)
        loss, metrics = topr_loss(
            logps,
            mask.long(),
            rewards,
            mu,
            loss_type=loss_type,
            ratio_level=ratio_level,
            loss_normalization=normalization,
        )
        loss.backward()
        results.append((loss.detach(), logps.grad, metrics))
    (clean_loss, clean_grad, clean_metrics), (loss, grad, metrics) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, clean_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
    for name, value in metrics.items():
        torch.testing.assert_close(value, clean_metrics[name], rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_token_mean_of_parts_adds_up_to_the_whole_batch(ratio_level):
    # Split a batch in two micro-batches of different token counts: with `num_items_in_batch` = the whole batch's
    # count, the parts' losses and gradients add up to the whole batch's token mean.
    logps, mask, rewards = on_policy_batch()
    behavior = logps - 0.3
    whole = logps.clone().requires_grad_(True)
    loss, _ = topr_loss(whole, mask, rewards, behavior, ratio_level=ratio_level, loss_normalization="token_mean")
    loss.backward()
    part = logps.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4)):  # 5 tokens, then 8
        piece, _ = topr_loss(
            part[rows],
            mask[rows],
            rewards[rows],
            behavior[rows],
            ratio_level=ratio_level,
            loss_normalization="token_mean",
            num_items_in_batch=mask.sum(),
        )
        piece.backward()
        total = total + piece.detach()
    torch.testing.assert_close(total, loss.detach())
    torch.testing.assert_close(part.grad, whole.grad)


def test_rewards_at_the_baseline_are_not_counted_as_positives():
    # 0/1 rewards that are all 0, baseline 0: nothing is pushed, and no sequence is a positive (it logged 1 before)
    _, metrics = topr_loss(torch.zeros(3, 2), torch.ones(3, 2), torch.zeros(3), torch.zeros(3))
    assert metrics["positive_fraction"].item() == 0.0 and math.isnan(metrics["effective_positive_fraction"].item())
    _, metrics = topr_loss(torch.zeros(4, 2), torch.ones(4, 2), torch.tensor([1.0, 0.0, 0.0, -1.0]), torch.zeros(4))
    assert metrics["positive_fraction"].item() == 0.25
