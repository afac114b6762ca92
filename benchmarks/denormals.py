"""What denormal floats cost TOPR's training on a CPU: `TOPRTrainer` as it ships (denormals flushed to zero while it
trains, `trl_topr.precision.denormals_flushed`) and with them kept (the trainer before it flushed them), side by side.

    python benchmarks/denormals.py           # SmolLM2-135M-Instruct, float32, the 16 rows below: ~4 min
    python benchmarks/denormals.py --quick   # a tiny model, the same rows as text (seconds; tests/test_benchmarks.py)

The rows (`data/denormal-rows.jsonl`) are the 16 completions a colocated vLLM engine sampled from
SmolLM2-135M-Instruct in the first round of a TOPR loop on 4 arithmetic questions (4 a question, 24 tokens at most):
all wrong (reward -1), with their token ids and vLLM's per-token behavior log-probs. Training on negatives alone
moves the policy away from them within the epoch, so their weights clip(pi/mu, 0, 1) taper toward zero with nothing
larger in the batch: the case where the backward pass fills with denormal floats. Each training is one epoch in
batches of 4 at rate 1e-4 (4 steps), TRL's other defaults, from the start model. Whether a batch fills with denormals
depends on the completions: other all-negative rounds, sampled with vLLM or transformers, trained as fast kept as
flushed; these rows are one batch that does, kept for this benchmark.

Each measurement is a fresh process; the two settings alternate `--reps` times, each taking its turn first. Reports
the median seconds of `trainer.train()` and their ratio, the log-ratios the trainer logged step by step, and whether
the two settings logged the same losses.

Writes `results.json` and `table.md`, with their provenance, to --out (default benchmarks/results/denormals).
"""

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from alternating import alternate, in_fresh_process, start_model
from provenance import ROOT, save


SETTINGS = ("flushed", "kept")
ROWS = Path(__file__).resolve().parent / "data" / "denormal-rows.jsonl"


def rows(as_text: bool) -> list[dict]:
    """The committed rows; `as_text`: without their token ids, each behavior log-prob summed over the completion (for
    a model with another tokenizer)."""
    data = [json.loads(line) for line in ROWS.read_text().splitlines()]
    if as_text:
        data = [
            {key: row[key] for key in ("prompt", "completion", "reward")}
            | {"behavior_logps": sum(row["behavior_logps"])}
            for row in data
        ]
    return data


def worker(spec: dict) -> None:
    """Train once as `spec` says; print the seconds of `trainer.train()` and what the trainer logged."""
    from datasets import Dataset
    from transformers import TrainerCallback

    import trl_topr.precision  # to run the trainer as it was before it flushed denormals (the "kept" setting)
    from trl_topr import TOPRConfig, TOPRTrainer

    flushing = []

    class Probe(TrainerCallback):
        """Whether the training thread flushed denormals, step by step."""

        def on_step_end(self, args, state, control, **kwargs):
            flushing.append(trl_topr.precision.flushing_denormals())

    if spec["setting"] == "kept":  # the trainer before it flushed denormals
        trl_topr.precision.denormals_flushed = lambda device: contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as out:
        args = TOPRConfig(
            output_dir=out,
            per_device_train_batch_size=4,
            learning_rate=1e-4,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            seed=0,
        )
        data = Dataset.from_list(rows(as_text=spec["as_text"]))
        trainer = TOPRTrainer(spec["model"], args=args, train_dataset=data, callbacks=[Probe()])
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    steps = [entry for entry in trainer.state.log_history if "log_ratio_mean" in entry]
    print(
        json.dumps(
            {
                "seconds": seconds,
                "checkpointing": args.gradient_checkpointing,
                "flushing": flushing,
                "log_ratio_mean": [entry["log_ratio_mean"] for entry in steps],
                "losses": [entry["loss"] for entry in steps],
            }
        )
    )


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, the rows as text (seconds)")
    parser.add_argument("--reps", type=int, default=3, help="trainings of each setting, alternating")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/denormals, outputs/ with --quick)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    out = Path(args.out or ROOT / ("outputs/denormals-quick" if args.quick else "benchmarks/results/denormals"))
    started = time.time()
    with tempfile.TemporaryDirectory() as work:
        model, name = start_model(args.quick, work)
        spec = {"model": model, "as_text": args.quick}
        runs = alternate(SETTINGS, args.reps, lambda s: in_fresh_process(__file__, dict(spec, setting=s), s))
    seconds = {s: statistics.median(r["seconds"] for r in runs[s]) for s in SETTINGS}
    first = {s: runs[s][0] for s in SETTINGS}
    results = {
        "model": name,
        "rows": len(rows(as_text=args.quick)),
        "batch": 4,
        "reps": args.reps,
        "checkpointing": first["flushed"]["checkpointing"],
        "runs": runs,
        "median_seconds": seconds,
        "seconds_ratio": seconds["kept"] / seconds["flushed"],
        "log_ratio_mean": first["flushed"]["log_ratio_mean"],
        "same_losses": first["flushed"]["losses"] == first["kept"]["losses"],
    }
    title = (
        f"{name}, float32, {results['rows']} negatives a vLLM engine sampled, one epoch in batches of 4 at 1e-4, "
        f"activation checkpointing {'on' if results['checkpointing'] else 'off'}; median of {args.reps} alternating "
        "processes each"
    )
    table = "\n".join(
        [
            "| training | denormals flushed (as shipped) | denormals kept | kept / flushed |",
            "|---|---|---|---|",
            f"| seconds of trainer.train() | {seconds['flushed']:.1f} | {seconds['kept']:.1f} | "
            f"{results['seconds_ratio']:.2f} |",
        ]
    )
    note = (
        f"Mean log-ratio log(pi/mu) of each step: {', '.join(f'{v:.1f}' for v in results['log_ratio_mean'])}. "
        f"The two settings logged {'the same' if results['same_losses'] else 'different'} losses."
    )
    print(f"{title}\n\n{table}\n\n{note}")
    save(
        out,
        {"results.json": results, "table.md": f"{title}\n\n{table}\n\n{note}\n"},
        script=__file__,
        argv=argv,
        started=started,
    )
    return table


if __name__ == "__main__":
    main()
