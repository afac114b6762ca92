"""TOPRConfig: TRL-style dataclass, defaults, and the option conflicts it refuses."""

import dataclasses

import pytest
from transformers import HfArgumentParser

from trl_topr import TOPRConfig


def config(**kwargs):
    return TOPRConfig(output_dir="unused", use_cpu=True, report_to="none", **kwargs)


def test_defaults_are_the_papers():
    args = config()
    assert (args.loss_type, args.ratio_level, args.loss_normalization) == ("topr", "sequence", "sequence_length")
    assert args.baseline is None and args.target_positive_fraction is None
    assert (args.prompt_column, args.completion_column, args.reward_column, args.behavior_logps_column) == (
        "prompt",
        "completion",
        "reward",
        "behavior_logps",
    )
    assert args.learning_rate == 1e-6


def test_every_field_has_help():
    for field in dataclasses.fields(TOPRConfig):
        if field.name in TOPRConfig.__dataclass_fields__ and field.init:
            assert field.metadata.get("help"), field.name


def test_command_line_parsing():
    (args,) = HfArgumentParser(TOPRConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            "x",
            "--use_cpu",
            "--report_to",
            "none",
            "--loss_type",
            "tis",
            "--negative_ratio_bounds",
            "0.1",
            "0.9",
            "--target_positive_fraction",
            "0.2",
        ]
    )
    assert args.loss_type == "tis"
    assert args.negative_ratio_bounds == [0.1, 0.9]
    assert args.target_positive_fraction == 0.2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"baseline": 0.1, "target_positive_fraction": 0.2}, "at most one of `baseline`, `target_positive_fraction`"),
        ({"target_positive_fraction": 0.0}, r"\(0, 1\)"),
        ({"target_positive_fraction": 1.2}, r"\(0, 1\)"),
        ({"loss_type": "dpo"}, "loss_type"),
        ({"ratio_level": "word"}, "ratio_level"),
        ({"loss_normalization": "mean"}, "loss_normalization"),
        ({"negative_ratio_bounds": [1.0, 0.0]}, "negative_ratio_bounds"),
        ({"positive_ratio_bounds": [1.0]}, "positive_ratio_bounds"),
        ({"loss_type": "ppo_clip", "positive_ratio_bounds": [0.0, 1.0]}, "ppo_clip"),
        ({"epsilon": 1.5}, "epsilon"),
        ({"baseline": float("nan")}, "baseline"),
        ({"packing": True}, "padding_free=True"),
        ({"completion_only_loss": False}, "completion_only_loss"),
    ],
)
def test_conflicting_or_invalid_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs)
