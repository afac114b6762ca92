"""What glibc's fixed mmap threshold costs in training: `TOPRTrainer` on the real scale's task with glibc's default
allocator and with every allocation of `--threshold` bytes or more mapped apart and unmapped when freed
(`MALLOC_MMAP_THRESHOLD_`, the setting of the memory benchmark's `mmap` run and of the docs' advice), side by side.

    python benchmarks/allocator.py           # SmolLM2-135M-Instruct, float32, 64 rows (8 steps of 8): ~10 min
    python benchmarks/allocator.py --quick   # a tiny model, 16 rows (seconds; tests/test_benchmarks.py)

Each measurement is a fresh process (the threshold is read when a process starts), run as users run training: a
`TOPRTrainer` with TRL's defaults (activation checkpointing on), float32, on rows of the real scale's products task
(one worked example in the prompt, half the completions right with reward 1, half wrong with reward 0, a behavior
log-prob per row). The two settings alternate `--reps` times, each taking its turn first. Reports the median seconds of
`trainer.train()` and each process's peak resident memory (`VmHWM`), and their ratios to the default's.

Writes `results.json` and `table.md`, with their provenance, to --out (default benchmarks/results/allocator).
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from alternating import alternate, in_fresh_process, start_model
from provenance import ROOT, save


SETTINGS = ("default", "mmap")
GIB = 2**30


def rows(count: int) -> list[dict]:
    """`count` rows of the products task: a one-shot prompt, a completion right (reward 1) or wrong (reward 0)."""
    from tasks import product_problems

    from trl_topr.tasks import few_shot_prompts, solution_text

    problems = product_problems()
    prompts = few_shot_prompts(problems[1 : count + 1], problems[:1])["prompt"]
    data = []
    for i, (prompt, problem) in enumerate(zip(prompts, problems[1 : count + 1], strict=True)):
        answer = int(problem["answer"].split("####")[1])
        given = answer if i % 2 == 0 else answer + 10
        text = solution_text(problem["answer"].replace(str(answer), str(given)))
        data.append(
            {
                "prompt": prompt,
                "completion": [{"role": "assistant", "content": text}],
                "reward": float(i % 2 == 0),
                "behavior_logps": -8.0,
            }
        )
    return data


def worker(spec: dict) -> None:
    """Train once as `spec` says and print the seconds of `trainer.train()` and the process's peak memory."""
    from datasets import Dataset

    from trl_topr import TOPRConfig, TOPRTrainer

    with tempfile.TemporaryDirectory() as out:
        args = TOPRConfig(
            output_dir=out,
            per_device_train_batch_size=8,
            learning_rate=1e-6,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            seed=0,
        )
        trainer = TOPRTrainer(spec["model"], args=args, train_dataset=Dataset.from_list(rows(spec["rows"])))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    status = Path("/proc/self/status").read_text()
    peak = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")  # what glibc read at this process's start
    print(
        json.dumps({"seconds": seconds, "peak": peak, "checkpointing": args.gradient_checkpointing, "env": threshold})
    )


def measure(setting: str, spec: dict, threshold: int) -> dict:
    """One training in a fresh process, with glibc's default allocator or the fixed threshold."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if setting == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    return in_fresh_process(__file__, spec, setting, env)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 16 rows (seconds)")
    parser.add_argument("--reps", type=int, default=3, help="trainings of each setting, alternating")
    parser.add_argument("--rows", type=int, help="training rows, in batches of 8 (default 64; 16 with --quick)")
    parser.add_argument("--threshold", type=int, default=1048576, help="MALLOC_MMAP_THRESHOLD_ of `mmap`, in bytes")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/allocator, outputs/ with --quick)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    out = Path(args.out or ROOT / ("outputs/allocator-quick" if args.quick else "benchmarks/results/allocator"))
    started = time.time()
    with tempfile.TemporaryDirectory() as work:
        model, name = start_model(args.quick, work)
        spec = {"model": model, "rows": args.rows or (16 if args.quick else 64)}
        runs = alternate(SETTINGS, args.reps, lambda setting: measure(setting, spec, args.threshold))
    seconds = {s: statistics.median(r["seconds"] for r in runs[s]) for s in SETTINGS}
    peak = {s: statistics.median(r["peak"] for r in runs[s]) for s in SETTINGS}
    results = {
        "model": name,
        "rows": spec["rows"],
        "batch": 8,
        "threshold": args.threshold,
        "reps": args.reps,
        "checkpointing": runs["default"][0]["checkpointing"],
        "runs": runs,
        "median_seconds": seconds,
        "median_peak_gib": {s: peak[s] / GIB for s in SETTINGS},
        "seconds_ratio": seconds["mmap"] / seconds["default"],
        "peak_ratio": peak["mmap"] / peak["default"],
    }
    title = (
        f"{name}, float32, {spec['rows']} rows in batches of 8, activation checkpointing "
        f"{'on' if results['checkpointing'] else 'off'}; median of {args.reps} alternating processes each"
    )
    table = "\n".join(
        [
            f"| training | glibc's default | MALLOC_MMAP_THRESHOLD_={args.threshold} | ratio |",
            "|---|---|---|---|",
            f"| seconds of trainer.train() | {seconds['default']:.1f} | {seconds['mmap']:.1f} | "
            f"{results['seconds_ratio']:.2f} |",
            f"| peak resident GiB | {peak['default'] / GIB:.2f} | {peak['mmap'] / GIB:.2f} | "
            f"{results['peak_ratio']:.2f} |",
        ]
    )
    print(f"{title}\n\n{table}")
    save(
        out,
        {"results.json": results, "table.md": f"{title}\n\n{table}\n"},
        script=__file__,
        argv=argv,
        started=started,
    )
    return table


if __name__ == "__main__":
    main()
