"""Replay of earlier rounds' rows, and the metrics by sample age, on hand-made rows whose recorded mu is known."""

import json
import math

import pytest
from conftest import make_args
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_topr import TOPRDataError
from trl_topr.logprobs import LogpsSettings, behavior_logps, completion_row
from trl_topr.replay import metrics_by_age, read_train_rows, with_replayed_rows


def rows_of(round_index, n, invalid):
    return [
        {
            "prompt": f"q{i}",
            "reward": 1.0 if i % 2 else -1.0,
            "invalid": invalid,
            "sample_round": round_index,
            "prompt_ids": [5, 6],
            "completion_ids": [7 + i, 8],
            "behavior_logps": [-1.0, -2.0],
        }
        for i in range(n)
    ]


def test_replayed_rows_follow_the_rounds_own_and_keep_their_types(tmp_path):
    # round 3 with replay 2 reads rounds 1 and 2; a column empty (None) this round takes the earlier rounds' type
    for round_index, invalid in ((1, 0.0), (2, 1.0)):
        (tmp_path / f"round-{round_index}").mkdir()
        Dataset.from_list(rows_of(round_index, 2, invalid)).to_json(
            str(tmp_path / f"round-{round_index}" / "train.jsonl")
        )
    own = Dataset.from_list(rows_of(3, 3, None))
    rows = with_replayed_rows(own, tmp_path, 3, 2)
    assert rows["sample_round"] == [3, 3, 3, 1, 1, 2, 2]
    assert rows["invalid"] == [None, None, None, 0.0, 0.0, 1.0, 1.0]
    assert rows["behavior_logps"][-1] == [-1.0, -2.0]
    assert with_replayed_rows(own, tmp_path, 3, 1)["sample_round"] == [3, 3, 3, 2, 2]
    assert with_replayed_rows(own, tmp_path, 1, 2) is own  # no round before the first
    with pytest.raises(FileNotFoundError):
        with_replayed_rows(own, tmp_path, 5, 1)  # round 4 was never saved


@pytest.mark.parametrize(
    "damage, error, message",
    [
        ("missing", FileNotFoundError, r"round-2/train.jsonl is missing: round 2's training rows"),
        ("cut mid-line", TOPRDataError, r"round-2/train.jsonl, line 3: not a JSON row"),
        (
            "cut at a line's end",
            TOPRDataError,
            r"round-2/train.jsonl has 2 rows where round 2 recorded 3: the file "
            r"was cut after line 2",
        ),
        ("a row without its mu", TOPRDataError, r"round-2/train.jsonl, line 2: no \['behavior_logps'\]"),
    ],
)
def test_a_damaged_train_file_is_named_with_its_line(tmp_path, damage, error, message):
    folder = tmp_path / "round-2"
    folder.mkdir()
    lines = [json.dumps(row) for row in rows_of(2, 3, 0.0)]
    if damage == "cut mid-line":
        lines[2] = lines[2][:25]
    elif damage == "cut at a line's end":
        lines = lines[:2]
    elif damage == "a row without its mu":
        lines[1] = json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "behavior_logps"})
    if damage != "missing":
        (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(error, match=message) as raised:
        with_replayed_rows(Dataset.from_list(rows_of(3, 1, 0.0)), tmp_path, 3, 1, recorded_rows={2: 3})
    assert "lower `replay_rounds`" in str(raised.value)  # the way on that loses no completed round


def test_whole_train_file_reads_back(tmp_path):
    (tmp_path / "round-1").mkdir()
    Dataset.from_list(rows_of(1, 3, 0.0)).to_json(str(tmp_path / "round-1" / "train.jsonl"))
    assert read_train_rows(tmp_path, 1, recorded_rows=3) == rows_of(1, 3, 0.0)


def test_metrics_by_age_measure_the_log_ratio_taper_and_weight_share(tiny_model_path, tmp_path):
    # Age-1 rows whose recorded mu is the policy's log-probs shifted per row: a negative 2 nats more likely under mu
    # (ratio e^-2, tapered), a negative 1 nat less likely (ratio e, weight clipped to 1, not tapered), a positive
    # 3 nats more likely (ratio e^-3; positives keep weight 1). Age-0 rows carry the policy's own log-probs.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = [([5, 6, 7], [8, 9]), ([5, 6], [10, 11, 12]), ([7, 8], [13]), ([9], [14, 15]), ([5], [16])]
    pi = behavior_logps(model, [completion_row(p, c) for p, c in ids], LogpsSettings(tokenizer.pad_token_id))
    shifts, rewards, rounds = [0.0, 0.0, 2.0, -1.0, 3.0], [-1.0, 1.0, -1.0, -1.0, 1.0], [4, 4, 3, 3, 3]
    rows = Dataset.from_list(
        [
            {
                "prompt_ids": p,
                "completion_ids": c,
                "reward": r,
                "sample_round": k,
                "behavior_logps": [v + shift / len(values) for v in values],
            }
            for (p, c), values, shift, r, k in zip(ids, pi, shifts, rewards, rounds)
        ]
    )
    metrics = metrics_by_age(model, rows, 4, make_args(tmp_path), baseline=0.0, processing_class=tokenizer)
    assert metrics["age_0/rows"] == 2 and metrics["age_1/rows"] == 3
    assert abs(metrics["age_0/log_ratio_mean"]) < 1e-5 and metrics["age_0/negative_tapered_fraction"] == 0.0
    assert metrics["age_1/log_ratio_mean"] == pytest.approx((-2 + 1 - 3) / 3, abs=1e-4)
    assert metrics["age_1/log_ratio_min"] == pytest.approx(-3, abs=1e-4)
    assert metrics["age_1/ratio_mean"] == pytest.approx((math.exp(-2) + math.e + math.exp(-3)) / 3, rel=1e-4)
    assert metrics["age_1/negative_tapered_fraction"] == 0.5  # of its 2 negatives, the one at e^-2
    # weight x |R - c|: age 0 has 1 + 1, age 1 has e^-2 + 1 + 1 (the positive keeps weight 1)
    total = 2 + math.exp(-2) + 2
    assert metrics["age_0/weight_share"] == pytest.approx(2 / total, rel=1e-4)
    assert metrics["age_1/weight_share"] == pytest.approx((math.exp(-2) + 2) / total, rel=1e-4)
    # the clamp: of TOPR's windows only the negatives' uses the ratio; the negative at e (above 1) is clamped
    assert metrics["age_0/clamped_fraction"] == 0.0 and metrics["age_1/clamped_fraction"] == pytest.approx(1 / 3)
    assert metrics["clamped_fraction"] == pytest.approx(1 / 5)
    # effective sample size of the raw ratios: 1 for age 0 (every ratio 1), (sum w)^2 / (n sum w^2) for age 1
    w = [math.exp(-2), math.e, math.exp(-3)]
    assert metrics["age_0/effective_sample_size"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["age_1/effective_sample_size"] == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)), rel=1e-4)
    w += [1.0, 1.0]
    assert metrics["effective_sample_size"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)), rel=1e-4)
    assert json.loads(json.dumps(metrics)) == metrics  # written to metrics.jsonl as is
