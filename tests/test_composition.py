"""Effective positive fraction and the baseline derived from a target (topr.md, "The baseline")."""

import math

import pytest

from trl_topr import baseline_for_positive_fraction, effective_positive_fraction


def closed_form_p_eff(p, c):
    return p * (1 - c) / (1 + c * (1 - 2 * p))


def closed_form_baseline(p, target):
    return (p - target) / (p + target - 2 * p * target)


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("c", [-0.9, -0.5, 0.0, 0.3, 0.8])
def test_effective_fraction_matches_the_paper_formula_for_plus_minus_one(p, c):
    n = 1000
    rewards = [1.0] * round(p * n) + [-1.0] * (n - round(p * n))
    assert effective_positive_fraction(rewards, c) == pytest.approx(closed_form_p_eff(p, c))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
@pytest.mark.parametrize("target", [0.1, 0.2, 0.5, 0.9])
def test_derived_baseline_matches_the_closed_form_and_reaches_the_target(p, target):
    n = 1000
    rewards = [1.0] * round(p * n) + [-1.0] * (n - round(p * n))
    c = baseline_for_positive_fraction(rewards, target)
    assert c == pytest.approx(closed_form_baseline(p, target), abs=1e-9)
    assert effective_positive_fraction(rewards, c) == pytest.approx(target, abs=1e-9)


def test_general_rewards_reach_the_target():
    rewards = [0.0, 0.2, 0.5, 1.0, 3.0, -2.0]
    c = baseline_for_positive_fraction(rewards, 0.3)
    assert effective_positive_fraction(rewards, c) == pytest.approx(0.3, abs=1e-9)


def test_c_minus_one_drops_negatives_and_equal_rewards_are_nan():
    assert effective_positive_fraction([1, -1, -1], -1.0) == 1.0
    assert math.isnan(effective_positive_fraction([0.5, 0.5], 0.5))


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1, 1.5])
def test_target_outside_open_interval_raises(target):
    with pytest.raises(ValueError, match="target_positive_fraction"):
        baseline_for_positive_fraction([1, -1], target)


def test_single_reward_value_cannot_be_rebalanced():
    with pytest.raises(ValueError, match="two distinct rewards"):
        baseline_for_positive_fraction([-1.0, -1.0, -1.0], 0.2)
