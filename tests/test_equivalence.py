"""One process vs two (`accelerate launch`, gloo on CPU) at the same global batch, and run-to-run determinism.

For 1 process x 4 rows and 2 processes x 2 rows to train alike, these must hold:

- The same global batches. `Trainer` samples with a `RandomSampler`, which accelerate replaces by a
  `SeedableRandomSampler` (`use_seedable_sampler=True`) seeded with `data_seed` or else the seed `Trainer` set
  (`args.seed`), reseeded with seed + epoch every epoch: every process draws the same permutation. Accelerate cuts it
  into batches of 2 and deals them out in turn, so step k gives perm[4k:4k+2] to rank 0 and perm[4k+2:4k+4] to rank 1:
  the 4 rows of the single process's step k. The tests record the rows of every micro-batch and check this. The
  dataset (8 rows) is a multiple of the global batch, so `even_batches` never pads a batch with wrapped-around rows.
- The same loss. TOPR's default `loss_normalization="sequence_length"` averages over the sequences of a micro-batch
  and DDP averages the gradients over processes: the mean of two means of 2 is the mean of 4. (`"token_mean"` would
  not match: each micro-batch divides by its own token count.)
- No dropout (the tiny Llama has none), fp32, AdamW with no weight decay, no gradient accumulation.

Logged metrics: each process contributes its micro-batch's values and `log` combines them. Means over the sequences of
the micro-batch (loss, reward, positive fraction, log-ratio mean, length) and extrema (log-ratio min / max) give the
single-process value for any equal-size split. Ratios of sums over a subset (weight means over the positives or the
negatives, `negative_tapered_fraction`, `effective_positive_fraction` over |R - c|, `entropy` over tokens) do too
because `log` weights each micro-batch's mean by the `count/...` metric it averages over. The "balanced" config
(sequential sampler, one positive and one negative per micro-batch, equal lengths, no padding) and the "shuffled"
config (random sampler, unequal lengths, baseline derived from `target_positive_fraction=0.3`, so that at step 1 one
process holds both positives and the other both negatives) check every metric.

Tolerances: the two setups sum the same terms in a different order (per-process sums, then gloo's all-reduce, and
batches padded to different lengths), so they agree to float32 rounding, not bit for bit: weights within atol=1e-5,
rtol=1e-4 after 4 AdamW steps at lr 1e-3 (observed: at most 6e-7 apart), metrics within atol=1e-5, rtol=1e-4
(observed: at most 2.4e-6). The two ranks' weights and logs, and the behavior log-probs of every rank (gathered from
one computation), are compared exactly; the behavior log-probs against the single process within 1e-6 (observed:
identical, as both compute the same batches of 4). Two runs in one process are compared exactly.
"""

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))  # for `conftest` when this file runs as the distributed worker

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import Launch, end_processes, make_args, standard_dataset  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_topr import TOPRTrainer  # noqa: E402


pytestmark = pytest.mark.multiprocess  # each test launches 2 processes (`accelerate launch`, gloo)


GLOBAL_BATCH = 4
MAX_STEPS = 4  # two epochs of 8 rows
WEIGHT_TOLERANCE = dict(atol=1e-5, rtol=1e-4)
METRIC_TOLERANCE = dict(atol=1e-5, rtol=1e-4)
# Means over the micro-batch's sequences, extrema, and values every process shares: any equal-size split agrees.
SPLIT_INVARIANT = {
    "loss",
    "grad_norm",
    "learning_rate",
    "epoch",
    "reward",
    "positive_fraction",
    "baseline",
    "log_ratio_mean",
    "log_ratio_min",
    "log_ratio_max",
    "completion_length",
}
# Ratios of sums over a subset of the micro-batch: agree only when every process holds as many of that subset.
RATIO_OF_SUMS = {
    "positive_weight_mean",
    "negative_weight_mean",
    "negative_tapered_fraction",
    "effective_positive_fraction",
    "negative_weight_share",
    "entropy",
}


def balanced_dataset() -> Dataset:
    # Alternating +1 / -1 rewards and equal lengths (single-digit numbers): read in order, every micro-batch of 2 holds
    # one positive and one negative with the same token counts, so every metric is split-invariant.
    dataset = standard_dataset(8)
    completions = [f" The answer is {(i + 3) % 10}." for i in range(8)]
    return dataset.remove_columns("completion").add_column("completion", completions)


