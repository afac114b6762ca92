"""A learning test that can fail: TOPR raises positives' log-probability and lowers negatives', without NaN."""

import math

import torch
from conftest import make_args
from datasets import Dataset

from trl_topr import TOPRTrainer
from trl_topr.logprobs import completion_logps


def paired_dataset() -> Dataset:
    # Each prompt has a right answer (+1) and an evasive one (-1).
    prompts = [f"What is {i} + 3?" for i in range(8)]
    return Dataset.from_dict(
        {
            "prompt": prompts * 2,
            "completion": [f" The answer is {i + 3}." for i in range(8)] + [" maybe a story about a cat."] * 8,
            "reward": [1.0] * 8 + [-1.0] * 8,
        }
    )


@torch.no_grad()
def mean_sequence_logps(trainer) -> tuple[float, float]:
    """Mean log pi(y|x) of the positive and of the negative training completions."""
    trainer.model.eval()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    batch = {k: v.to(trainer.model.device) for k, v in batch.items()}
    per_token_logps, mask, _ = completion_logps(trainer.model, batch)
    sequence_logps = (per_token_logps * mask).sum(-1)
    positive = batch["rewards"] > 0
    trainer.model.train()
    return sequence_logps[positive].mean().item(), sequence_logps[~positive].mean().item()


def test_topr_raises_positives_and_lowers_negatives(tiny_model_path, tmp_path):
    args = make_args(
        tmp_path,
        max_steps=150,
        learning_rate=3e-3,
        logging_steps=10,
        per_device_train_batch_size=8,
        lr_scheduler_type="constant",
    )
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=paired_dataset())
    positive_before, negative_before = mean_sequence_logps(trainer)
    trainer.train()
    positive_after, negative_after = mean_sequence_logps(trainer)

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert all(math.isfinite(loss) for loss in losses)
    print(
        f"log pi of positives {positive_before:.1f} -> {positive_after:.1f}, "
        f"negatives {negative_before:.1f} -> {negative_after:.1f}"
    )
    assert positive_after > positive_before + 5.0, (positive_before, positive_after)
    assert negative_after < negative_before - 5.0, (negative_before, negative_after)
    # the negatives fell away from mu: their weight is tapered below 1, which bounds the push-down
    last = [entry for entry in trainer.state.log_history if "negative_weight_mean" in entry][-1]
    assert last["negative_weight_mean"] < 0.5
    assert last["negative_tapered_fraction"] == 1.0
