"""vLLM on CPU: start-up and generation of a colocated engine, compiled (vLLM's default) against eager
(`enforce_eager`, trl-topr's default on CPU), side by side.

    python benchmarks/vllm_startup.py            # SmolLM2-135M-Instruct, in vLLM's environment: ~10 min
    python benchmarks/vllm_startup.py --quick    # 8 prompts x 2 samples, 16 new tokens, 1 repetition: ~3 min

Each run is a fresh process, as a user's first command: the engine starts (`VLLMEngine.from_config`, what the loop,
`sample_completions` and the recipes build), generates the README's one-shot arithmetic prompts (32 prompts x 4
samples, 128 new tokens; what a first CPU run samples), then generates them again with another seed (the steady
throughput of later rounds). vLLM's compile cache starts empty in a folder of this run (`VLLM_CACHE_ROOT`) and is kept
from one repetition to the next: the compiled arm's first repetition pays a cold compile, as on a new machine, the
later ones a warm cache, as on a machine that compiled this model before. The arms alternate `--reps` times.

Writes `results.json` and `table.md`, with their provenance, to --out (default benchmarks/results/vllm-startup).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, save


ARMS = {"compiled": False, "eager": True}  # the arm and its `vllm_enforce_eager`


def worker(arm: str, quick: bool, out: str) -> None:
    """One run of one arm in this process: start-up, the first generation, a second one; JSON to `out`."""
    started = time.perf_counter()
    import torch
    from sampling import prompts_and_model  # the README's one-shot arithmetic prompts (vLLM's CPU attention does not
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_topr import TOPRLoopConfig
    from trl_topr.generation import SamplingSettings, VLLMEngine
    from trl_topr.tokens import prompt_ids  # internal: the prompts' ids, as an engine takes them
    # take the tests' tiny Llama: its heads are too small)

    with tempfile.TemporaryDirectory() as work:
        prompts, path = prompts_and_model(False, work)
        prompts = prompts[:8] if quick else prompts
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        args = TOPRLoopConfig(use_vllm=True, vllm_max_model_length=1024, vllm_enforce_eager=ARMS[arm])
        loaded = time.perf_counter()
        engine = VLLMEngine.from_config(model, tokenizer, args, bf16=False)
        up = time.perf_counter()
        ids = [prompt_ids(tokenizer, p) for p in prompts]
        settings = SamplingSettings(num_samples=2 if quick else 4, max_new_tokens=16 if quick else 128, seed=0)
        first = engine.generate(ids, settings, progress=False)
        first_done = time.perf_counter()
        second = engine.generate(ids, settings.replace(seed=1), progress=False)
        second_done = time.perf_counter()
        engine.close()
    tokens = [sum(map(len, run.completion_ids)) for run in (first, second)]
    Path(out).write_text(
        json.dumps(
            {
                "arm": arm,
                "imports_and_model_s": loaded - started,
                "start_up_s": up - loaded,
                "first_generation_s": first_done - up,
                "second_generation_s": second_done - first_done,
                "first_tokens": tokens[0],
                "second_tokens": tokens[1],
                "first_tokens_per_s": tokens[0] / (first_done - up),
                "second_tokens_per_s": tokens[1] / (second_done - first_done),
                "to_first_samples_s": first_done - loaded,
            }
        )
    )


def run_arm(arm: str, quick: bool, cache: str) -> dict:
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "result.json"
        with socket.socket() as probe:  # a free port for the engine's one-process torch.distributed group
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
        env = {
            **os.environ,
            "VLLM_CACHE_ROOT": cache,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(os.cpu_count() - 1, 0)}")
        argv = [sys.executable, __file__, "--worker", arm, "--result", str(out)] + (["--quick"] if quick else [])
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"{arm} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 prompts x 2 samples, 16 new tokens (smoke run)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each arm, alternating")
    parser.add_argument(
        "--out", help="results folder (default: benchmarks/results/vllm-startup, outputs/ with --quick)"
    )
    parser.add_argument("--worker", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.quick, args.result)
        return ""
    out = Path(args.out or ROOT / ("outputs/vllm-startup-quick" if args.quick else "benchmarks/results/vllm-startup"))
    started = time.time()
    runs = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as cache:  # vLLM's compile cache: empty at first, kept between repetitions
        for rep in range(args.reps):
            for arm in ARMS:
                runs[arm].append(run_arm(arm, args.quick, cache))
                print(f"rep {rep + 1}, {arm}: {json.dumps(runs[arm][-1])}", flush=True)

    def cell(arm, key, reps=slice(None)):
        return statistics.median(run[key] for run in runs[arm][reps])

    rows = [("compiled, cold compile cache (first repetition)", "compiled", slice(0, 1))]
    if args.reps > 1:
        rows.append(("compiled, warm compile cache (later repetitions)", "compiled", slice(1, None)))
    rows.append(("eager (`vllm_enforce_eager`, the CPU default)", "eager", slice(None)))
    eager_first = cell("eager", "to_first_samples_s")
    lines = [
        "| engine | start-up s | first generation s | to the first samples s | ratio to eager | "
        "first / steady generation tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for label, arm, reps in rows:
        to_first = cell(arm, "to_first_samples_s", reps)
        lines.append(
            f"| {label} | {cell(arm, 'start_up_s', reps):.1f} | {cell(arm, 'first_generation_s', reps):.1f} | "
            f"{to_first:.1f} | {to_first / eager_first:.2f} | {cell(arm, 'first_tokens_per_s', reps):.0f} / "
            f"{cell(arm, 'second_tokens_per_s', reps):.0f} |"
        )
    workload = (
        f"SmolLM2-135M-Instruct, float32, {8 if args.quick else 32} one-shot arithmetic prompts x "
        f"{2 if args.quick else 4} samples, {16 if args.quick else 128} new tokens"
    )
    title = f"vLLM colocated on CPU, {workload}; medians of {args.reps} alternating fresh processes"
    table = "\n".join(lines)
    save(
        out,
        {"results.json": {"workload": workload, "reps": args.reps, "runs": runs}, "table.md": f"{title}\n\n{table}\n"},
        script=__file__,
        argv=argv,
        started=started,
    )
    print(f"{title}\n\n{table}")
    return table


if __name__ == "__main__":
    main()
