"""Memory of each process round after round of `run_topr_loop`: what a round leaves behind shows as growth.

    python benchmarks/memory.py --engine single      # 1 process, transformers generation
    python benchmarks/memory.py --engine ddp         # 2 CPU processes (accelerate launch, gloo)
    python benchmarks/memory.py --engine zero3       # DeepSpeed ZeRO-3, 2 processes
    python benchmarks/memory.py --engine fsdp2       # FSDP2, 2 processes
    python benchmarks/memory.py --engine vllm        # colocated vLLM, 1 process, in vLLM's environment
    python benchmarks/memory.py --engine zero3 --checkpointing off   # activation checkpointing off
    python benchmarks/memory.py --engine fsdp2 --label mmap --mmap_threshold 1048576   # without glibc's reserve
    python benchmarks/memory.py --report             # the tables of the runs recorded so far

Each run trains SmolLM2-135M-Instruct (the embedded model, float32) for `--rounds` small rounds (8 prompts x 4
samples of <= 16 tokens, 2 evaluation prompts) with TRL's defaults, activation checkpointing included (on unless
`--checkpointing off`), and records, for every process and round:
- start: its resident memory at the start of the round, after the rounds before it;
- peak before training: its peak resident memory from the round's start to its trainer's creation (the policy loaded,
  its samples generated and saved), since this figure was added;
- peak in training: its peak resident memory from the trainer's creation to the end of its training (TRL's
  `on_train_end`), since this figure was added; the rest of the round (saving, evaluating) is what the peak adds;
- peak: its peak resident memory during the round (`VmHWM`, started again at each round through
  `/proc/self/clear_refs`);
- live: the start less what the C allocator would give back to the system (glibc's `malloc_trim`) - what the process
  holds without the allocator's reserve, whose size varies from round to round. A forked copy of the process trims
  itself and reports how much it gave back, so that the process measured is never tidied (a trim, or a garbage
  collection, in the process itself would change what the loop's next rounds hold, unlike a user's run);
- how many trainers of earlier rounds are still alive (weak references, no garbage collection).

The loop itself is not changed: the worker measures through its callbacks (`trl_topr.loop.LoopCallback`: the start of
each round, its trainer, its recorded line). A run stops before a round whose peak would pass `--budget` of the
machine's memory (a leak would otherwise end it, or another process, out of memory). With `--mmap_threshold`, glibc
maps larger allocations apart and unmaps them when freed: the peak then follows the memory in use instead of the
allocator's reserve, which varies from round to round.

Runs are kept by engine and `--label` (e.g. before and after a fix) as `<engine>-<label>.json` in --out (default
benchmarks/results/memory), and `table.md` puts the labels of each engine side by side, with the growth of the peak
and of the live memory from round 2 to the last round. The 2-process engines use the shipped configurations of
`recipes/accelerate/` adapted to 2 CPU processes as the sharded tests adapt them (`trl_topr.testing.cpu_launch_config`;
DeepSpeed on CPU: `DS_ACCELERATOR=cpu`; FSDP2 re-applied over accelerate's fall-back to DDP on CPU). `vllm` runs in
vLLM's own environment (see `docs/sampling.md`), eager as trl-topr starts it on CPU.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from provenance import ROOT, save


ENGINES = ("single", "ddp", "zero3", "fsdp2", "vllm")
SHARDED = ("ddp", "zero3", "fsdp2")  # 2 processes, launched as the sharded tests launch them
GIB = 2**30


def memory() -> dict:
    """This process's resident memory now and its peak since the last [`reset_peak`], in bytes (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "peak": int(fields["VmHWM"].split()[0]) * 1024}


def reset_peak() -> None:
    """Start this process's peak resident memory (`VmHWM`) again from its current one."""
    Path("/proc/self/clear_refs").write_text("5")


