"""TOPRAsyncGRPOTrainer: TOPR as the loss of TRL's asynchronous GRPO trainer, on a tiny Llama, on CPU and offline."""

import dataclasses
import math
import queue
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICES, launch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_topr import TOPRArguments, baseline_for_positive_fraction, topr_loss
from trl_topr.async_grpo import (
    MODEL_VERSION,
    UNBOUNDED_STALENESS,
    AsyncGRPOConfig,
    AsyncGRPOTrainer,
    RolloutSample,
    SamplerRolloutWorker,
    TOPRAsyncGRPOConfig,
    TOPRAsyncGRPOTrainer,
    grpo_advantages,
    per_sample,
    samples_of,
)


def async_args(output_dir, **kwargs) -> TOPRAsyncGRPOConfig:
    defaults = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        learning_rate=1e-2,
        token_budget=0,
        seed=0,
    )
    defaults.update(kwargs)
    return TOPRAsyncGRPOConfig(**defaults)


def has_a(completions, **kwargs):
    """+1 for a completion with the letter a, -1 otherwise."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if "a" in text else -1.0 for text in texts]


def prompts(n: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [f"say {i} then" for i in range(n)]})


class Samples:
    """A rollout buffer: the samples given, in order, then fresh ones without end (TRL's loader reads ahead)."""

    def __init__(self, samples):
        self.samples, self.more = list(samples), 0

    def get(self, block=True, timeout=None):
        if self.samples:
            return self.samples.pop(0)
        self.more += 1
        return made_samples(seed=100 + self.more)[self.more % 4]

    def qsize(self):
        return len(self.samples)


class ListWorker:
    """A custom worker (TRL's protocol): the samples it is given, in order, each `advantage` as the user set it."""

    def __init__(self, samples):
        self.rollout_buffer, self.metrics_queue = Samples(samples), queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def check_health(self, stale_after_s):
        pass

    def update_model_version(self, model_version):
        self.version = model_version


class NoTransfer:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def made_samples(seed: int = 0, version: int = 1) -> list:
    """Two prompts, two completions each (they share their prompt: the trie packs it once), of uneven lengths, with
    behavior log-probs off the policy's by a few tenths per token and advantages of both signs."""
    rng = np.random.default_rng(seed)
    samples = []
    for group, prompt in enumerate(([5, 9, 13, 17, 21], [6, 10, 14])):
        for length, advantage in ((4, 1.0), (6, -1.5)):
            completion = rng.integers(20, 120, length).tolist()
            ids = np.asarray(prompt + completion, dtype=np.int64)
            mask = np.asarray([0] * len(prompt) + [1] * length, dtype=np.int64)
            old = np.where(mask == 1, rng.normal(-5.0, 0.4, len(ids)), 0.0).astype(np.float32)
            samples.append(
                RolloutSample([], [], ids, mask, old, advantage + group * 0.5, version, group, {"reward": advantage})
            )
    return samples


def plain_logps(path: str, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's completion log-probs from a padded forward of the model with its usual attention: (B, T), mask."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    width = max(int(s.completion_mask.sum()) for s in samples)
    logps, mask = torch.zeros(len(samples), width), torch.zeros(len(samples), width, dtype=torch.bool)
    with torch.no_grad():
        for i, sample in enumerate(samples):
            ids = torch.tensor(sample.input_ids)[None]
            scores = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            completion = scores[len(ids[0]) - 1 - int(sample.completion_mask.sum()) :]
            logps[i, : len(completion)], mask[i, : len(completion)] = completion, True
    return logps, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("advantages", ["topr", "worker"])
def test_the_loss_of_a_packed_batch_is_topr_loss_on_its_sequences(tiny_model_path, tmp_path, device, advantages):
    # A custom worker's samples, packed by TRL into one trie: the trainer's loss is `topr_loss` with the ratio at the
    # sequence level on the same sequences, computed from a plain padded forward, with TOPR's baseline over the
    # step's rewards (target 0.5: the c whose effective positive fraction is 0.5, logged) or, turned on, the worker's
    # own advantages; its tree attention (FlashAttention-3 where it loads, else PyTorch's) gives their log-probs; and
    # a loss computed per token (TRL's way) would differ
    samples = made_samples()
    options = {"use_worker_advantages": True} if advantages == "worker" else {"target_positive_fraction": 0.5}
    trainer = TOPRAsyncGRPOTrainer(
        tiny_model_path,
        args=async_args(tmp_path, use_cpu=device == "cpu", **options),
        train_dataset=prompts(),
        rollout_worker=ListWorker(samples),
        weight_transfer=NoTransfer(),
    )
    trainer.current_gradient_accumulation_steps = 1
    (batch,), count = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, trainer.model.device)
    assert count == len(samples)  # the step's samples: what the sequence mean is over
    assert int(batch["input_ids"].shape[1]) < sum(len(s.input_ids) for s in samples)  # the shared prompts: packed
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=count)

    logps, mask = (t.to(trainer.model.device) for t in plain_logps(tiny_model_path, samples))
    selected = batch["token_index"] >= 0
    packed, _ = trainer._forward(trainer.model, batch, batch["token_index"][selected])
    # PyTorch's tree attention: float32 throughout; FlashAttention-3 computes in bf16
    tolerance = {"sdpa": 1e-5 if device == "cpu" else 1e-4, "flash_attention_3": 5e-2}[trainer.tree_attention]
    assert torch.allclose(packed.detach(), logps[mask], atol=tolerance)
    behavior = torch.zeros_like(logps)
    for i, sample in enumerate(samples):
        old = torch.tensor(sample.old_log_probs)[torch.tensor(sample.completion_mask) == 1]
        behavior[i, : len(old)] = old
    if advantages == "worker":
        rewards, c = torch.tensor([s.advantage for s in samples], device=logps.device), 0.0
    else:
        rewards = torch.tensor([s.metrics["reward"] for s in samples], device=logps.device)
        c = baseline_for_positive_fraction(rewards.tolist(), 0.5)
        assert c != 0.0 and not torch.equal(rewards, torch.tensor([s.advantage for s in samples]).to(rewards))
    options = trainer.args.loss_options()
    expected, _ = topr_loss(logps, mask, rewards, behavior, baseline=c, **options)
    assert abs(loss.item() - expected.item()) < tolerance
    per_token, _ = topr_loss(logps, mask, rewards, behavior, baseline=c, **(options | {"ratio_level": "token"}))
    assert abs(per_token.item() - expected.item()) > 1e-3  # the test tells the two apart
    logged = trainer._metrics["train"]
    weights = logged["negative_weight_mean"]
    assert weights and 0 < weights[0][0] / weights[0][1] < 1  # the negatives are tapered: pi/mu < 1 for them
    if advantages == "topr":
        (baseline,), (fraction,) = logged["baseline"], logged["effective_positive_fraction"]
        assert math.isclose(baseline[0] / baseline[1], c, rel_tol=1e-5)
        assert math.isclose(fraction[0] / fraction[1], 0.5, rel_tol=1e-4)


