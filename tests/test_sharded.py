"""Sharded training on CPU, 2 processes (gloo): DDP, DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2, as configured in
`recipes/accelerate/`, each checked against one process: behavior log-probs, trained weights, `evaluate` on a raw
dataset after training, a cache that must not mix up two models, and one round of `run_topr_loop` with an odd number
of evaluation prompts. One launch per engine runs its variants (full fine-tuning, padding-free, LoRA) one after the
other; each test reads its variant's results.

Only what a 2-process CPU run needs is changed in the shipped configurations: 2 processes, no mixed precision, the
CPU, and for ZeRO-3 `stage3_param_persistence_threshold: 0` (else a tiny model keeps every parameter gathered and
partitioning bugs hide). DeepSpeed runs on CPU with `DS_ACCELERATOR=cpu`; its shared-memory communication op compiles
once per test run, into the run's own torch extensions folder, before the first DeepSpeed launch (conftest).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import build_deepspeed_ops, build_tiny_model, launch, make_args
from datasets import Dataset
from safetensors.torch import load_file

from trl_topr import TOPRTrainer
from trl_topr.testing import ACCELERATE_CONFIG_FILES, cpu_launch_config


pytestmark = pytest.mark.multiprocess  # each test launches 2 processes (`accelerate launch`, gloo)

RECIPES = Path(__file__).parent.parent / "recipes" / "accelerate"
# Saved weights after 6 AdamW steps at learning rate 1e-2: with the same global batches, only the order of float32
# sums differs between 1 and 2 processes (all-reduce, sharded reductions), and Adam's normalization can amplify that
# noise on near-zero gradient components. Measured here: training moved weights by up to 3.5e-2; the 2-process
# weights differed from 1 process by at most 3.4e-6 (DDP, ZeRO-2, FSDP2) and 9.6e-6 (ZeRO-3), and the whole update by
# 2.9e-6 to 5.6e-6 relative (L2). The bounds below leave 10x room and stay far below what one wrong row or step
# changes (1e-3 and more per weight).
WEIGHTS_ATOL = 1e-4
UPDATE_RTOL = 1e-4


def accelerate_config(engine: str, folder: Path) -> Path:
    """The shipped Accelerate configuration of `engine`, for 2 CPU processes."""
    return cpu_launch_config(RECIPES / ACCELERATE_CONFIG_FILES[engine], folder)


def data() -> Dataset:
    # 12 rows, completions of different lengths, positives and negatives
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} + 3?" for i in range(12)],
            "completion": [f" The answer is {i + 3 + i % 2}." + " Yes." * (i % 3) for i in range(12)],
            "reward": [1.0 if i % 2 == 0 else -1.0 for i in range(12)],
        }
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    return build_tiny_model(str(folder / "model")), build_tiny_model(str(folder / "other"), seed=1)


def masked_data(model_path: str) -> Dataset:
    """The text rows as token ids, each completion's middle third masked as a tool's result (`tool_mask` 0)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = []
    for row in data():
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        third = len(completion) // 3
        mask = [1] * third + [0] * third + [1] * (len(completion) - 2 * third)
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        rows.append({**row, "prompt_ids": prompt, "completion_ids": completion, "tool_mask": mask})
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def single_process(models, tmp_path_factory):
    """The reference: one process, the same global batch of 4."""
    folder = tmp_path_factory.mktemp("single")
    data().to_json(str(folder / "data.jsonl"))
    masked = TOPRTrainer(models[0], args=make_args(folder / "masked"), train_dataset=masked_data(models[0]))
    masked_behavior = list(masked.train_dataset["behavior_logps"])
    assert all(len(v) == sum(m) for v, m in zip(masked_behavior, masked_data(models[0])["tool_mask"]))
    trainer = TOPRTrainer(
        models[0],
        args=make_args(folder / "out", max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2),
        train_dataset=Dataset.from_json(str(folder / "data.jsonl")),
    )
    behavior = list(trainer.train_dataset["behavior_logps"])
    trainer.train()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return {"behavior": behavior, "masked_behavior": masked_behavior, "weights": weights}


# The variants each engine's tests check, run one after the other in one launch per engine (a launch's start costs
# seconds here; the variants share nothing but the process)
VARIANTS = {
    "ddp": ["full", "padding_free", "lora"],
    "zero2": ["full", "lora"],
    "zero3": ["full", "padding_free", "lora"],
    "fsdp2": ["full", "padding_free", "lora"],
}


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory):
    """`(engine, variant)` -> that variant's output folder and results, from the engine's launch (on first use)."""
    folders = {}

    def result(engine: str, variant: str) -> tuple[Path, dict]:
        if engine not in folders:
            folder = tmp_path_factory.mktemp(engine)
            run_engine(engine, models, folder)
            folders[engine] = folder
        out = folders[engine] / "out" / variant
        return out, json.loads((out / "result.json").read_text())

    return result


def run_engine(engine: str, models, folder: Path) -> None:
    data().to_json(str(folder / "data.jsonl"))
    masked_data(models[0]).to_json(str(folder / "masked.jsonl"))
    launch(
        Path(__file__).parent / "sharded_worker.py",
        engine,
        Path(__file__).parent,
        *models,
        folder / "data.jsonl",
        folder / "out",
        ",".join(VARIANTS[engine]),
        config_file=accelerate_config(engine, folder),
        env={"OMP_NUM_THREADS": "1"},
        timeout=1800,
    )