def trimmable() -> int | None:
    """How many bytes of this process's resident memory the C allocator would give back to the system (glibc's
    `malloc_trim`), measured in a forked copy that trims itself, so that this process is not changed; `None` without
    glibc or `fork`."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    if not hasattr(os, "fork"):
        return None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: only the allocator and /proc, then out without Python's or torch's exit handlers
        try:
            before = memory()["rss"]
            trim(0)
            os.write(write, str(before - memory()["rss"]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        given_back = answer.read()
    os.waitpid(pid, 0)
    return int(given_back) if given_back else None


def arithmetic(n: int, offset: int = 0):
    from datasets import Dataset

    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)][offset : offset + n]
    question = "What is {} + {}? End with 'The answer is N.'"
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": question.format(a, b)}], "answer": f"#### {a + b}"} for a, b in pairs]
    )


class OverBudget(Exception):
    """The next round's peak would pass the run's memory budget (its round in `args`)."""


def worker(spec: dict) -> None:
    """One process of a run: the loop, with its memory recorded at each round's start and end."""
    if spec["engine"] == "fsdp2":
        from trl_topr.testing import reapply_fsdp_plugin

        reapply_fsdp_plugin()
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from transformers import TrainerCallback

    from trl_topr import LoopCallback, TOPRConfig, TOPRLoopConfig, extract_final_answer, gsm8k_reward, run_topr_loop
    from trl_topr.compat import CHECKPOINTING  # the name of the transformers installed

    rounds, trainers = {}, []

    class TrainingPeak(TrainerCallback):
        def __init__(self, row: dict):
            self.row = row

        def on_train_end(self, args, state, control, **kwargs):  # the round's training, before it saves and evaluates
            self.row["peak_training"] = memory()["peak"]
            reset_peak()

    class Measure(LoopCallback):
        def on_round_begin(self, round_index):  # what the rounds before this one left
            now = {
                "round": round_index,
                "rss_start": memory()["rss"],
                "earlier_trainers_alive": sum(ref() is not None for ref in trainers),
            }
            given_back = trimmable()
            if given_back is not None:
                now["rss_live"] = now["rss_start"] - given_back
            # stop before a round whose peak, grown as much as the last round's over its start, would pass the budget
            last, held = rounds[round_index - 1], now.get("rss_live", now["rss_start"])
            expected = held + last["peak"] - last.get("rss_live", last.get("rss_start", 0))
            if max(gather_object([expected])) > spec["budget"]:
                raise OverBudget(round_index)
            rounds[round_index] = now
            reset_peak()

        def on_trainer_created(self, round_index, trainer):  # the round has loaded its policy, sampled and saved
            trainers.append(weakref.ref(trainer))
            rounds[round_index]["peak_sampling"] = memory()["peak"]
            reset_peak()
            trainer.add_callback(TrainingPeak(rounds[round_index]))

        def on_round_end(self, metrics):
            now = memory()
            row = rounds.setdefault(metrics["round"], {"round": metrics["round"]})
            row.update(
                peak=max(now["peak"], row.get("peak_sampling", 0), row.get("peak_training", 0)), rss_end=now["rss"]
            )
            reset_peak()
            path.write_text(json.dumps({"rounds": list(rounds.values())}))  # each round as it ends

    args = TOPRConfig(
        spec["output_dir"],
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        learning_rate=1e-5,
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        **({} if spec["checkpointing"] else {CHECKPOINTING: False}),  # TRL's default: on
    )
    loop_args = TOPRLoopConfig(
        num_rounds=spec["rounds"],
        num_generations=spec["samples"],
        max_completion_length=spec["max_new_tokens"],
        use_vllm=spec["engine"] == "vllm",
        vllm_max_model_length=1024,
    )
    # the processes' state as the configuration set it up (on CPU, accelerate's default state is one process)
    path = Path(spec["output_dir"], f"memory-rank{PartialState().process_index}.json")
    try:
        run_topr_loop(
            spec["model"],
            arithmetic(spec["prompts"]),
            gsm8k_reward,
            loop_args,
            args,
            eval_prompts=arithmetic(2, offset=40),
            correct_func=gsm8k_reward,
            answer_func=extract_final_answer,
            callbacks=[Measure()],
        )
    except OverBudget as stop:
        path.write_text(json.dumps({"rounds": list(rounds.values()), "stopped_before": stop.args[0]}))
    state = PartialState()
    state.wait_for_everyone()
    if state.num_processes > 1:
        import gc

        gc.collect()  # nothing of the loop holds the process group as it is destroyed
        state.destroy_process_group()


def launch(engine: str, spec: dict, work: Path) -> tuple[list[dict], int]:
    """Run the loop under `engine` in fresh processes; return what each process recorded and the exit status."""
    (work / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if engine in SHARDED:
        from trl_topr.testing import ACCELERATE_CONFIG_FILES, cpu_launch_config

        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(cpu_launch_config(ROOT / "recipes" / "accelerate" / ACCELERATE_CONFIG_FILES[engine], work)),
            __file__,
            "--worker",
            str(work / "spec.json"),
        ]
    else:
        command = [sys.executable, __file__, "--worker", str(work / "spec.json")]
    if spec["mmap_threshold"] is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(spec["mmap_threshold"])
    if engine == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    log = work / "log.txt"
    with open(log, "w") as out:
        status = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    processes = [json.loads(path.read_text()) for path in sorted(Path(spec["output_dir"]).glob("memory-rank*.json"))]
    if status != 0:  # e.g. killed for memory: the rounds it finished are kept, with its status
        print(f"{engine} run failed ({status}):\n{log.read_text()[-3000:]}", file=sys.stderr)
        if not processes:
            raise RuntimeError(f"{engine} run failed ({status}) before the end of its first round")
    return processes, status


COLUMNS = {
    "rss_start": "start GiB",
    "peak_sampling": "peak before training GiB",  # recorded since this column was added
    "peak_training": "peak in training GiB",  # recorded since this column was added
    "peak": "peak GiB",
    "rss_live": "live GiB",
    "earlier_trainers_alive": "earlier trainers alive",
}


def largest(run: dict) -> list[dict]:
    """Per round of `run`, the largest figure of its processes (round 0 has no start: the process starts in it)."""
    return [
        {
            "round": rounds[0]["round"],
            **{key: max(r[key] for r in rounds if key in r) for key in COLUMNS if any(key in r for r in rounds)},
        }
        for rounds in zip(*(process["rounds"] for process in run["processes"]))
    ]