def test_stale_samples_are_kept_by_default_and_a_bound_drops_them(tiny_model_path, tmp_path):
    # Samples drawn 10 versions back: TOPR keeps them (and logs their weights by staleness); with TRL's bound they go
    stale = made_samples(version=-9) + made_samples(seed=1, version=-9)
    kept = TOPRAsyncGRPOTrainer(
        tiny_model_path,
        args=async_args(tmp_path / "kept", max_steps=1),
        train_dataset=prompts(),
        rollout_worker=ListWorker([*stale, *made_samples(seed=2)]),
        weight_transfer=NoTransfer(),
    )
    assert kept.args.max_staleness == UNBOUNDED_STALENESS
    kept.train()
    (entry,) = [e for e in kept.state.log_history if "loss" in e]
    print(sorted(k for k in entry if "stale" in k))
    assert "sample/dropped_stale_total" not in entry and entry["staleness_10/rows"] == 4
    assert 0 < entry["staleness_10/effective_sample_size"] <= 1
    assert {"staleness_10/clamped_fraction", "staleness_10/positive_weight_mean"} <= set(entry)

    bounded = TOPRAsyncGRPOTrainer(
        tiny_model_path,
        args=async_args(tmp_path / "bounded", max_steps=1, max_staleness=4),
        train_dataset=prompts(),
        rollout_worker=ListWorker([*stale, *made_samples(seed=2)]),
        weight_transfer=NoTransfer(),
    )
    bounded.train()
    (entry,) = [e for e in bounded.state.log_history if "loss" in e]
    assert entry["sample/dropped_stale_total"] == 8 and "staleness_10/rows" not in entry


