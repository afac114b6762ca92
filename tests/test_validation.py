"""Every breach of the data contract raises before training, naming the column and the first bad row, and leaves
the output folder empty."""

import json
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
        lambda: (
            standard_dataset()
            .remove_columns("completion")
            .add_column("completion", conversational_dataset()["completion"])
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
        TOPRTrainer(
            tiny_model_path,
            args=make_args(tmp_path),
            train_dataset=standard_dataset(),
            eval_dataset=replace(standard_dataset(), "reward", 1, math.nan),
        )


def test_a_target_fraction_of_one_sided_data_trains_with_baseline_0(tiny_model_path, tmp_path):
    # no baseline changes the composition of data whose rewards are all equal: c = 0, said in a warning, as in every
    # trainer (`topr_baseline`)
    dataset = standard_dataset().remove_columns("reward").add_column("reward", [-1.0] * 8)
    trainer = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path, target_positive_fraction=0.2), train_dataset=dataset
    )
    assert trainer.baseline == 0.0


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


# The iterative loop's inputs: each refused before anything is loaded, generated or written. A case gives the loop's
# arguments as changes to a good call, the error type and what its message must say; "resume" cases run on a copy of
# a folder where 2 rounds with replay are done, damaged by the case.
def answer_correct(prompts, completions, answer, **kwargs):
    return [1.0 if a in c else -1.0 for c, a in zip(completions, answer)]


def loop_prompts(n: int = 3, **columns) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [f"What is {i} + 3?" for i in range(n)], "answer": [str(i + 3) for i in range(n)], **columns}
    )


def with_row(dataset: Dataset, row: int, prompt) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [prompt if i == row else p for i, p in enumerate(dataset["prompt"])], "answer": dataset["answer"]}
    )


def cut_line(folder, round_index: int, keep_lines: int, cut_mid_line: bool = False):
    path = folder / f"round-{round_index}" / "train.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:keep_lines] + ([lines[keep_lines][:30]] if cut_mid_line else [])) + "\n")


def drop_column(folder, round_index: int, column: str):
    path = folder / f"round-{round_index}" / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != column}) + "\n" for r in rows))


def damage_metrics(folder):
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    (folder / "metrics.jsonl").write_text("\n".join([lines[0][:10], *lines[1:]]) + "\n")


def same_name(value):
    def reward(prompts, completions, **kwargs):
        return [value] * len(completions)

    return reward


