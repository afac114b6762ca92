"""Every breach of the data contract raises before training, naming the column and the first bad row, and leaves
the output folder empty."""

import math
import os

import pytest
from conftest import conversational_dataset, make_args, standard_dataset
from datasets import Dataset

from trl_topr import TOPRDataError, TOPRTrainer


def replace(dataset: Dataset, column: str, row: int, value) -> Dataset:
    values = list(dataset[column])
    values[row] = value
    return dataset.remove_columns(column).add_column(column, values)


def ids_dataset():
    # the ids of a sampler's output, next to the text
    return standard_dataset().add_column("prompt_ids", [[5, 6, 7]] * 8).add_column("completion_ids", [[8, 9]] * 8)


def behavior_for(dataset, value):
    return dataset.add_column("behavior_logps", [value] * len(dataset))


CASES = {
    "missing prompt": (lambda: standard_dataset().remove_columns("prompt"), "column 'prompt'", None),
    "missing completion": (lambda: standard_dataset().remove_columns("completion"), "column 'completion'", None),
    "missing reward and label": (lambda: standard_dataset().remove_columns("reward"), "column 'reward'", None),
    "empty dataset": (lambda: standard_dataset().select([]), "no rows", None),
    "reward is a string": (
        lambda: standard_dataset().remove_columns("reward").add_column("reward", ["1"] * 8),
        "column 'reward', row 0",
        "expected a number",
    ),
    "reward is None": (lambda: replace(standard_dataset(), "reward", 3, None), "column 'reward', row 3", "number"),
    "reward is NaN": (lambda: replace(standard_dataset(), "reward", 5, math.nan), "column 'reward', row 5", "finite"),
    "reward is inf": (lambda: replace(standard_dataset(), "reward", 2, math.inf), "column 'reward', row 2", "finite"),
    "reward is boolean": (
        lambda: standard_dataset().remove_columns("reward").add_column("reward", [True] * 8),
        "column 'reward', row 0",
        "'label' column",
    ),
    "label is not boolean": (
        lambda: standard_dataset().remove_columns("reward").add_column("label", ["yes"] * 8),
        "column 'label', row 0",
        "boolean",
    ),
    "behavior is NaN": (
        lambda: replace(behavior_for(standard_dataset(), -3.0), "behavior_logps", 4, math.nan),
        "column 'behavior_logps', row 4",
        "finite and <= 0",
    ),
    "behavior is positive": (
        lambda: replace(behavior_for(standard_dataset(), -3.0), "behavior_logps", 1, 0.5),
        "column 'behavior_logps', row 1",
        "<= 0",
    ),
    "behavior is -inf": (
        lambda: replace(behavior_for(standard_dataset(), -3.0), "behavior_logps", 6, -math.inf),
        "column 'behavior_logps', row 6",
        "finite",
    ),
    "per-token behavior with a positive value": (
        lambda: replace(behavior_for(standard_dataset(), [-1.0] * 18), "behavior_logps", 2, [-1.0] * 17 + [0.1]),
        "column 'behavior_logps', row 2",
        "<= 0",
    ),
    "per-token behavior of the wrong length": (
        lambda: behavior_for(standard_dataset(), [-1.0] * 3),
        "column 'behavior_logps', row 0",
        "3 per-token values for",
    ),
    "conversational completion without a message": (
        lambda: replace(conversational_dataset(), "completion", 1, []),
        "column 'completion', row 1",
        "at least one message",
    ),
    "completion without a token to train on": (  # empty prompt, no BOS: the lone EOS token has no context
        lambda: replace(replace(standard_dataset(), "prompt", 6, ""), "completion", 6, "<|im_end|>"),
        "column 'completion', row 6",
        "no token to train on",
    ),
    "message without content": (
        lambda: replace(conversational_dataset(), "prompt", 2, [{"role": "user", "content": None}]),
        "column 'prompt', row 2",
        "list of messages",
    ),
    "unknown role": (
        lambda: replace(conversational_dataset(), "prompt", 3, [{"role": "usr", "content": "What is 1 + 3?"}]),
        "column 'prompt', row 3",
        "unknown role 'usr'",
    ),
    "reward is a list": (
        lambda: standard_dataset().remove_columns("reward").add_column("reward", [[1.0]] * 8),
        "column 'reward', row 0",
        "expected a number",
    ),
    "mixed standard and conversational columns": (
        lambda: standard_dataset().remove_columns("completion").add_column(
            "completion", conversational_dataset()["completion"]
        ),
        "column 'completion', row 0",
        "expected a string (row 0's prompt is text)",
    ),
    "not a dataset": (lambda: [{"prompt": "a", "completion": "b", "reward": 1.0}], "datasets.Dataset", None),
    "streaming dataset": (lambda: standard_dataset().to_iterable_dataset(), "IterableDataset", None),
    "prompt ids without completion ids": (
        lambda: standard_dataset().add_column("prompt_ids", [[5, 6]] * 8),
        "column 'prompt_ids' without 'completion_ids'",
        None,
    ),
    "a negative completion id": (  # Arrow keeps one type per column: a non-int id would turn every row to floats
        lambda: replace(ids_dataset(), "completion_ids", 3, [7, -1]),
        "column 'completion_ids', row 3",
        "list of token ids",
    ),
    "empty completion ids": (
        lambda: replace(ids_dataset(), "completion_ids", 5, []),
        "column 'completion_ids', row 5",
        "at least one token id",
    ),
    "completion ids outside the vocabulary": (
        lambda: replace(ids_dataset(), "completion_ids", 2, [7, 100000]),
        "column 'completion_ids', row 2",
        "outside the model's vocabulary",
    ),
    "configured column clashes with an existing one": (
        lambda: standard_dataset().add_column("score", [0.0] * 8),
        "exist but the config reads other columns",
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_raises_before_training(case, tiny_model_path, tmp_path):
    make_dataset, where, what = CASES[case]
    output_dir = tmp_path / "out"
    kwargs = {"reward_column": "score"} if case.startswith("configured column") else {}
    with pytest.raises((TOPRDataError, TypeError)) as error:
        TOPRTrainer(tiny_model_path, args=make_args(output_dir, **kwargs), train_dataset=make_dataset())
    assert where in str(error.value)
    if what:
        assert what in str(error.value)
    assert not output_dir.exists() or not os.listdir(output_dir)


def test_prompt_filling_max_length_names_the_row(tiny_model_path, tmp_path):
    dataset = replace(standard_dataset(), "prompt", 5, "What is 1 + 3? " * 10)
    with pytest.raises(TOPRDataError, match=r"train dataset, column 'prompt', row 5: the prompt fills `max_length`"):
        TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "out", max_length=40), train_dataset=dataset)
    assert not (tmp_path / "out").exists()


