"""TOPRTrainer on a tiny Llama built from a config: data formats, behavior log-probs, PEFT, QLoRA, baselines,
resume."""

import math
import os
import shutil

import pytest
import torch
from conftest import DEVICES, build_tiny_model, conversational_dataset, make_args, standard_dataset
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
from trl.trainer.utils import add_fused_lm_head

from trl_topr import TOPRDataError, TOPRTrainer


def first_log(trainer, key):
    return next(entry[key] for entry in trainer.state.log_history if key in entry)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def precomputed_behavior(tiny_model_path, tmp_path, dataset):
    """Per-token behavior log-probs as the trainer computes them for `dataset`."""
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "mu"), train_dataset=dataset)
    return trainer.train_dataset["behavior_logps"]


@pytest.mark.parametrize("make_dataset", [standard_dataset, conversational_dataset])
def test_trains_and_precomputes_behavior_logps_on_policy(tiny_model_path, tmp_path, make_dataset):
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path), train_dataset=make_dataset())
    behavior = trainer.train_dataset["behavior_logps"]
    labels = trainer.train_dataset["labels"]
    # one value per completion token, each a log-probability
    assert [len(b) for b in behavior] == [sum(label != -100 for label in row) for row in labels]
    assert all(v < 0 for row in behavior for v in row)
    before = weights(trainer.model)
    trainer.train()
    # step 0 is on-policy: pi = mu exactly, so the ratio is 1
    assert first_log(trainer, "log_ratio_mean") == pytest.approx(0.0, abs=1e-5)
    assert first_log(trainer, "negative_weight_mean") == pytest.approx(1.0, abs=1e-5)
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    for key in (
        "reward",
        "positive_fraction",
        "effective_positive_fraction",
        "baseline",
        "negative_weight_mean",
        "negative_tapered_fraction",
        "log_ratio_min",
        "log_ratio_max",
        "completion_length",
        "entropy",
    ):
        assert key in trainer.state.log_history[0], key


def test_given_per_sequence_behavior_logps_set_the_ratio(tiny_model_path, tmp_path):
    per_token = precomputed_behavior(tiny_model_path, tmp_path, standard_dataset())
    # mu is e^2 times more likely than pi on every sequence: log pi/mu = -2 at step 0.
    dataset = standard_dataset(behavior_logps=[sum(row) + 2.0 for row in per_token])
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    trainer.train()
    assert first_log(trainer, "log_ratio_mean") == pytest.approx(-2.0, abs=1e-4)
    assert first_log(trainer, "negative_weight_mean") == pytest.approx(math.exp(-2.0), rel=1e-3)
    assert first_log(trainer, "negative_tapered_fraction") == 1.0


def test_given_per_token_behavior_logps_and_token_ratio(tiny_model_path, tmp_path):
    per_token = precomputed_behavior(tiny_model_path, tmp_path, conversational_dataset())
    dataset = conversational_dataset().add_column("behavior_logps", [[v - 0.5 for v in row] for row in per_token])
    args = make_args(tmp_path, max_steps=1, ratio_level="token")
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=dataset)
    trainer.train()
    assert first_log(trainer, "log_ratio_mean") == pytest.approx(0.5, abs=1e-4)  # per token
    assert first_log(trainer, "negative_weight_mean") == pytest.approx(1.0)  # e^0.5 capped at 1


def test_token_ratio_refuses_per_sequence_behavior(tiny_model_path, tmp_path):
    dataset = standard_dataset(behavior_logps=[-10.0] * 8)
    with pytest.raises(ValueError, match="per-token"):
        TOPRTrainer(tiny_model_path, args=make_args(tmp_path, ratio_level="token"), train_dataset=dataset)


def test_label_column_maps_to_plus_minus_one(tiny_model_path, tmp_path):
    dataset = standard_dataset().remove_columns("reward").add_column("label", [True, False] * 4)
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    assert trainer.train_dataset["reward"] == [1.0, -1.0] * 4
    trainer.train()
    assert first_log(trainer, "positive_fraction") == pytest.approx(0.5)


def test_custom_column_names(tiny_model_path, tmp_path):
    dataset = standard_dataset().rename_columns({"prompt": "question", "completion": "answer", "reward": "score"})
    args = make_args(
        tmp_path, max_steps=1, prompt_column="question", completion_column="answer", reward_column="score"
    )
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=dataset)
    trainer.train()
    assert trainer.train_dataset["reward"] == standard_dataset()["reward"]


