"""TOPRGRPOTrainer: online TOPR on TRL's GRPO generation loop, on a tiny Llama, on CPU and offline."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl
from conftest import TOOL_PROMPT, multiply
from datasets import Dataset
from trl import GRPOConfig

import trl_topr.online
from trl_topr.online import TOPRGRPOConfig, TOPRGRPOTrainer


def digit_reward(completions, **kwargs):
    """+1 for a completion with a digit, -1 otherwise."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if any(ch.isdigit() for ch in text) else -1.0 for text in texts]


def constant_reward(completions, **kwargs):
    return [2.0] * len(completions)


def prompts(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(n)]})


def grpo_args(output_dir, **kwargs) -> TOPRGRPOConfig:
    defaults = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        activation_checkpointing=False,
        learning_rate=1e-2,
        seed=0,
    )
    defaults.update(kwargs)
    return TOPRGRPOConfig(**defaults)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_trains_online_and_tapers_negatives_off_policy(tiny_model_path, tmp_path):
    # steps_per_generation=2 with no accumulation: the second step reuses completions sampled before the first
    # update, so GRPO computes old_per_token_logps and the step is off-policy.
    args = grpo_args(tmp_path, steps_per_generation=2)
    trainer = TOPRGRPOTrainer(tiny_model_path, reward_funcs=digit_reward, args=args, train_dataset=prompts())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    first = trainer.state.log_history[0]
    for key in (
        "positive_fraction",
        "effective_positive_fraction",
        "baseline",
        "positive_weight_mean",
        "negative_weight_mean",
        "negative_tapered_fraction",
        "log_ratio_mean",
        "log_ratio_min",
        "log_ratio_max",
        "entropy",
        "reward",
        "rewards/digit_reward/mean",
    ):
        assert key in first, key
    # step 1 is on-policy (mu = pi), step 2 off-policy: a ratio away from 1, negatives' weights within [0, 1]
    assert first["log_ratio_mean"] == pytest.approx(0.0, abs=1e-6)
    second = trainer.state.log_history[1]
    assert second["log_ratio_max"] - second["log_ratio_min"] > 0
    assert 0.0 <= second["negative_weight_mean"] < 1.0 and second["negative_tapered_fraction"] > 0.0
    assert second["positive_weight_mean"] == 1.0
    trainer.create_model_card(model_name="tiny-topr-grpo")
    card = (tmp_path / "README.md").read_text()
    assert "TOPR-GRPO" in card and "2503.14286" in card and "topr" in card


def test_on_policy_topr_equals_reinforce(tiny_model_path, tmp_path):
    # One generation per optimizer step: every step is on-policy, the weights are all 1 and TOPR is REINFORCE.
    results = {}
    for loss_type in ("topr", "reinforce"):
        args = grpo_args(tmp_path / loss_type, loss_type=loss_type, max_steps=1)
        trainer = TOPRGRPOTrainer(tiny_model_path, reward_funcs=digit_reward, args=args, train_dataset=prompts())
        trainer.train()
        results[loss_type] = (logged(trainer, "loss")[0], {n: p.detach() for n, p in trainer.model.named_parameters()})
    assert results["topr"][0] == results["reinforce"][0] != 0.0
    for name, value in results["topr"][1].items():
        torch.testing.assert_close(value, results["reinforce"][1][name], rtol=0, atol=0)


@pytest.mark.parametrize("group_baseline", [False, True])
def test_rewards_are_raw_and_the_baseline_is_ours(tiny_model_path, tmp_path, group_baseline):
    # A constant reward gives GRPO zero advantages. TOPR uses R - c: with c = 0 every completion is a positive of
    # weight 2 (SFT-like); with the group mean as c, R - c = 0 and nothing is learned.
    args = grpo_args(tmp_path, max_steps=1, group_baseline=group_baseline)
    trainer = TOPRGRPOTrainer(tiny_model_path, reward_funcs=constant_reward, args=args, train_dataset=prompts())
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["baseline"] == (2.0 if group_baseline else 0.0)
    assert log["positive_fraction"] == (0.0 if group_baseline else 1.0)  # at the baseline: pushed neither way
    assert (log["loss"] == 0.0) == group_baseline


def test_target_positive_fraction_sets_the_baseline_of_each_generation_batch(tiny_model_path, tmp_path):
    # One generation batch per step: the logged effective positive fraction is the target whenever both signs occur.
    args = grpo_args(tmp_path, max_steps=1, per_device_train_batch_size=8, target_positive_fraction=0.2)
    trainer = TOPRGRPOTrainer(tiny_model_path, reward_funcs=digit_reward, args=args, train_dataset=prompts())
    trainer.train()
    log = trainer.state.log_history[0]
    assert 0.0 < log["positive_fraction"] < 1.0
    assert log["effective_positive_fraction"] == pytest.approx(0.2, abs=1e-4)
    assert -1.0 < log["baseline"] < 1.0 and log["baseline"] != 0.0