LOOP_CASES = {
    "num_rounds negative": (dict(num_rounds=-1), ValueError, "`num_rounds` must be an integer >= 0, got -1"),
    "num_rounds a float": (dict(num_rounds=1.5), ValueError, "`num_rounds` must be an integer >= 0, got 1.5"),
    "num_rounds a string": (dict(num_rounds="2"), ValueError, "`num_rounds` must be an integer >= 0, got '2'"),
    "replay_rounds negative": (dict(replay_rounds=-1), ValueError, "`replay_rounds` must be an integer >= 0, got -1"),
    "replay_rounds a float": (dict(replay_rounds=0.5), ValueError, "`replay_rounds` must be an integer >= 0"),
    "replay_rounds a boolean": (dict(replay_rounds=True), ValueError, "`replay_rounds` must be an integer >= 0"),
    "model in memory": (dict(model="loaded"), TypeError, "`model` is the id or path of the initial model"),
    "train_args not a TOPRConfig": (
        dict(train_args={"output_dir": "x"}),
        TypeError,
        "`train_args` must be a `TOPRConfig`, got a dict",
    ),
    "loop_args not a TOPRLoopConfig": (
        dict(loop_args={"num_rounds": 2}),
        TypeError,
        "`loop_args` must be a `TOPRLoopConfig`, got a dict",
    ),
    "engine not an engine": (dict(engine="vllm"), TypeError, "`engine` must be a `GenerationEngine`"),
    "curation unknown": (dict(curation="ana_karenina"), ValueError, "`curation` 'ana_karenina' is neither"),
    "curation's module missing": (dict(curation="no_module.curate"), ValueError, "`curation` 'no_module.curate'"),
    "answer_func not callable": (dict(answer_func="last"), TypeError, "`answer_func` must be callable"),
    "train prompts a list": (
        dict(train_prompts=["What is 1 + 1?"]),
        TypeError,
        "train prompts dataset must be a map-style `datasets.Dataset`, got list",
    ),
    "train prompts streamed": (
        dict(train_prompts=loop_prompts().to_iterable_dataset()),
        TypeError,
        "got IterableDataset",
    ),
    "train prompts without a prompt column": (
        dict(train_prompts=loop_prompts().rename_column("prompt", "question")),
        TOPRDataError,
        "train prompts dataset: missing column 'prompt'",
    ),
    "train prompts empty": (dict(train_prompts=loop_prompts().select([])), TOPRDataError, "has no rows"),
    "train prompt None": (
        dict(train_prompts=with_row(loop_prompts(), 2, None)),
        TOPRDataError,
        "train prompts dataset, column 'prompt', row 2: expected a string",
    ),
    "train prompt with an unknown role": (
        dict(
            train_prompts=Dataset.from_dict(
                {
                    "prompt": [[{"role": "user", "content": "hi"}], [{"role": "usr", "content": "hi"}]],
                    "answer": ["1", "2"],
                }
            )
        ),
        TOPRDataError,
        "train prompts dataset, column 'prompt', row 1: unknown role 'usr'",
    ),
    "train prompt without a message": (
        dict(
            train_prompts=Dataset.from_dict(
                {"prompt": [[{"role": "user", "content": "hi"}], []], "answer": ["1", "2"]}
            )
        ),
        TOPRDataError,
        "column 'prompt', row 1: a conversational prompt needs at least one message",
    ),
    "train prompt filling max_length": (
        dict(train_prompts=with_row(loop_prompts(), 1, "What is 1 + 3? " * 12)),
        TOPRDataError,
        "train prompts dataset, column 'prompt', row 1: the prompt has",
    ),
    "eval prompts without correct_func": (
        dict(correct_func=None),
        ValueError,
        "needs `correct_func` and `answer_func`",
    ),
    "eval prompts without a prompt column": (
        dict(eval_prompts=loop_prompts().remove_columns("prompt")),
        TOPRDataError,
        "eval prompts dataset: missing column 'prompt'",
    ),
    "eval prompts numbers": (
        dict(eval_prompts=Dataset.from_dict({"prompt": [7, 8], "answer": ["2", "3"]})),
        TOPRDataError,
        "eval prompts dataset, column 'prompt', row 0: expected a string",
    ),
    "no reward function": (dict(reward_funcs=[]), ValueError, "No reward function was given"),
    "reward function by name": (
        dict(reward_funcs=["gsm8k_reward"]),
        TypeError,
        "Reward function 'str' is a str, not a callable",
    ),
    "two reward functions of one name": (
        dict(reward_funcs=[same_name(1.0), same_name(-1.0)]),
        ValueError,
        "Two reward functions are named 'reward'",
    ),
    "reward weights of the wrong count": (
        dict(reward_weights=[1.0, 0.0]),
        ValueError,
        "2 reward weights for 1 reward functions",
    ),
    "reward weight NaN": (dict(reward_weights=[math.nan]), ValueError, "Reward weights must be finite numbers"),
    "quantization without an adapter": (dict(quantization_config="4bit"), ValueError, "QLoRA"),
    "output_dir a file": (dict(output_dir="file"), NotADirectoryError, "is a file: the loop needs a folder"),
    "resume: fewer rounds than done": (
        dict(num_rounds=1, resume=None),
        ValueError,
        "records 2 completed round(s), more than `num_rounds` (1)",
    ),
    "resume: replayed rows missing": (
        dict(resume=lambda f: (f / "round-2" / "train.jsonl").unlink()),
        FileNotFoundError,
        "round-2/train.jsonl is missing",
    ),
    "resume: replayed rows cut mid-line": (
        dict(resume=lambda f: cut_line(f, 2, 3, cut_mid_line=True)),
        TOPRDataError,
        "round-2/train.jsonl, line 4: not a JSON row",
    ),
    "resume: replayed rows cut at a line's end": (
        dict(resume=lambda f: cut_line(f, 2, 4)),
        TOPRDataError,
        "round-2/train.jsonl has 4 rows where round 2 recorded 6",
    ),
    "resume: replayed rows without their mu": (
        dict(resume=lambda f: drop_column(f, 2, "behavior_logps")),
        TOPRDataError,
        "round-2/train.jsonl, line 1: no ['behavior_logps']",
    ),
    "resume: metrics damaged": (dict(resume=damage_metrics), ValueError, "metrics.jsonl, line 1, is not JSON"),
}