def test_target_positive_fraction_derives_the_baseline(tiny_model_path, tmp_path):
    # 2 positives in 8: p = 0.25; target 0.5 -> c = (p - t) / (p + t - 2 p t) = -0.5
    dataset = standard_dataset().remove_columns("reward").add_column("reward", [1.0, -1.0, -1.0, -1.0] * 2)
    args = make_args(tmp_path, max_steps=2, target_positive_fraction=0.5, per_device_train_batch_size=8)
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=dataset)
    assert trainer.baseline == pytest.approx(-0.5)
    trainer.train()
    assert first_log(trainer, "baseline") == pytest.approx(-0.5)
    assert first_log(trainer, "effective_positive_fraction") == pytest.approx(0.5)


def test_explicit_baseline_is_used(tiny_model_path, tmp_path):
    trainer = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path, max_steps=1, baseline=0.25), train_dataset=standard_dataset()
    )
    trainer.train()
    assert first_log(trainer, "baseline") == 0.25


def test_lora_trains_only_the_adapter_and_saves_it_with_a_card(tiny_model_path, tmp_path):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path), train_dataset=standard_dataset(), peft_config=peft_config
    )
    assert isinstance(trainer.model, PeftModel)
    before = weights(trainer.model)
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    trainer.save_model()
    files = os.listdir(tmp_path)
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert "model.safetensors" not in files
    card = (tmp_path / "README.md").read_text()
    assert "TOPR" in card and "2503.14286" in card and "- topr" in card and "- trl" in card


def test_accepts_model_objects_and_peft_models(tiny_model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trainer = TOPRTrainer(
        model, args=make_args(tmp_path, max_steps=1), train_dataset=standard_dataset(), processing_class=tokenizer
    )
    trainer.train()
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"),
    )
    trainer = TOPRTrainer(
        peft_model, args=make_args(tmp_path, max_steps=1), train_dataset=standard_dataset(), processing_class=tokenizer
    )
    trainer.train()
    assert math.isfinite(first_log(trainer, "loss"))


def test_model_init_kwargs_are_honoured(tiny_model_path, tmp_path):
    args = make_args(tmp_path, max_steps=1, model_init_kwargs={"dtype": "bfloat16"})
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset())
    assert trainer.model.dtype == torch.bfloat16
    trainer.train()
    assert math.isfinite(first_log(trainer, "loss"))