def test_config_validation(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="loss_type"):
        grpo_args(tmp_path, loss_type="dapo")
    with pytest.raises(ValueError, match="beta"):
        grpo_args(tmp_path, beta=0.04)
    with pytest.raises(ValueError, match="at most one"):
        grpo_args(tmp_path, baseline=0.5, group_baseline=True)
    with pytest.raises(TypeError, match="TOPRGRPOConfig"):
        plain = GRPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2)
        TOPRGRPOTrainer(tiny_model_path, reward_funcs=digit_reward, args=plain, train_dataset=prompts())


def swap_trainer_class(source: str) -> str:
    """Replace `GRPOTrainer` / `GRPOConfig` by `TOPRGRPOTrainer` / `TOPRGRPOConfig` from `trl_topr.online`."""
    source = re.sub(r"\bGRPO(Trainer|Config)\b", r"TOPRGRPO\1", source)

    def move_import(match):
        indent, names = match.group(1), [name.strip() for name in match.group(2).split(",")]
        ours = [name for name in names if name.startswith("TOPRGRPO")]
        rest = [name for name in names if name not in ours]
        lines = [f"{indent}from trl import {', '.join(rest)}"] if rest else []
        return "\n".join(lines + ([f"{indent}from trl_topr.online import {', '.join(ours)}"] if ours else []))

    return re.sub(r"^([ \t]*)from trl import ([^(\n]+)$", move_import, source, flags=re.MULTILINE)


def test_trl_grpo_script_runs_with_the_class_name_swapped(tiny_model_path, tmp_path):
    script = Path(trl.__file__).parent / "scripts" / "grpo.py"
    swapped = swap_trainer_class(script.read_text())
    assert "TOPRGRPOTrainer(" in swapped and "from trl_topr.online import TOPRGRPOTrainer" in swapped
    (tmp_path / "grpo_topr.py").write_text(swapped)
    (tmp_path / "my_rewards.py").write_text(
        "def digit_reward(completions, **kwargs):\n"
        "    texts = [c[-1]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [1.0 if any(ch.isdigit() for ch in t) else -1.0 for t in texts]\n"
    )
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 3?"}]} for i in range(8)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [
        sys.executable,
        "grpo_topr.py",
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_name",
        str(data),
        "--reward_funcs",
        "my_rewards.digit_reward",
        "--output_dir",
        str(tmp_path / "out"),
        "--use_cpu",
        "--bf16",
        "False",
        "--report_to",
        "none",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--max_completion_length",
        "8",
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--activation_checkpointing",
        "False",
        "--loss_type",
        "topr",
        "--negative_ratio_bounds",
        "0",
        "1",
        "--steps_per_generation",
        "2",
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Training completed" in output
    assert "negative_weight_mean" in output and "log_ratio_mean" in output  # TOPR's metrics: its loss ran
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_tool_results_get_no_weight_online(tool_policy, tmp_path, monkeypatch):
    # TRL's GRPO samples with tools (the tiny policy calls `multiply`); the gradient of TOPR's loss with respect to
    # each token's log-prob is 0 on the tool's result and the template's text around it, and not on the policy's.
    seen = []
    real_loss = trl_topr.online.topr_loss

    def recording_loss(per_token_logps, mask, *args, **kwargs):
        loss, metrics = real_loss(per_token_logps, mask, *args, **kwargs)
        (grad,) = torch.autograd.grad(loss, per_token_logps, retain_graph=True)
        seen.append(grad)
        return loss, metrics

    monkeypatch.setattr(trl_topr.online, "topr_loss", recording_loss)
    real_compute = TOPRGRPOTrainer.policy_loss
    batches = []

    def recording_compute(self, model, inputs):
        batches.append({name: inputs[name] for name in ("completion_mask", "tool_mask") if name in inputs})
        return real_compute(self, model, inputs)

    monkeypatch.setattr(TOPRGRPOTrainer, "policy_loss", recording_compute)
    args = grpo_args(tmp_path, max_completion_length=200, temperature=0.1, max_steps=1, learning_rate=1e-5)
    dataset = Dataset.from_dict({"prompt": [TOOL_PROMPT] * 4, "answer": ["56"] * 4})

    def answered(completions, answer, **kwargs):
        return [1.0 if a in c[-1]["content"] else -1.0 for c, a in zip(completions, answer)]

    trainer = TOPRGRPOTrainer(tool_policy, reward_funcs=answered, args=args, train_dataset=dataset, tools=[multiply])
    trainer.train()
    assert batches and all("tool_mask" in batch for batch in batches)
    tool_tokens = policy_tokens = 0
    for batch, grad in zip(batches, seen):
        tool = batch["completion_mask"].bool() & ~batch["tool_mask"].bool()
        policy = batch["completion_mask"].bool() & batch["tool_mask"].bool()
        assert torch.all(grad[tool] == 0)
        tool_tokens, policy_tokens = tool_tokens + int(tool.sum()), policy_tokens + int((grad[policy] != 0).sum())
    assert tool_tokens > 0 and policy_tokens > 0  # the policy called the tool, and its own tokens were weighted