def test_sequence_behavior_with_a_truncated_completion_names_the_row(tiny_model_path, tmp_path):
    dataset = behavior_for(replace(standard_dataset(), "completion", 3, " The answer is 6." * 5), -30.0)
    with pytest.raises(TOPRDataError, match=r"column 'behavior_logps', row 3: `max_length` \(40\) cuts"):
        TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "out", max_length=40), train_dataset=dataset)


def test_eval_dataset_is_checked_too(tiny_model_path, tmp_path):
    with pytest.raises(TOPRDataError, match="eval dataset, column 'reward', row 1"):
        TOPRTrainer(tiny_model_path, args=make_args(tmp_path), train_dataset=standard_dataset(),
                    eval_dataset=replace(standard_dataset(), "reward", 1, math.nan))


def test_target_fraction_needs_two_reward_values(tiny_model_path, tmp_path):
    dataset = standard_dataset().remove_columns("reward").add_column("reward", [-1.0] * 8)
    with pytest.raises(ValueError, match="two distinct rewards"):
        TOPRTrainer(tiny_model_path, args=make_args(tmp_path, target_positive_fraction=0.2), train_dataset=dataset)


@pytest.mark.parametrize("rewards", [[-1.0] * 8, [1.0] * 8, [1.0], [-1.0, -1.0], "duplicated"])
def test_one_sided_tiny_and_duplicated_datasets_train(rewards, tiny_model_path, tmp_path):
    # All-negative, all-positive, single-row and duplicated data are legal: TOPR pushes down / SFTs what it has, and
    # a duplicated row simply counts twice.
    if rewards == "duplicated":
        dataset = Dataset.from_list(standard_dataset(2).to_list() * 4)
    else:
        dataset = standard_dataset(len(rewards)).remove_columns("reward").add_column("reward", rewards)
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path, max_steps=2), train_dataset=dataset)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses and all(math.isfinite(loss) for loss in losses)


def test_empty_prompt_trains_and_its_first_token_is_not_counted(tiny_model_path, tmp_path):
    # The tiny tokenizer adds no BOS: with an empty prompt the first completion token has nothing to be predicted from.
    dataset = replace(standard_dataset(), "prompt", 0, "")
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path, max_steps=2), train_dataset=dataset)
    row = trainer.train_dataset[0]
    assert row["labels"][0] == -100
    assert len(row["behavior_logps"]) == sum(label != -100 for label in row["labels"])
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


@pytest.mark.parametrize("make_dataset", [standard_dataset, conversational_dataset])
def test_empty_completion_trains_on_the_decision_to_stop(make_dataset, tiny_model_path, tmp_path):
    # A model that ends at once produced an empty completion: it is a valid sample, trained on the end-of-sequence
    # token (text) or the end of the assistant turn (messages).
    empty = "" if make_dataset is standard_dataset else [{"role": "assistant", "content": ""}]
    dataset = replace(make_dataset(), "completion", 3, empty)
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path, max_steps=2), train_dataset=dataset)
    row = trainer.train_dataset.filter(lambda r: "What is 3 + 3?" in str(r["prompt"]))[0]
    tokens = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert tokens[0] == trainer.processing_class.eos_token_id
    assert len(row["behavior_logps"]) == len(tokens)
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