def assert_close_lists(got, want, atol):
    assert len(got) == len(want)
    for row_got, row_want in zip(got, want):
        assert len(row_got) == len(row_want)
        assert max(abs(a - b) for a, b in zip(row_got, row_want)) < atol


def check_common(result, single, out: Path):
    assert result["world"] == 2
    # the same behavior log-probs as one process, and not the other model's (a cache keyed by empty shards would)
    assert_close_lists(result["behavior"], single["behavior"], 1e-4)
    assert_close_lists(result["masked_behavior"], single["masked_behavior"], 1e-4)  # tool-masked rows too
    assert max(abs(a - b) for a, b in zip(result["other_behavior"][0], result["behavior"][0])) > 1e-3
    # evaluate() of a raw dataset after training uses the trained weights: every ratio starts at 1
    for name in ("eval_log_ratio_mean", "eval_log_ratio_min", "eval_log_ratio_max"):
        assert abs(result["evaluate"][name]) < 1e-4, (name, result["evaluate"])
    assert result["losses"] and all(loss == loss for loss in result["losses"])
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[1]["num_samples"] == 12  # 6 prompts x 2 samples: none dropped or duplicated by the padding
    # replay: round 2 trained on its rows and round 1's, whose log-ratios under the moved policy are not 0
    assert rounds[2]["num_train_rows"] == 24 and rounds[2]["age_0/rows"] == rounds[2]["age_1/rows"] == 12
    assert abs(rounds[2]["age_0/log_ratio_mean"]) < 1e-4 < abs(rounds[2]["age_1/log_ratio_mean"])
    # each round frees its trainer, model, training engine and optimizer, with activation checkpointing on (under
    # ZeRO-3, DeepSpeed's registries kept them: memory grew by the model and its optimizer states every round)
    assert result["loop_trained"].count("optimizer") == 2
    assert result["loop_alive"] == []
    for r in rounds:  # 5 evaluation prompts over 2 processes: every one counted once
        assert 0.0 <= r["pass@1"] <= 1.0 and "invalid_rate" in r
    assert len((out / "loop" / "round-1" / "samples.jsonl").read_text().splitlines()) == 12


ENGINES = ["ddp", "zero2", "zero3", "fsdp2"]


def check_weights(out: Path, single, models, engine: str, layout: str = "") -> None:
    saved = load_file(str(out / "model" / "model.safetensors"))
    assert set(saved) == set(single["weights"])  # whole weights, not shards (the tiny model ties none)
    for name, want in single["weights"].items():
        torch.testing.assert_close(saved[name].float(), want.float(), atol=WEIGHTS_ATOL, rtol=0)
    initial = load_file(str(Path(models[0]) / "model.safetensors"))
    update_1 = torch.cat([(single["weights"][n].float() - initial[n].float()).flatten() for n in initial])
    update_2 = torch.cat([(saved[n].float() - initial[n].float()).flatten() for n in initial])
    relative = ((update_2 - update_1).norm() / update_1.norm()).item()
    # the figures of docs/distributed.md: `pytest -s tests/test_sharded.py -k full` prints them
    print(
        f"{engine}{layout}: weights moved up to {update_1.abs().max().item():.1e}; 2 processes vs 1: max "
        f"{(update_2 - update_1).abs().max().item():.1e}, relative {relative:.1e}"
    )
    assert relative < UPDATE_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_full_fine_tuning_matches_one_process(engine, launched, models, single_process):
    out, result = launched(engine, "full")
    check_common(result, single_process, out)
    assert result["engine"]["deepspeed"] == engine.startswith("zero")
    assert result["partitioned"] == (engine == "zero3")
    assert result["engine"]["fsdp"] == result["engine"]["dtensor"] == (engine == "fsdp2")
    check_weights(out, single_process, models, engine)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "zero3", "fsdp2"])
def test_padding_free_matches_one_padded_process(engine, launched, models, single_process):
    # every step of the checklist padding-free (training, the precompute, evaluate, the loop with replay), against
    # one padded process: the same behavior log-probs and trained weights
    out, result = launched(engine, "padding_free")
    check_common(result, single_process, out)
    assert result["partitioned"] == (engine == "zero3")
    assert result["engine"]["fsdp"] == result["engine"]["dtensor"] == (engine == "fsdp2")
    check_weights(out, single_process, models, engine, " padding-free")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_lora_trains_and_loops(engine, launched, single_process):
    out, result = launched(engine, "lora")
    check_common(result, single_process, out)
    assert (out / "model" / "adapter_model.safetensors").exists()
    assert (out / "loop" / "round-1" / "adapter" / "adapter_model.safetensors").exists()


def test_deepspeed_builds_its_op_in_a_folder_of_this_run_and_leaves_no_lock():
    # A build of DeepSpeed's CPU op stopped midway left its lock in the shared torch extensions folder, and every
    # ZeRO launch after it waited on the lock until its timeout: the run builds in a folder of its own, once, first.
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    assert folder.name.startswith("torch-extensions-") and folder.is_dir()
    build_deepspeed_ops()
    assert list(folder.rglob("deepspeed_shm_comm*.so"))
    assert not list(folder.rglob("lock"))