def test_in_process_rollouts_draw_from_the_policy_lag_versions_back(tiny_model_path, tmp_path):
    # The worker over a Sampler: the samples of step s come from the policy of version s - lag (TRL's pipeline batches
    # one step ahead, so they are trained one version later still); rewards centred with TOPR's target
    args = async_args(
        tmp_path,
        max_steps=5,
        in_process_rollouts=True,
        rollout_lag=2,
        target_positive_fraction=0.5,
        learning_rate=1e-2,
    )
    trainer = TOPRAsyncGRPOTrainer(tiny_model_path, has_a, args, prompts())
    worker = trainer.rollout_worker
    assert isinstance(worker, SamplerRolloutWorker) and worker.weight_transfer is trainer.weight_transfer
    trainer.train()
    versions = [e["rollout/version"] for e in trainer.state.log_history if "rollout/version" in e]
    assert versions[:2] == [1.0, 1.0] and versions[-1] == 3.0  # the earliest version, then 2 behind
    staleness = {int(k.split("_")[1].split("/")[0]) for e in trainer.state.log_history for k in e if "/rows" in k}
    assert max(staleness) == 3 and len(worker.snapshots) <= 3
    assert worker.next_prompt == (5 + 1) * 4 // 2  # two prompts a rollout, none twice, one batch read ahead


def test_the_in_process_worker_fills_samples_as_trls_worker_and_topr_reads_a_groups_centred_reward():
    # GRPO's advantage (R - mean) / (std + 1e-8) and the group's std, as TRL's worker records them: what TOPR reads
    # back as R - mean for `group_baseline`; an unscored completion gets advantage 0
    rewards = [1.0, -1.0, -1.0, -1.0, 2.0, math.nan]
    advantages, spreads = grpo_advantages(rewards, 2)
    assert advantages[:4] == pytest.approx([1.0, -1.0, 0.0, 0.0]) and spreads[:4] == [1.0, 1.0, 0.0, 0.0]
    assert advantages[4:] == [0.0, 0.0]
    centred = [
        per_sample({"advantage": a, "metrics": {MODEL_VERSION: 3.0, "reward": r, "reward_std": s}})[2]
        for a, r, s in zip(advantages, rewards, spreads)
    ]
    assert centred[:5] == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="no `reward` among its `metrics`.*use_worker_advantages"):
        per_sample({"advantage": 1.0, "metrics": {MODEL_VERSION: 3.0}})


def test_the_configuration_takes_topr_options_once_and_checks_them(tmp_path):
    args = async_args(tmp_path, loss_type="tis", max_staleness=3)
    assert isinstance(args, TOPRArguments) and isinstance(args, AsyncGRPOConfig)
    assert args.loss_options()["loss_type"] == "tis" and args.max_staleness == 3
    assert async_args(tmp_path).max_inflight_tasks == 4 * 4  # TRL's default staleness sizes the generations in flight
    with pytest.raises(ValueError, match="baseline"):
        async_args(tmp_path, baseline=0.5, target_positive_fraction=0.5)
    with pytest.raises(ValueError, match="rollout_lag"):
        async_args(tmp_path, rollout_lag=-1)
    with pytest.raises(TypeError, match="TOPRAsyncGRPOConfig"):
        TOPRAsyncGRPOTrainer("model", args=AsyncGRPOConfig(str(tmp_path), use_cpu=True))


