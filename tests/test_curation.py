"""Per-prompt curation: composition report, "Anna Karenina" curation, rebalancing (topr.md, "Experimental setup")."""

import math
from collections import Counter

import pytest
from datasets import Dataset

from trl_topr.curation import anna_karenina, baseline_for_target, composition_report, rebalance


# Prompt of each row, and its reward. Per prompt: a = pos [2, 3], neg [0, 6]; b = pos [1, 5], neg [10];
# c = neg [4, 7] (no positive); d = pos [8, 9] (only positives).
PROMPTS = ["a", "b", "a", "a", "c", "b", "a", "c", "d", "d", "b"]
REWARDS = [-1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0]
ANNA_KARENINA_KEPT = [0, 1, 2, 4, 6, 7, 8, 10]


def make_dataset(prompts=PROMPTS, rewards=REWARDS, conversational=False) -> Dataset:
    n = len(prompts)
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {p}?"}]
                if conversational
                else f"Question {p}?"
                for p in prompts
            ],
            "completion": [f" answer {i}" for i in range(n)],
            "reward": rewards,
            "behavior_logps": [[-0.5 * i, -1.0] for i in range(n)],
            "row_id": list(range(n)),
        }
    )


@pytest.mark.parametrize("conversational", [False, True])
def test_anna_karenina_keeps_the_first_positive_and_all_negatives(conversational):
    dataset = make_dataset(conversational=conversational)
    curated = anna_karenina(dataset)
    assert curated["row_id"][:] == ANNA_KARENINA_KEPT
    # Every other column passes through untouched.
    assert curated.column_names == dataset.column_names
    for row in curated:
        assert row == dataset[row["row_id"]]


def test_anna_karenina_groups_conversations_by_their_whole_content():
    dataset = make_dataset(prompts=["a", "a"], rewards=[1.0, 1.0], conversational=True)
    assert len(anna_karenina(dataset)) == 1
    other_system = [{"role": "system", "content": "Be long."}, {"role": "user", "content": "Question a?"}]
    dataset = Dataset.from_dict({"prompt": [dataset[0]["prompt"], other_system], "reward": [1.0, 1.0]})
    assert len(anna_karenina(dataset)) == 2


def test_anna_karenina_uses_the_baseline_for_zero_one_rewards():
    dataset = make_dataset(rewards=[(r + 1) / 2 for r in REWARDS])
    assert len(anna_karenina(dataset)) == 4  # with baseline 0 every 0/1 reward is positive: one row per prompt
    assert anna_karenina(dataset, baseline=0.5)["row_id"][:] == ANNA_KARENINA_KEPT


@pytest.mark.parametrize("conversational", [False, True])
def test_composition_report_matches_hand_computation(conversational):
    report = composition_report(make_dataset(conversational=conversational))
    assert report == {
        "num_rows": 11,
        "num_prompts": 4,
        "baseline": 0.0,
        "positive_fraction": pytest.approx(6 / 11),
        "effective_positive_fraction": pytest.approx(6 / 11),
        "prompts_with_positive_fraction": 3 / 4,
        "prompts_only_positive_fraction": 1 / 4,
        "prompts_only_negative_fraction": 1 / 4,
        "prompts_mixed_fraction": 2 / 4,
    }
    curated = composition_report(anna_karenina(make_dataset(conversational=conversational)))
    assert (curated["num_rows"], curated["positive_fraction"]) == (8, 3 / 8)
    assert curated["prompts_only_positive_fraction"] == 1 / 4


@pytest.mark.parametrize("c", [-0.9, -0.5, 0.0, 0.3, 0.8])
def test_composition_report_matches_the_paper_closed_form(c):
    p = 6 / 11
    report = composition_report(make_dataset(), baseline=c)
    assert report["positive_fraction"] == pytest.approx(p)
    assert report["effective_positive_fraction"] == pytest.approx(p * (1 - c) / (1 + c * (1 - 2 * p)))


@pytest.mark.parametrize("target", [0.1, 0.2, 0.5, 0.9])
def test_baseline_for_target_matches_the_closed_form(target):
    p, dataset = 6 / 11, make_dataset()
    c = baseline_for_target(dataset, target)
    assert c == pytest.approx((p - target) / (p + target - 2 * p * target), abs=1e-9)
    assert composition_report(dataset, baseline=c)["effective_positive_fraction"] == pytest.approx(target, abs=1e-9)