def nf4_config():
    # float32 compute, the same on CPU and CUDA: the tolerances below then hold on both.
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_4bit_trains_and_its_saved_adapter_reloads(tmp_path, device):
    # bitsandbytes quantizes in blocks of 64 input features: the model needs hidden sizes of at least 64.
    model_path = build_tiny_model(str(tmp_path / "model"), hidden_size=64)
    peft_config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], task_type="CAUSAL_LM"
    )
    args = make_args(tmp_path / "out", max_steps=3, learning_rate=1e-2, use_cpu=device == "cpu")
    trainer = TOPRTrainer(
        model_path,
        args=args,
        train_dataset=standard_dataset(),
        peft_config=peft_config,
        quantization_config=nf4_config(),
    )
    assert trainer.model.get_base_model().is_loaded_in_4bit
    assert trainer.model.device.type == device
    before = weights(trainer.model)
    trainer.train()
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    assert first_log(trainer, "log_ratio_mean") == pytest.approx(0.0, abs=1e-4)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)

    # The saved adapter, on a freshly quantized base, is the trained model.
    trainer.save_model()
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "out"))
    base = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=nf4_config(), device_map=device)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "out")).eval()
    trained = {n.replace(".default", ""): p for n, p in trainer.model.named_parameters() if "lora_" in n}
    saved = {n.replace(".default", ""): p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert set(saved) == set(trained)
    for name, p in trained.items():
        torch.testing.assert_close(saved[name].to(p.dtype), p.detach(), rtol=0, atol=0, msg=name)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = trainer.model.eval()(**inputs).logits.float()
        error = (reloaded(**inputs).logits.float() - expected).abs().max()
        with reloaded.disable_adapter():
            adapter_effect = (reloaded(**inputs).logits.float() - expected).abs().max()
    # PEFT may compute a bf16-saved adapter in float32: equal up to the adapter's rounding, far below its effect
    assert error < 1e-2 and adapter_effect > 10 * error, (error.item(), adapter_effect.item())


def test_eval_dataset_reports_topr_loss_and_metrics(tiny_model_path, tmp_path):
    args = make_args(tmp_path, max_steps=1, eval_strategy="no")
    trainer = TOPRTrainer(
        tiny_model_path, args=args, train_dataset=standard_dataset(), eval_dataset=conversational_dataset(4)
    )
    assert "behavior_logps" in trainer.eval_dataset.column_names
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert metrics["eval_log_ratio_mean"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["eval_positive_fraction"] == pytest.approx(0.5)


class StopAt(TrainerCallback):
    """Interrupts training after `step` (its checkpoint saved), as a crash would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_resume_from_checkpoint_continues_where_it_stopped(tiny_model_path, tmp_path):
    def trainer(output_dir, callbacks=None):
        args = make_args(output_dir, max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=2)
        return TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset(), callbacks=callbacks)

    full = trainer(tmp_path / "full")
    full.train()
    trainer(tmp_path / "interrupted", callbacks=[StopAt(2)]).train()
    assert os.path.isdir(tmp_path / "interrupted" / "checkpoint-2")
    resumed = trainer(tmp_path / "interrupted")
    resumed.train(resume_from_checkpoint=str(tmp_path / "interrupted" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    losses = [(e["step"], e["loss"]) for e in resumed.state.log_history if "loss" in e]
    expected = [(e["step"], e["loss"]) for e in full.state.log_history if "loss" in e]
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert [loss for _, loss in losses] == pytest.approx([loss for _, loss in expected], abs=1e-6)
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_truncation_cuts_per_token_behavior_with_the_completion(tiny_model_path, tmp_path):
    per_token = precomputed_behavior(tiny_model_path, tmp_path, standard_dataset())
    dataset = standard_dataset(behavior_logps=per_token)
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path, max_length=20), train_dataset=dataset)
    for row, full in zip(trainer.train_dataset, per_token):
        assert len(row["input_ids"]) <= 20
        kept = sum(label != -100 for label in row["labels"])
        assert row["behavior_logps"] == full[:kept]
    trainer.train()
    assert first_log(trainer, "log_ratio_mean") == pytest.approx(0.0, abs=1e-5)


def test_dataset_from_files_caches_behavior_logps(tiny_model_path, tmp_path):
    # A dataset backed by files gets its precomputed behavior log-probs cached next to it, keyed by data and weights.
    path = tmp_path / "data.jsonl"
    standard_dataset().to_json(str(path))
    dataset = Dataset.from_json(str(path), cache_dir=str(tmp_path / "cache"))
    first = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "a"), train_dataset=dataset)
    second = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "b"), train_dataset=dataset)
    assert first.train_dataset["behavior_logps"] == second.train_dataset["behavior_logps"]
    folder = os.path.dirname(dataset.cache_files[0]["filename"])
    cached = [Dataset.from_file(os.path.join(folder, f)) for f in os.listdir(folder) if f.startswith("cache-")]
    behavior_files = [d for d in cached if d.column_names == ["behavior_logps"]]
    assert len(behavior_files) == 1  # written once, by the first trainer, read by the second
    assert list(behavior_files[0]["behavior_logps"]) == list(first.train_dataset["behavior_logps"])


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_gradients_match_the_dequantized_model(tmp_path, device):
    # A 4-bit backward (bitsandbytes' CPU one is not checked upstream) against the float model: compare the LoRA
    # gradients of one TOPR step with those of a float model holding the same (dequantized) weights and adapter.
    import bitsandbytes as bnb

    model_path = build_tiny_model(str(tmp_path / "model"), hidden_size=64)
    peft_config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM", init_lora_weights=False
    )  # random B, so every LoRA matrix gets a gradient
    trainer = TOPRTrainer(
        model_path,
        args=make_args(tmp_path / "out", use_cpu=device == "cpu"),
        train_dataset=standard_dataset(),
        peft_config=peft_config,
        quantization_config=nf4_config(),
    )
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))

    def lora_gradients(model):
        model.zero_grad()
        trainer.compute_loss(model, dict(batch)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}

    quantized = lora_gradients(trainer.model)

    dequantized = AutoModelForCausalLM.from_pretrained(model_path)
    state = {}
    for name, module in trainer.model.get_base_model().named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            state[name.replace(".base_layer", "") + ".weight"] = weight.float()
    missing = dequantized.load_state_dict(state, strict=False).unexpected_keys
    assert not missing and state
    dequantized = get_peft_model(dequantized.to(device), peft_config)
    dequantized.load_state_dict({n: p for n, p in trainer.model.state_dict().items() if "lora_" in n}, strict=False)
    add_fused_lm_head(dequantized.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    reference = lora_gradients(dequantized)  # the same loss path: the trainer's compute_loss, on the float model

    assert set(quantized) == set(reference)
    for name in quantized:
        # TRL keeps QLoRA adapters in bf16 (~3 significant digits): a broken 4-bit backward gives errors near 1 or 0
        # grads
        error = (quantized[name].float() - reference[name]).norm() / reference[name].norm()
        assert quantized[name].abs().sum() > 0 and error < 5e-2, (name, error.item())


def test_precompute_runs_in_the_training_precision(tiny_model_path, tmp_path):
    # bf16 autocast in training: mu computed in fp32 would show a spurious log-ratio at step 0.
    trainer = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path, max_steps=1, bf16=True), train_dataset=standard_dataset()
    )
    trainer.train()
    assert abs(first_log(trainer, "log_ratio_min")) < 1e-3 and abs(first_log(trainer, "log_ratio_max")) < 1e-3
    assert first_log(trainer, "negative_tapered_fraction") == 0.0


def test_plain_training_arguments_become_a_topr_config(tiny_model_path, tmp_path):
    from transformers import TrainingArguments

    from trl_topr import TOPRConfig

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=4,
        save_strategy="no",
    )
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset())
    assert isinstance(trainer.args, TOPRConfig) and trainer.args.loss_type == "topr"
    assert math.isfinite(trainer.train().training_loss)


def test_evaluate_prepares_a_new_raw_dataset(tiny_model_path, tmp_path):
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path, max_steps=2), train_dataset=standard_dataset())
    trainer.train()
    raw = conversational_dataset(4).rename_column("reward", "score")
    trainer.args.reward_column = "score"
    metrics = trainer.evaluate(raw)
    assert math.isfinite(metrics["eval_loss"])
    assert metrics["eval_log_ratio_mean"] == pytest.approx(0.0, abs=1e-5)  # mu = the current model
    with pytest.raises(TOPRDataError, match="column 'score', row 0"):
        trainer.evaluate(raw.remove_columns("score").add_column("score", [math.nan] * 4))


def test_evaluate_after_training_does_not_reuse_the_initial_weights_cache(tiny_model_path, tmp_path):
    # A dataset read from files is cached next to its files, keyed by the weights: after training, the cache of the
    # initial weights must not be reused for the same file.
    path = tmp_path / "data.jsonl"
    standard_dataset().to_json(str(path))
    trainer = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path / "out", max_steps=3), train_dataset=Dataset.from_json(str(path))
    )
    assert Dataset.from_json(str(path)).cache_files  # the caching path is the one exercised
    trainer.train()
    metrics = trainer.evaluate(Dataset.from_json(str(path)))
    for name in ("eval_log_ratio_mean", "eval_log_ratio_min", "eval_log_ratio_max"):
        assert metrics[name] == pytest.approx(0.0, abs=1e-5)  # mu = the trained model


def test_resume_true_skips_a_half_written_checkpoint(tiny_model_path, tmp_path):
    def trainer(callbacks=None):
        args = make_args(tmp_path, max_steps=6, save_strategy="steps", save_steps=2, per_device_train_batch_size=2)
        return TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset(), callbacks=callbacks)

    trainer(callbacks=[StopAt(4)]).train()
    (tmp_path / "checkpoint-4" / "trainer_state.json").unlink()  # killed while writing checkpoint-4
    ran = []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ran.append(state.global_step)

    resumed = trainer(callbacks=[Count()])
    resumed.train(resume_from_checkpoint=True)
    assert ran == [3, 4, 5, 6]  # resumed after checkpoint-2: neither from the partial checkpoint-4 nor from scratch
    (tmp_path / "checkpoint-2").rename(tmp_path / "checkpoint-x")
    for folder in tmp_path.glob("checkpoint-*"):
        shutil.rmtree(folder)
    with pytest.raises(ValueError, match="No complete checkpoint"):
        trainer().train(resume_from_checkpoint=True)
