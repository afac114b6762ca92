"""Padding-free TOPR (`padding_free=True`): rows laid end to end, the loss still per sequence. Checked against the
padded path on batches of very different lengths: per-sequence log-probs, loss, metrics and trained weights; the
behavior precompute; and a model that lets flattened rows attend to one another is refused before anything is
written."""

import math

import pytest
import torch
from conftest import DEVICES, make_args
from datasets import Dataset
from transformers import AutoModelForCausalLM, OPTConfig, OPTForCausalLM

from trl_topr import TOPRTrainer
from trl_topr.data import DataCollatorForTOPR
from trl_topr.logprobs import (
    check_sequences_kept_apart,
    completion_logps,
    completion_rows,
    sequence_mixing,
    to_device,
    with_fused_lm_head,
)


# float32: the padded and padding-free forwards sum the same products in another grouping at most
ATOL = 1e-5


def uneven_dataset() -> Dataset:
    # completions from 1 to ~60 tokens in every batch of 4, prompts of different lengths, positives and negatives, and
    # off-policy behavior log-probs (so that negatives are tapered by different amounts)
    n = 8
    rows = {
        "prompt": [("What is " + "very " * (i % 3) + f"{i} + 3?") for i in range(n)],
        "completion": [" 5" if i % 4 == 0 else " The answer is" + " yes" * (3 * i) + f" {i}." for i in range(n)],
        "reward": [1.0, -1.0, -0.5, 2.0, -1.0, 1.0, -2.0, 0.5],
    }
    return Dataset.from_dict(rows)


def with_behavior(dataset: Dataset, trainer: TOPRTrainer, shift: float, per_token: bool) -> Dataset:
    # the trainer's own per-token log-probs, raised by `shift` (times 1 to 3) per token: mu above pi, ratios below 1
    behavior = trainer.train_dataset["behavior_logps"]
    values = [[v + shift * (1 + (i % 3)) for v in row] for i, row in enumerate(behavior)]
    order = trainer.train_dataset["prompt"]
    by_prompt = dict(zip(order, values, strict=True))
    column = [by_prompt[p] for p in dataset["prompt"]]
    return dataset.add_column("behavior_logps", column if per_token else [math.fsum(v) for v in column])


def batch_of(trainer: TOPRTrainer, padding_free: bool) -> dict:
    collator = DataCollatorForTOPR(pad_token_id=trainer.processing_class.pad_token_id, padding_free=padding_free)
    return collator(list(trainer.train_dataset))


def test_collator_lays_rows_end_to_end_with_their_rewards_and_behavior(tiny_model_path, tmp_path):
    trainer = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path, shuffle_dataset=False), train_dataset=uneven_dataset()
    )
    padded, flat = batch_of(trainer, False), batch_of(trainer, True)
    lengths = padded["attention_mask"].sum(-1)
    assert flat["input_ids"].shape == (1, int(lengths.sum())) and "attention_mask" not in flat
    assert torch.equal(flat["input_ids"][0], padded["input_ids"][padded["attention_mask"].bool()])
    assert torch.equal(flat["rewards"], padded["rewards"])
    # per-token behavior log-probs sit at their tokens in both layouts
    completion = flat["labels"] != -100, padded["labels"] != -100
    assert torch.equal(flat["behavior_logps"][completion[0]], padded["behavior_logps"][completion[1]])
    # the rows are found again from the positions: one per example, each with its completion tokens in order
    rows, mask = completion_rows(flat["behavior_logps"][:, 1:], flat)
    want, want_mask = padded["behavior_logps"][:, 1:], padded["labels"][:, 1:] != -100
    assert torch.equal(mask.sum(-1), want_mask.sum(-1))
    for row, keep, other, other_keep in zip(rows, mask, want, want_mask, strict=True):
        assert torch.equal(row[keep], other[other_keep])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