def per_prompt_counts(dataset: Dataset) -> Counter:
    return Counter((str(p), r >= 0) for p, r in zip(dataset["prompt"][:], dataset["reward"][:]))


@pytest.mark.parametrize("conversational", [False, True])
def test_rebalance_caps_each_prompt(conversational):
    dataset = make_dataset(conversational=conversational)
    assert rebalance(dataset)["row_id"][:] == list(range(11))
    capped = rebalance(dataset, max_positives_per_prompt=1, max_negatives_per_prompt=1)
    ids = capped["row_id"][:]
    assert ids == sorted(ids) and len(ids) == 6  # a: 1 + 1, b: 1 + 1, c: 0 + 1, d: 1 + 0
    assert {0, 6} & set(ids) and {2, 3} & set(ids) and {1, 5} & set(ids) and 10 in ids and {8, 9} & set(ids)
    assert all(count == 1 for count in per_prompt_counts(capped).values())
    for row in capped:
        assert row == dataset[row["row_id"]]
    negatives_only = rebalance(dataset, max_positives_per_prompt=0)
    assert negatives_only["row_id"][:] == [0, 4, 6, 7, 10]


def test_rebalance_drops_one_sided_prompts():
    dataset = make_dataset()
    assert rebalance(dataset, drop_prompts_without_positive=True)["row_id"][:] == [0, 1, 2, 3, 5, 6, 8, 9, 10]
    assert rebalance(dataset, drop_prompts_without_negative=True)["row_id"][:] == [0, 1, 2, 3, 4, 5, 6, 7, 10]
    both = rebalance(dataset, drop_prompts_without_positive=True, drop_prompts_without_negative=True)
    assert both["row_id"][:] == [0, 1, 2, 3, 5, 6, 10]
    # Drops look at the dataset before capping: prompt "a" keeps its negatives.
    dropped = rebalance(dataset, max_positives_per_prompt=0, drop_prompts_without_positive=True)
    assert dropped["row_id"][:] == [0, 6, 10]


def test_rebalance_is_deterministic_and_depends_on_the_seed():
    dataset = make_dataset(prompts=["a"] * 20, rewards=[1.0] * 10 + [-1.0] * 10)
    draws = [tuple(rebalance(dataset, 2, 3, seed=seed)["row_id"][:]) for seed in range(10)]
    assert draws == [tuple(rebalance(dataset, 2, 3, seed=seed)["row_id"][:]) for seed in range(10)]
    assert len(set(draws)) > 1
    for draw in draws:
        assert list(draw) == sorted(draw) and sum(i < 10 for i in draw) == 2 and sum(i >= 10 for i in draw) == 3


def test_anna_karenina_is_rebalance_with_one_first_positive():
    dataset = make_dataset()
    randomly = rebalance(dataset, max_positives_per_prompt=1)
    assert per_prompt_counts(randomly) == per_prompt_counts(anna_karenina(dataset))


@pytest.mark.parametrize("cap", [-1, 1.5, True])
def test_rebalance_rejects_invalid_caps(cap):
    with pytest.raises(ValueError, match="max_negatives_per_prompt"):
        rebalance(make_dataset(), max_negatives_per_prompt=cap)


def baseline_for_half(dataset, **kwargs):
    return baseline_for_target(dataset, 0.5, **kwargs)


@pytest.mark.parametrize("curate", [composition_report, anna_karenina, rebalance, baseline_for_half])
def test_missing_reward_column_is_named(curate):
    with pytest.raises(ValueError, match="'score'"):
        curate(make_dataset(), reward_column="score")
    assert curate(make_dataset().rename_column("reward", "score"), reward_column="score") is not None


def test_empty_dataset():
    empty = make_dataset(prompts=[], rewards=[])
    for curated in (anna_karenina(empty), rebalance(empty, 1, 1, True, True)):
        assert len(curated) == 0 and curated.column_names == empty.column_names
    report = composition_report(empty)
    assert (report["num_rows"], report["num_prompts"]) == (0, 0)
    assert math.isnan(report["positive_fraction"]) and math.isnan(report["effective_positive_fraction"])
    assert math.isnan(report["prompts_mixed_fraction"])
    with pytest.raises(ValueError, match="empty"):
        baseline_for_target(empty, 0.5)


def test_formatted_datasets_are_read_as_plain_values():
    dataset = make_dataset().with_format("torch")
    assert anna_karenina(dataset).with_format(None)["row_id"][:] == ANNA_KARENINA_KEPT