LOOP_FIELDS = ("num_rounds", "replay_rounds", "curation", "prompts_per_round", "reward_weights")


def run_loop(model_path, output_dir, num_rounds=2, **changes):
    from trl_topr import TOPRLoopConfig, run_topr_loop

    loop_changes = {name: changes.pop(name) for name in LOOP_FIELDS if name in changes}
    call = dict(
        model=model_path,
        train_prompts=loop_prompts(),
        reward_funcs=answer_correct,
        train_args=make_args(output_dir, max_steps=-1, max_length=40),
        eval_prompts=loop_prompts(2),
        correct_func=answer_correct,
        answer_func=lambda text: text[-1:],
    )
    call.update(changes)
    if "loop_args" not in call:  # its fields are checked as it is built: before anything is written too
        options = dict(num_rounds=num_rounds, replay_rounds=1, num_generations=2, max_completion_length=4)
        call["loop_args"] = TOPRLoopConfig(**{**options, **loop_changes})
    return run_topr_loop(**call)


@pytest.fixture(scope="module")
def two_rounds_with_replay(tiny_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loop") / "done"
    run_loop(tiny_model_path, folder)
    return folder


def snapshot(folder):
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")} if folder.exists() else None


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_bad_loop_inputs_raise_before_anything_is_written(case, tiny_model_path, two_rounds_with_replay, tmp_path):
    import shutil

    changes, error, message = LOOP_CASES[case]
    changes = dict(changes)
    output_dir = tmp_path / "out"
    if "resume" in changes:  # a copy of the done folder, damaged; the call asks for a third round
        shutil.copytree(two_rounds_with_replay, output_dir)
        damage = changes.pop("resume")
        if damage is not None:
            damage(output_dir)
        changes.setdefault("num_rounds", 3)
    if changes.get("model") == "loaded":
        from transformers import AutoModelForCausalLM

        changes["model"] = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    if changes.get("output_dir") == "file":
        output_dir.write_text("not a folder")
        changes["train_args"] = make_args(output_dir)
        del changes["output_dir"]
    if changes.get("quantization_config") == "4bit":
        from transformers import BitsAndBytesConfig

        changes["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True)
    before = snapshot(output_dir) if output_dir.is_dir() else output_dir.exists()
    with pytest.raises(error) as raised:
        run_loop(tiny_model_path, output_dir, **changes)
    assert message in str(raised.value)
    assert (snapshot(output_dir) if output_dir.is_dir() else output_dir.exists()) == before  # nothing written


def test_a_resumed_loop_with_a_whole_folder_goes_on(tiny_model_path, two_rounds_with_replay, tmp_path):
    # the control of the "resume" cases: the undamaged copy trains its third round, replaying round 2's rows
    import shutil

    shutil.copytree(two_rounds_with_replay, tmp_path / "out")
    rounds = run_loop(tiny_model_path, tmp_path / "out", num_rounds=3)
    assert [r["round"] for r in rounds] == [0, 1, 2, 3] and rounds[3]["num_train_rows"] == 12
    assert run_loop(tiny_model_path, tmp_path / "out", num_rounds=3) == rounds  # nothing left to do: read back
