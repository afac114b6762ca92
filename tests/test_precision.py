"""The precision rule: bf16 where it runs faster than float32 on the training device (measured on a CPU, once, and
cached), an explicit choice always respected. Both CPU outcomes are tested by giving the rule a measured speedup; the
probe itself and its cache run for real."""

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_args, standard_dataset
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import trl_topr.precision as precision
from trl_topr import TOPRConfig, evaluate_policy, sample_completions
from trl_topr.generation import SamplingSettings
from trl_topr.online import TOPRGRPOConfig
from trl_topr.sampling import generate_completions


@pytest.fixture(params=[True, False], ids=["fast-bf16-cpu", "slow-bf16-cpu"])
def native(request, monkeypatch):
    """A CPU where the probe found bf16 3x faster than float32, or 2x slower; earlier warnings forgotten."""
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 3.0 if request.param else 0.5)
    monkeypatch.setattr(precision, "_warned", set())
    return request.param


def test_the_measured_speedup_decides(native):
    assert precision.bf16_is_faster("cpu") is native
    assert precision.bf16_is_faster() is native  # no accelerator here: the training device is the CPU


@pytest.mark.parametrize("speedup, chosen", [(0.02, False), (0.5, False), (1.2, False), (1.25, True), (4.2, True)])
def test_bf16_needs_a_clear_margin(monkeypatch, speedup, chosen):
    # 0.02: AVX2 only; 0.5: AVX512 without BF16; 4.2: a fast AVX512-BF16; 1.2: within the probe's noise
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: speedup)
    assert precision.bf16_is_faster("cpu") is chosen


@pytest.mark.parametrize("config_class", [TOPRConfig, TOPRGRPOConfig])
def test_unset_bf16_follows_the_hardware(native, config_class, tmp_path):
    args = config_class(output_dir=str(tmp_path), report_to="none")
    assert args.bf16 is native
    assert args.use_cpu  # no accelerator: set, so that transformers accepts bf16 on the CPU
    assert args.fp16 is False


def test_the_choice_is_logged_once_with_its_reason(native, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="trl_topr.precision"):
        for _ in range(2):
            TOPRConfig(output_dir=str(tmp_path), report_to="none")
    said = [r.getMessage() for r in caplog.records if r.name == "trl_topr.precision"]
    assert len(said) == 1
    assert said[0].startswith(f"Precision: {'bf16' if native else 'float32'} on cpu")
    assert f"bf16 matmuls ran {3.0 if native else 0.5:.2f}x float32's" in said[0] and "--bf16" in said[0]


@pytest.mark.parametrize("explicit", [True, False])
def test_an_explicit_choice_is_respected(native, explicit, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_topr.precision"):
        for _ in range(2):  # the warning is given once
            args = TOPRConfig(output_dir=str(tmp_path), report_to="none", bf16=explicit)
            assert args.bf16 is explicit
    warnings = [r for r in caplog.records if r.name == "trl_topr.precision"]
    if explicit and not native:
        assert len(warnings) == 1
        assert "not clearly faster than float32" in warnings[0].message and "--bf16 false" in warnings[0].message
        assert "0.50x" in warnings[0].message  # the measurement that says so
    else:
        assert not warnings


def test_fp16_is_not_overridden(monkeypatch, tmp_path):
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 3.0)
    assert precision.resolve_bf16(None, fp16=True) is False


def test_the_probe_runs_once_per_cpu_and_is_cached(monkeypatch, tmp_path):
    # A real measurement, written to the cache under this CPU's key; a new process reads it instead of measuring
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(precision, "_speedups", {})
    calls = []
    measure = precision.measure_cpu_bf16_speedup
    monkeypatch.setattr(precision, "measure_cpu_bf16_speedup", lambda: calls.append(1) or measure())
    speedup = precision.cpu_bf16_speedup()
    assert math.isfinite(speedup) and speedup > 0 and calls == [1]
    cached = json.loads((tmp_path / "trl_topr" / precision.SPEEDUP_CACHE_FILE).read_text())
    key = precision._speedup_key()
    assert cached == {key: speedup} and precision.cpu_name() in key and torch.__version__ in key
    monkeypatch.setattr(precision, "_speedups", {})  # as a new process
    assert precision.cpu_bf16_speedup() == speedup and calls == [1]