def test_construction_leaves_trls_peak_flops_probe_as_it_was(tiny_model_path, tmp_path):
    module = sys.modules[AsyncGRPOTrainer.__module__]
    probe = module.get_peak_flops_per_device
    trainer = TOPRAsyncGRPOTrainer(
        tiny_model_path,
        args=async_args(tmp_path),
        train_dataset=prompts(),
        rollout_worker=ListWorker([]),
        weight_transfer=NoTransfer(),
    )
    assert module.get_peak_flops_per_device is probe and trainer._peak_flops_per_device is None


def one_async_sgd_step(model_path, output_dir, normalization, **batching):
    # One optimizer step over the same 4 samples (`made_samples`), batched as told: plain SGD, the update is the
    # gradient itself; the number of samples in each micro-batch
    args = async_args(
        output_dir, max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, loss_normalization=normalization
    )
    args = dataclasses.replace(args, **batching)
    trainer = TOPRAsyncGRPOTrainer(
        model_path,
        args=args,
        train_dataset=prompts(),
        rollout_worker=ListWorker(made_samples()),
        weight_transfer=NoTransfer(),
    )
    counts = []
    original = trainer.get_batch_samples

    def counted(*arguments):
        batches, count = original(*arguments)
        counts.extend(len(samples_of(batch)) for batch in batches)
        return batches, count

    trainer.get_batch_samples = counted
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    after = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    assert max((after[n] - p).abs().max().item() for n, p in initial.items()) > 1e-3  # large enough to tell scales
    return after, counts


@pytest.mark.parametrize("normalization", ["sequence_length", "token_mean", "sum"])
def test_a_token_budgets_uneven_micro_batches_update_like_one_batch(tiny_model_path, tmp_path, normalization):
    # The same 4 samples as one micro-batch of 4, or packed by TRL's token budget (14 tokens a row) into micro-batches
    # of 1, 1 and 2 samples: each sample weighs the same in the update
    whole, counts = one_async_sgd_step(tiny_model_path, tmp_path / "one", normalization, per_device_train_batch_size=4)
    assert counts == [4]
    budget, counts = one_async_sgd_step(
        tiny_model_path, tmp_path / "budget", normalization, token_budget=14, gradient_accumulation_steps=3
    )
    assert counts == [1, 1, 2]
    for name, value in whole.items():
        torch.testing.assert_close(budget[name], value, rtol=1e-4, atol=1e-6, msg=name)


ASYNC_WORKER = textwrap.dedent(
    """
    import os
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import end_processes
    from safetensors.torch import save_file
    from test_async import one_async_sgd_step

    def main(model_path, output_dir, normalization):
        after, counts = one_async_sgd_step(model_path, output_dir, normalization, per_device_train_batch_size=2)
        if os.environ["RANK"] == "0":
            save_file({{name: value.contiguous() for name, value in after.items()}}, output_dir + "/after.safetensors")
        print("samples in this process's micro-batches:", counts, flush=True)

    main(*sys.argv[1:4])
    end_processes()
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("normalization", ["sequence_length", "token_mean"])
def test_two_processes_update_like_one_batch(tiny_model_path, tmp_path, normalization):
    # The same 4 samples as one process's micro-batch of 4, or split over 2 processes (2 each, a group a process):
    # R - c is the step's over both processes, and each sample weighs the same in the update
    script = tmp_path / "worker.py"
    script.write_text(ASYNC_WORKER.format(tests=str(Path(__file__).parent)))
    output_dir = tmp_path / "ddp"
    output_dir.mkdir()
    result = launch(script, tiny_model_path, output_dir, normalization)
    assert result.stdout.count("samples in this process's micro-batches: [2]") == 2, result.stdout[-3000:]
    distributed = load_file(str(output_dir / "after.safetensors"))
    whole, counts = one_async_sgd_step(tiny_model_path, tmp_path / "one", normalization, per_device_train_batch_size=4)
    assert counts == [4]
    for name, value in whole.items():
        torch.testing.assert_close(distributed[name], value, rtol=1e-4, atol=1e-6, msg=name)
