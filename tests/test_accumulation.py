"""One update, however its batch is split: micro-batches x accumulation steps x processes give the same weights, and
logged metrics are the exact values over the batch (weighted by their counts), for the offline and online trainers."""

import textwrap
from pathlib import Path

import pytest
import torch
from conftest import launch, make_args, standard_dataset
from datasets import Dataset
from safetensors.torch import load_file

from trl_topr import TOPRTrainer
from trl_topr.loss import LOSS_NORMALIZATIONS
from trl_topr.online import TOPRGRPOConfig, TOPRGRPOTrainer


def uneven_dataset() -> Dataset:
    # 8 rows whose completions have 1 to 4 times as many tokens: micro-batches differ in token count.
    dataset = standard_dataset(8)
    completions = [c + " The answer is 3." * (i % 4) for i, c in enumerate(dataset["completion"])]
    return dataset.remove_columns("completion").add_column("completion", completions)


def one_sgd_step(model_path, output_dir, normalization, batch_size, accumulation):
    # Plain SGD without clipping: the update is the gradient itself, so any error in its scale shows.
    args = make_args(
        output_dir,
        max_steps=1,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        optim="sgd",
        learning_rate=1.0,
        max_grad_norm=0.0,
        loss_normalization=normalization,
    )
    trainer = TOPRTrainer(model_path, args=args, train_dataset=uneven_dataset())
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}, trainer


@pytest.mark.parametrize("normalization", LOSS_NORMALIZATIONS)
@pytest.mark.parametrize("batch_size, accumulation", [(2, 4), (3, 3)], ids=["even", "uneven"])
def test_accumulated_micro_batches_update_like_one_batch(
    tiny_model_path, tmp_path, normalization, batch_size, accumulation
):
    # even: 4 micro-batches of 2 rows; uneven: micro-batches of 3, 3 and 2 rows, whose rows weigh as much as the others
    whole, _ = one_sgd_step(tiny_model_path, tmp_path / "8x1", normalization, 8, 1)
    split, _ = one_sgd_step(tiny_model_path, tmp_path / "split", normalization, batch_size, accumulation)
    initial = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "init"), train_dataset=uneven_dataset()).model
    moved = max((whole[n] - p).abs().max().item() for n, p in initial.named_parameters())
    assert moved > 1e-3  # the step is large enough for a wrong scale to show
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_logged_metrics_are_exact_over_accumulated_micro_batches(tiny_model_path, tmp_path):
    # Micro-batches of 2 rows hold different numbers of negatives: the logged negative weight and effective positive
    # fraction are the values over all 8 rows, as with one batch of 8.
    _, whole = one_sgd_step(tiny_model_path, tmp_path / "8x1", "sequence_length", 8, 1)
    _, split = one_sgd_step(tiny_model_path, tmp_path / "2x4", "sequence_length", 2, 4)
    for key in (
        "reward",
        "positive_fraction",
        "effective_positive_fraction",
        "negative_weight_mean",
        "completion_length",
        "entropy",
        "log_ratio_mean",
        "log_ratio_min",
        "log_ratio_max",
    ):
        assert split.state.log_history[0][key] == pytest.approx(whole.state.log_history[0][key], rel=1e-5, abs=1e-6)


WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import end_processes
    from test_accumulation import one_sgd_step

    def main(model_path, output_dir, normalization):
        _, trainer = one_sgd_step(model_path, output_dir, normalization, 2, 2)  # 2 processes x 2 x 2 = 8 rows
        trainer.save_model(output_dir)

    main(*sys.argv[1:4])
    end_processes()
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("normalization", ["token_mean", "sequence_length"])
def test_two_processes_update_like_one_batch(tiny_model_path, tmp_path, normalization):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    output_dir = tmp_path / "ddp"
    launch(script, tiny_model_path, output_dir, normalization)
    distributed = load_file(str(output_dir / "model.safetensors"))
    whole, _ = one_sgd_step(tiny_model_path, tmp_path / "8x1", normalization, 8, 1)
    for name, value in whole.items():
        torch.testing.assert_close(distributed[name], value, rtol=1e-4, atol=1e-6, msg=name)


def varied_reward(completions, **kwargs):
    """Rewards of different magnitudes and signs, recorded so the test knows every value the trainer saw."""
    values = [[3.0, -1.0, -1.0, -1.0, 1.0, 0.5, -2.0, 1.0][i % 8] for i in range(len(completions))]
    varied_reward.seen.extend(values)
    return values


def test_online_metrics_are_weighted_by_their_counts(tiny_model_path, tmp_path):
    # One optimizer step over a generation batch of 8 completions split into 2 micro-batches: the logged effective
    # positive fraction is the one of the 8 rewards, not the mean of the two micro-batches' fractions.
    varied_reward.seen = []
    args = TOPRGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        activation_checkpointing=False,
        learning_rate=1e-3,
        seed=1,
    )
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(8)]})
    trainer = TOPRGRPOTrainer(tiny_model_path, varied_reward, args=args, train_dataset=prompts)
    trainer.train()
    rewards = torch.tensor(varied_reward.seen)
    assert len(rewards) == 8
    expected = (rewards.clamp(min=0).sum() / rewards.abs().sum()).item()
    logged = trainer.state.log_history[0]
    assert logged["effective_positive_fraction"] == pytest.approx(expected, rel=1e-6)
    assert logged["positive_fraction"] == pytest.approx((rewards >= 0).float().mean().item(), rel=1e-6)


def one_online_sgd_step(model_path, output_dir, normalization, batch_size, accumulation):
    # One optimizer step of the online trainer over one generation batch of 8 completions (2 prompts, 4 each),
    # `accumulation` micro-batches of `batch_size`: plain SGD, so the update is the gradient itself
    args = TOPRGRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        num_generations=4,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_completion_length=8,
        max_steps=1,
        save_strategy="no",
        activation_checkpointing=False,
        optim="sgd",
        learning_rate=1.0,
        max_grad_norm=0.0,
        loss_normalization=normalization,
        seed=1,
    )
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(8)]})
    varied_reward.seen = []
    trainer = TOPRGRPOTrainer(model_path, varied_reward, args=args, train_dataset=prompts)
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}, list(varied_reward.seen)


@pytest.mark.parametrize("normalization", LOSS_NORMALIZATIONS)
def test_online_micro_batches_update_like_one_batch(tiny_model_path, tmp_path, normalization):
    # the same 8 completions (same seed, one generation batch), trained as one micro-batch of 8 or two of 4
    whole, seen_whole = one_online_sgd_step(tiny_model_path, tmp_path / "8x1", normalization, 8, 1)
    split, seen_split = one_online_sgd_step(tiny_model_path, tmp_path / "4x2", normalization, 4, 2)
    assert seen_whole == seen_split and len(seen_whole) == 8
    initial = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "init"), train_dataset=uneven_dataset()).model
    moved = max((whole[n] - p).abs().max().item() for n, p in initial.named_parameters())
    assert moved > 1e-3  # the step is large enough for a wrong scale to show
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=1e-4, atol=1e-6, msg=name)