def test_per_sequence_logps_match_the_padded_path(tiny_model_path, tmp_path, pad_to_multiple_of, device):
    trainer = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path, shuffle_dataset=False), train_dataset=uneven_dataset()
    )
    model = with_fused_lm_head(trainer.model).eval().to(device)
    check_sequences_kept_apart(model, trainer.processing_class.pad_token_id)  # on this device's attention kernels
    padded = to_device(batch_of(trainer, False), device)
    collator = DataCollatorForTOPR(
        pad_token_id=trainer.processing_class.pad_token_id, padding_free=True, pad_to_multiple_of=pad_to_multiple_of
    )
    flat = to_device(collator(list(trainer.train_dataset)), device)
    if pad_to_multiple_of:
        assert flat["input_ids"].size(1) % pad_to_multiple_of == 0
    with torch.no_grad():
        want, want_mask, _ = completion_logps(model, padded)
        got, got_mask, _ = completion_logps(model, flat)
    assert got.shape[0] == want.shape[0] == len(trainer.train_dataset)
    assert torch.equal(got_mask.sum(-1), want_mask.sum(-1))
    for row, keep, other, other_keep in zip(got, got_mask, want, want_mask, strict=True):
        torch.testing.assert_close(row[keep], other[other_keep], atol=ATOL, rtol=0)


def trained(model_path, dataset, folder, padding_free, **kwargs):
    args = make_args(
        folder, padding_free=padding_free, max_steps=3, learning_rate=1e-2, shuffle_dataset=False, **kwargs
    )
    trainer = TOPRTrainer(model_path, args=args, train_dataset=dataset)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return trainer, logs


@pytest.mark.parametrize(
    "options",
    [
        {},  # sequence-level ratio, per-sequence length normalization: the paper's
        {
            "per_token": True,
            "ratio_level": "token",
            "loss_normalization": "token_mean",
            "gradient_accumulation_steps": 2,
            "per_device_train_batch_size": 2,
        },
        {"per_token": True, "loss_type": "tis", "loss_normalization": "sum", "baseline": 0.25},
    ],
    ids=["paper", "token-ratio-token-mean-accumulated", "tis-sum"],
)
def test_training_matches_the_padded_path(tiny_model_path, tmp_path, options):
    options = dict(options)
    per_token = options.pop("per_token", False)
    reference = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path / "mu", shuffle_dataset=False), train_dataset=uneven_dataset()
    )
    dataset = with_behavior(uneven_dataset(), reference, shift=0.02, per_token=per_token)
    padded, padded_logs = trained(tiny_model_path, dataset, tmp_path / "padded", False, **options)
    flat, flat_logs = trained(tiny_model_path, dataset, tmp_path / "flat", True, **options)
    assert len(padded_logs) == len(flat_logs) == 3
    # the metrics are per original sequence: the same in both layouts, and the ratios are not all 1
    assert any(e["negative_weight_mean"] < 0.9 for e in padded_logs)
    for want, got in zip(padded_logs, flat_logs, strict=True):
        for name, value in want.items():
            if isinstance(value, float) and name not in ("learning_rate", "epoch"):
                assert got[name] == pytest.approx(value, abs=1e-4, rel=1e-4), name
    moved = 0.0
    for (name, want), got in zip(padded.model.state_dict().items(), flat.model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=name)
        moved = max(moved, (want - reference.model.state_dict()[name]).abs().max().item())
    assert moved > 1e-3  # training moved the weights far more than the tolerance


def test_precomputed_behavior_logps_match_the_padded_path(tiny_model_path, tmp_path):
    padded = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path / "a", shuffle_dataset=False), train_dataset=uneven_dataset()
    )
    flat = TOPRTrainer(
        tiny_model_path,
        args=make_args(tmp_path / "b", shuffle_dataset=False, padding_free=True),
        train_dataset=uneven_dataset(),
    )
    for got, want in zip(flat.train_dataset["behavior_logps"], padded.train_dataset["behavior_logps"], strict=True):
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < ATOL


def test_evaluate_is_padding_free_too(tiny_model_path, tmp_path):
    args = make_args(tmp_path, padding_free=True, shuffle_dataset=False)
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=uneven_dataset(), eval_dataset=uneven_dataset())
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert abs(metrics["eval_log_ratio_mean"]) < 1e-5  # mu computed padding-free, pi padding-free: ratios at 1


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_llama_keeps_flattened_rows_apart(tiny_model_path, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn_implementation)
    with torch.no_grad():
        gap, mixed = sequence_mixing(with_fused_lm_head(model).eval(), pad_token_id=1)
    assert gap < 1e-6 < mixed  # the probe can tell: seeing the previous row moves the log-probs
    check_sequences_kept_apart(model, pad_token_id=1)