def columns(run: dict) -> list[str]:
    """The columns `run` recorded (runs before a column was added lack it)."""
    return [key for key in COLUMNS if any(key in r for process in run["processes"] for r in process["rounds"])]


def growth(rounds: list[dict], key: str) -> str:
    """The largest relative growth of `key` after round 2, against round 2."""
    second, later = [r[key] for r in rounds if r["round"] == 2], [r[key] for r in rounds if r["round"] > 2]
    return f"{max(later) / second[0] - 1:+.1%}" if second and second[0] and later else "n/a"


def ending(run: dict) -> str:
    """How `run` ended, when it did not run every round."""
    stopped = run["processes"][0].get("stopped_before")
    if stopped is not None:
        return f" (stopped before round {stopped}: its peak would pass {run['budget'] / GIB:.1f} GiB a process)"
    return f" (exit status {run['exit_status']})" if run["exit_status"] else ""


def cell(r: dict | None, key: str) -> str:
    if r is None or key not in r or (key != "peak" and r["round"] == 0):
        return "-"
    return str(r[key]) if key == "earlier_trainers_alive" else f"{r[key] / GIB:.2f}"


def report(out: Path) -> str:
    """Markdown tables of the runs in `out`: per engine, its labels side by side (in the order they ran), round by
    round, with the growth of the peak and of the live memory after round 2."""
    runs = {}
    for run in sorted((json.loads(path.read_text()) for path in out.glob("*-*.json")), key=lambda r: r["started"]):
        runs.setdefault(run["engine"], {})[run["label"]] = run
    sections = []
    for engine in [e for e in ENGINES if e in runs]:
        labels = {label: largest(run) for label, run in runs[engine].items()}
        shown = {label: columns(run) for label, run in runs[engine].items()}
        header = ["round"] + [f"{label}: {COLUMNS[key]}" for label in labels for key in shown[label]]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for index in range(max(len(rounds) for rounds in labels.values())):
            cells = [str(index)] + [
                cell(rounds[index] if index < len(rounds) else None, key)
                for label, rounds in labels.items()
                for key in shown[label]
            ]
            lines.append("| " + " | ".join(cells) + " |")
        processes = "/".join(sorted({str(len(run["processes"])) for run in runs[engine].values()}))
        grown = "; ".join(
            f"{label}: start {growth(labels[label], 'rss_start')}, peak {growth(labels[label], 'peak')}, live "
            f"{growth(labels[label], 'rss_live')}{ending(run)}"
            for label, run in runs[engine].items()
        )
        sections.append(
            f"{engine}, {processes} process(es), the largest figure of the processes. Growth after round "
            f"2, against round 2: {grown}\n\n" + "\n".join(lines)
        )
    return "\n\n".join(sections)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, default="single")
    parser.add_argument(
        "--label",
        help="name of this run in the tables (e.g. before, after; default: checkpointing or no_checkpointing)",
    )
    parser.add_argument(
        "--checkpointing",
        choices=("on", "off"),
        default="on",
        help="activation checkpointing (on: TRL's default)",
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.7,
        help="fraction of the machine's memory the processes may use together: the run stops before "
        "a round expected to pass it",
    )
    parser.add_argument(
        "--mmap_threshold",
        type=int,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the run, in bytes: larger allocations are mapped "
        "apart and given back when freed (resident memory then follows the memory in use)",
    )
    parser.add_argument("--report", action="store_true", help="only write and print the tables of the runs in --out")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    out, started = Path(args.out), time.time()
    if not args.report:
        args.label = args.label or {"on": "checkpointing", "off": "no_checkpointing"}[args.checkpointing]
        if "-" in args.label:
            parser.error("--label cannot contain '-'")
        from trl_topr.embedded import smollm2_path

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        with tempfile.TemporaryDirectory() as work:
            spec = {
                "engine": args.engine,
                "rounds": args.rounds,
                "prompts": args.prompts,
                "samples": args.samples,
                "max_new_tokens": args.max_new_tokens,
                "model": args.model or smollm2_path(),
                "budget": int(args.budget * total / (2 if args.engine in SHARDED else 1)),
                "mmap_threshold": args.mmap_threshold,
                "checkpointing": args.checkpointing == "on",
                "output_dir": str(Path(work) / "loop"),
            }
            processes, status = launch(args.engine, spec, Path(work))
        run = {
            "engine": args.engine,
            "label": args.label,
            "started": started,
            **{k: v for k, v in spec.items() if k != "output_dir"},
            "model": Path(spec["model"]).name,
            "exit_status": status,
            "processes": processes,
        }
        save(out, {f"{args.engine}-{args.label}.json": run}, script=__file__, argv=argv, started=started, append=True)
    out.mkdir(parents=True, exist_ok=True)
    table = report(out)
    (out / "table.md").write_text(table + "\n")  # from the recorded runs alone
    print(table)
    return table


if __name__ == "__main__":
    main()
