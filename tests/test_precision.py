"""The precision rule: bf16 where the hardware computes it natively, float32 elsewhere, an explicit choice always
respected. Both CPU branches are tested by faking the capability torch reports."""

import logging

import pytest
import torch
from conftest import make_args
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_topr.precision as precision
from trl_topr import TOPRConfig, evaluate_policy, sample_completions
from trl_topr.online import TOPRGRPOConfig
from trl_topr.sampling import generate_completions


@pytest.fixture(params=[True, False], ids=["native-bf16-cpu", "emulated-bf16-cpu"])
def native(request, monkeypatch):
    """Fake a CPU with AMX (native bf16) or without it (AVX2 / AVX512 only), and forget earlier warnings."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: request.param)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(precision, "_warned", set())
    return request.param


def test_the_cpu_capability_decides(native):
    assert precision.has_native_bf16("cpu") is native
    assert precision.has_native_bf16() is native  # no accelerator here: the training device is the CPU


def test_avx512_bf16_without_amx_trains_in_float32(monkeypatch, tmp_path):
    # Measured on such a CPU: bf16 matmuls at half the float32 speed, the embedded default 1.4x slower in bf16.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert precision.has_native_bf16("cpu") is False
    assert TOPRConfig(output_dir=str(tmp_path), report_to="none").bf16 is False


@pytest.mark.parametrize("config_class", [TOPRConfig, TOPRGRPOConfig])
def test_unset_bf16_follows_the_hardware(native, config_class, tmp_path):
    args = config_class(output_dir=str(tmp_path), report_to="none")
    assert args.bf16 is native
    assert args.use_cpu  # no accelerator: set, so that transformers accepts bf16 on the CPU
    assert args.fp16 is False


@pytest.mark.parametrize("explicit", [True, False])
def test_an_explicit_choice_is_respected(native, explicit, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_topr.precision"):
        for _ in range(2):  # the warning is given once
            args = TOPRConfig(output_dir=str(tmp_path), report_to="none", bf16=explicit)
            assert args.bf16 is explicit
    warnings = [r for r in caplog.records if r.name == "trl_topr.precision"]
    if explicit and not native:
        assert len(warnings) == 1
        assert "slower than float32" in warnings[0].message and "--bf16 false" in warnings[0].message
        assert "benchmarks/precision.py" in warnings[0].message  # where to measure it on this machine
    else:
        assert not warnings


def test_fp16_is_not_overridden(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert precision.resolve_bf16(None, fp16=True) is False


def autocast_seen(model):
    """Record whether each forward of `model` runs under CPU bf16 autocast."""
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.is_autocast_enabled("cpu")))
    return seen


def test_sampling_and_evaluation_follow_the_rule(native, tiny_model_path, tmp_path):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(
        tiny_model_path)
    seen = autocast_seen(model)
    generate_completions(model, tokenizer, ["What is 2 + 3?"], num_samples=2, max_new_tokens=3, progress=False)
    assert seen and set(seen) == {native}

    seen.clear()
    prompts = Dataset.from_dict({"prompt": ["What is 2 + 3?"], "answer": ["5"]})
    evaluate_policy(model, tokenizer, prompts, lambda completions, **kw: [0.0] * len(completions), lambda text: None,
                    num_samples=2, max_new_tokens=3, progress=False)
    assert seen and set(seen) == {native}

    # sampling follows its configuration, which follows the rule unless told otherwise
    for bf16 in (None, not native):
        seen.clear()
        args = make_args(tmp_path, bf16=bf16)
        sample_completions(model, prompts, lambda completions, **kw: [1.0] * len(completions),
                           processing_class=tokenizer, num_samples=2, max_new_tokens=3, args=args, progress=False)
        generation = seen[: len(seen) - 1]  # the last forward is the behavior precompute, in the training precision
        assert set(generation) == {args.bf16} and seen[-1] is args.bf16