def test_emulated_bf16_is_measured_slow(tmp_path):
    # torch and oneDNN held to AVX2, as on a CPU without AVX512: bf16 is emulated, and the real probe says so
    code = (
        "from trl_topr.precision import cpu_bf16_speedup, bf16_is_faster; "
        "print(cpu_bf16_speedup(), bf16_is_faster('cpu'))"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    speedup, chosen = result.stdout.split()[-2:]
    assert float(speedup) < 0.5 and chosen == "False"
    (key,) = json.loads((tmp_path / "trl_topr" / "cpu_bf16_speedup.json").read_text())
    assert "AVX2" in key  # a held-back kernel set is its own entry: it never reuses the full CPU's measurement


def autocast_seen(model):
    """Record whether each forward of `model` runs under CPU bf16 autocast."""
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.is_autocast_enabled("cpu")))
    return seen


def test_sampling_and_evaluation_follow_the_rule(native, tiny_model_path, tmp_path):
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        AutoTokenizer.from_pretrained(tiny_model_path),
    )
    seen = autocast_seen(model)
    generate_completions(
        model,
        tokenizer,
        ["What is 2 + 3?"],
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=3),
    )
    assert seen and set(seen) == {native}

    seen.clear()
    prompts = Dataset.from_dict({"prompt": ["What is 2 + 3?"], "answer": ["5"]})
    evaluate_policy(
        model,
        tokenizer,
        prompts,
        lambda completions, **kw: [0.0] * len(completions),
        lambda text: None,
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=3, seed=0),
    )
    assert seen and set(seen) == {native}

    # sampling follows its configuration, which follows the rule unless told otherwise
    for bf16 in (None, not native):
        seen.clear()
        args = make_args(tmp_path, bf16=bf16)
        sample_completions(
            model,
            prompts,
            lambda completions, **kw: [1.0] * len(completions),
            processing_class=tokenizer,
            args=args,
            progress=False,
            sampling=SamplingSettings(num_samples=2, max_new_tokens=3, seed=0),
        )
        generation = seen[: len(seen) - 1]  # the last forward is the behavior precompute, in the training precision
        assert set(generation) == {args.bf16} and seen[-1] is args.bf16


class RecordsFlushing(TrainerCallback):
    """Whether the training thread flushed denormal floats to zero, at the end of every step."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(precision.flushing_denormals())


def test_training_on_a_cpu_flushes_denormals_and_leaves_them_as_they_were_after(tiny_model_path, tmp_path):
    # Negatives the policy has moved far away from (mu = 1, pi tiny: weights near 0) can fill the backward pass with
    # denormal floats, many times slower on a CPU; every TOPR trainer trains with them flushed to zero
    from test_online import digit_reward, grpo_args, prompts

    from trl_topr import TOPRAsyncGRPOTrainer, TOPRGRPOTrainer, TOPRTrainer

    assert not precision.flushing_denormals()
    stale = standard_dataset(8, behavior_logps=[0.0] * 8)
    record = RecordsFlushing()
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "topr"), train_dataset=stale, callbacks=[record])
    trainer.train()
    assert record.seen == [True, True] and math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert not precision.flushing_denormals()
    online = RecordsFlushing()
    args = grpo_args(tmp_path / "grpo", max_steps=1)
    TOPRGRPOTrainer(tiny_model_path, digit_reward, args=args, train_dataset=prompts(), callbacks=[online]).train()
    assert online.seen == [True] and not precision.flushing_denormals()
    assert issubclass(TOPRAsyncGRPOTrainer, precision.FlushesDenormals)  # its training needs a sampling server


def test_denormals_are_flushed_on_a_cpu_only_and_left_on_where_they_were():
    with precision.denormals_flushed("cuda"):  # GPUs compute on denormals at full speed
        assert not precision.flushing_denormals()
    with precision.denormals_flushed(torch.device("cpu")):
        assert precision.flushing_denormals() and torch.tensor([1e-39]) * 1.0 == 0.0
    assert not precision.flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        with precision.denormals_flushed("cpu"):
            pass
        assert precision.flushing_denormals()  # the caller's choice stands
    finally:
        torch.set_flush_denormal(False)