def shuffled_dataset() -> Dataset:
    # Completions of different lengths: micro-batches are padded differently under 1 and 2 processes.
    dataset = standard_dataset(8)
    completions = [c + " The answer is 3." * (i % 4) for i, c in enumerate(dataset["completion"])]
    return dataset.remove_columns("completion").add_column("completion", completions)


CONFIGS = {
    "balanced": (balanced_dataset, dict(train_sampling_strategy="sequential")),
    "shuffled": (shuffled_dataset, dict(target_positive_fraction=0.3)),
}


class RecordingTrainer(TOPRTrainer):
    """Records the dataset rows of every training micro-batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training:
            if not hasattr(self, "rows_seen"):
                index = {tuple(ids): i for i, ids in enumerate(self.train_dataset["input_ids"])}
                self._row_index, self.rows_seen = index, []
            lengths = inputs["attention_mask"].sum(-1).tolist()  # right padding
            self.rows_seen.append(
                [self._row_index[tuple(ids[:n])] for ids, n in zip(inputs["input_ids"].tolist(), lengths, strict=True)]
            )
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def train(model_path: str, output_dir, config: str, per_device_train_batch_size: int) -> tuple[dict, dict]:
    """Train `config` from `model_path`; return what the process logged and saw, and its final weights."""
    make_dataset, overrides = CONFIGS[config]
    args = make_args(
        output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=per_device_train_batch_size, **overrides
    )
    trainer = RecordingTrainer(model_path, args=args, train_dataset=make_dataset())  # behavior log-probs computed
    trainer.train()
    record = {
        "world": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
        "rows": trainer.rows_seen,
        "baseline": trainer.baseline,
        "behavior": list(trainer.train_dataset["behavior_logps"]),
    }
    weights = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    return record, weights


def _worker(model_path: str, output_dir: str) -> None:
    # (No `PartialState()` before the trainer: created without `cpu=True`, it would find no GPU and set up no process
    # group.)
    for config in CONFIGS:
        record, weights = train(model_path, f"{output_dir}/{config}", config, GLOBAL_BATCH // 2)
        rank = record["rank"]
        Path(f"{output_dir}/{config}-rank{rank}.json").write_text(json.dumps(record))
        torch.save(weights, f"{output_dir}/{config}-rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    """Each config trained on 1 process (here) and on 2 (`accelerate launch`, gloo on CPU)."""
    folder = tmp_path_factory.mktemp("equivalence")
    # accelerate's torch.distributed launcher: without a GPU the processes use gloo on CPU
    launched = Launch(__file__, tiny_model_path, folder / "multi", env={"TOKENIZERS_PARALLELISM": "false"})
    # The single-process runs use this process's cores while the launched processes start up.
    single = {config: train(tiny_model_path, folder / f"single-{config}", config, GLOBAL_BATCH) for config in CONFIGS}
    launched.finish(timeout=300)
    multi = {
        config: [
            (
                json.loads((folder / "multi" / f"{config}-rank{rank}.json").read_text()),
                torch.load(folder / "multi" / f"{config}-rank{rank}.pt"),
            )
            for rank in (0, 1)
        ]
        for config in CONFIGS
    }
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    return {"folder": folder, "single": single, "multi": multi, "initial": initial}


def _global_batches(record: dict) -> list[list[int]]:
    return [sorted(rows) for rows in record["rows"]]


def _compare_logs(single: list[dict], multi: list[dict], keys: set[str]) -> None:
    assert [entry["step"] for entry in multi] == [entry["step"] for entry in single] == list(range(1, MAX_STEPS + 1))
    for step, (want, got) in enumerate(zip(single, multi, strict=True), start=1):
        assert set(got) == set(want), f"step {step}: logged keys differ"
        for key in sorted(keys & set(want)):
            torch.testing.assert_close(
                torch.tensor(got[key], dtype=torch.float64),
                torch.tensor(want[key], dtype=torch.float64),
                **METRIC_TOLERANCE,
                msg=lambda m, key=key, step=step: f"step {step}, {key}: {m}",
            )


@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_processes_train_like_one_at_the_same_global_batch(runs, config):
    (single, single_weights), ranks = runs["single"][config], runs["multi"][config]
    assert single["world"] == 1 and [record["world"] for record, _ in ranks] == [2, 2]
    assert all(len(rows) == GLOBAL_BATCH for rows in single["rows"])

    # The same rows at every step: rank 0's micro-batch and rank 1's make up the single process's batch.
    rank0, rank1 = (record["rows"] for record, _ in ranks)
    assert all(len(a) == len(b) == GLOBAL_BATCH // 2 for a, b in zip(rank0, rank1, strict=True))
    assert [sorted(a + b) for a, b in zip(rank0, rank1, strict=True)] == _global_batches(single)
    assert len({tuple(rows) for rows in _global_batches(single)[:2]}) == 2  # an epoch covers different rows

    # Every process logs the same (gathered) metrics, and they are the single process's.
    assert ranks[0][0]["logs"] == ranks[1][0]["logs"]
    keys = SPLIT_INVARIANT | (RATIO_OF_SUMS if config == "balanced" else set())
    assert {"loss", "log_ratio_mean", "negative_weight_mean"} <= set(single["logs"][0])
    _compare_logs(single["logs"], ranks[0][0]["logs"], keys)

    # The same weights: identical on both processes (DDP), and the single process's to float32 rounding.
    for name, tensor in ranks[1][1].items():
        assert torch.equal(tensor, ranks[0][1][name]), name
    assert ranks[0][1].keys() == single_weights.keys()
    for name, tensor in single_weights.items():
        torch.testing.assert_close(ranks[0][1][name], tensor, **WEIGHT_TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    initial = runs["initial"]
    assert any(not torch.equal(tensor, initial[name]) for name, tensor in single_weights.items())  # it did train


def test_derived_baseline_is_the_same_on_every_process(runs):
    single, ranks = runs["single"]["shuffled"][0], [record for record, _ in runs["multi"]["shuffled"]]
    # p = 0.5 positives, target 0.3: c = (p - t) / (p + t - 2pt) = 0.4
    assert single["baseline"] == pytest.approx(0.4, abs=1e-9)
    assert [record["baseline"] for record in ranks] == [single["baseline"]] * 2  # bitwise
    for record in (single, *ranks):
        assert [entry["baseline"] for entry in record["logs"]] == pytest.approx([single["baseline"]] * MAX_STEPS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_precomputed_behavior_logps_are_the_same_on_every_process(runs, config):
    single, ranks = runs["single"][config][0], [record for record, _ in runs["multi"][config]]
    assert ranks[0]["behavior"] == ranks[1]["behavior"]  # per row, per token, bitwise: one gathered computation
    assert len(ranks[0]["behavior"]) == len(single["behavior"]) == 8
    for row, (got, want) in enumerate(zip(ranks[0]["behavior"], single["behavior"], strict=True)):
        assert len(got) == len(want), row
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-6, rtol=0, msg=f"row {row}")


def test_ratio_of_sums_metrics_match_on_an_unbalanced_split(runs):
    single, ranks = runs["single"]["shuffled"][0], runs["multi"]["shuffled"]
    _compare_logs(single["logs"], ranks[0][0]["logs"], RATIO_OF_SUMS)


def test_same_seed_same_data_trains_identically(runs, tiny_model_path):
    # A second single-process run of the shuffled config, in this process: exactly the first one's losses and weights.
    first, first_weights = runs["single"]["shuffled"]
    again, again_weights = train(tiny_model_path, runs["folder"] / "single-shuffled-again", "shuffled", GLOBAL_BATCH)
    assert again["rows"] == first["rows"]
    assert [entry["loss"] for entry in again["logs"]] == [entry["loss"] for entry in first["logs"]]
    assert again["logs"] == first["logs"]  # every metric, exactly (`log` drops NaNs, so `==` is exact equality)
    assert again["behavior"] == first["behavior"]
    assert again_weights.keys() == first_weights.keys()
    for name, tensor in first_weights.items():
        assert torch.equal(again_weights[name], tensor), name


if __name__ == "__main__":  # the worker of each process under `accelerate launch`
    _worker(*sys.argv[1:3])
    end_processes()