def opt_model() -> OPTForCausalLM:
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=260,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=256,
        pad_token_id=1,
    )
    return OPTForCausalLM(config)


def test_a_model_that_mixes_flattened_rows_is_refused_before_anything_is_written(tiny_model_path, tmp_path):
    # OPT derives its positions from the attention mask: laid end to end, a row attends to the ones before it
    model = opt_model()
    with pytest.raises(ValueError, match=r"padding_free=True.*OPTForCausalLM.*attend to one another"):
        check_sequences_kept_apart(model, pad_token_id=1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)  # 260 ids: OPT's vocabulary
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="padding_free=False"):
        TOPRTrainer(
            model, args=make_args(out, padding_free=True), train_dataset=uneven_dataset(), processing_class=tokenizer
        )
    assert not out.exists() or not any(out.iterdir())
    # padded, the same model trains
    TOPRTrainer(
        model,
        args=make_args(tmp_path / "padded", max_steps=1),
        train_dataset=uneven_dataset(),
        processing_class=tokenizer,
    ).train()


def test_bucketed_lengths_are_few_and_pad_at_most_a_quarter():
    from trl_topr.data import bucketed_length

    lengths = range(1, 16385)
    padded = [bucketed_length(n) for n in lengths]
    assert all(n <= p for n, p in zip(lengths, padded)) and padded == sorted(padded)
    assert all(p % 128 == 0 for p in padded)
    assert all(p <= 1.25 * n for n, p in zip(lengths, padded) if n > 512)  # at most a quarter of padding
    assert len(set(padded)) == 4 + 4 * math.log2(16384 / 512)  # 4 lengths up to 512, then 4 per doubling
    assert all(bucketed_length(n, 96) % 96 == 0 and bucketed_length(n, 96) >= n for n in range(1, 3000, 7))


def test_flex_attention_compiles_once_per_length_bucket_and_scores_as_unbucketed(tiny_model_path):
    # Flex attention compiles its block mask and its kernel for each new length of a padding-free batch when shapes are
    # specialized (as a GPU run showed; on CPU torch would otherwise go dynamic after the second length, so the test
    # specializes them). Padded to length buckets, 24 batches of random lengths compile 2 graphs per bucket met, not
    # per length; their log-probs are those of the same batches unbucketed (sdpa, no compilation). Forward only: torch
    # has no flex attention backward on CPU (the GPU kit's padding-free test trains).
    import random

    import torch._dynamo
    from torch._dynamo.utils import counters

    from trl_topr.data import bucketed_length
    from trl_topr.logprobs import LogpsSettings, behavior_logps

    generator = random.Random(0)
    rows = []
    for _ in range(24 * 4):
        ids = [generator.randrange(5, 200) for _ in range(generator.randint(20, 200))]
        rows.append({"input_ids": ids, "labels": [-100] * (len(ids) // 2) + ids[len(ids) // 2 :]})
    totals = [sum(len(row["input_ids"]) for row in rows[i : i + 4]) for i in range(0, len(rows), 4)]
    buckets = {bucketed_length(total) for total in totals}
    assert len(set(totals)) >= 20 and len(buckets) <= 7  # 80 to 800 tokens: buckets of 128 up to 896
    settings = LogpsSettings(pad_token_id=0, batch_size=4, padding_free=True)
    flex = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="flex_attention")
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=64):
        bucketed = behavior_logps(flex, rows, settings)
    assert counters["stats"]["unique_graphs"] <= 2 * len(buckets)  # create_block_mask and flex_attention, per bucket
    torch._dynamo.reset()
    unbucketed = behavior_logps(AutoModelForCausalLM.from_pretrained(tiny_model_path), rows, settings)
    assert [len(values) for values in bucketed] == [len(row["input_ids"]) - len(row["input_ids"]) // 2 for row in rows]
    torch.testing.assert_close(
        torch.tensor([v for values in bucketed for v in values]),
        torch.tensor([v for values in unbucketed for v in values]),
        atol=ATOL,
        rtol=0,
    )
