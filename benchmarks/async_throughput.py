"""Asynchronous against synchronous TOPR on the same task and cores: samples trained per second.

    python benchmarks/async_throughput.py            # in vLLM's environment (README's test command builds it)
    python benchmarks/async_throughput.py --quick    # 2 steps each

Both arms sample from a vLLM server (vLLM's CPU build on a CPU; on a GPU, the server and the trainer share it, in
bf16) with SmolLM2-135M-Instruct on the embedded arithmetic task (one-shot, GSM8K's format), train a LoRA adapter
(r 8, q/v) with TOPR, and train as many samples (`steps` x 4 prompts x 4 samples):

- `sync`: the loop (`run_topr_loop`, `vllm_mode="server"`): each round samples its prompts on the server, then trains
  on them while the server waits, merges the adapter and the server reloads the merged weights from the round's
  folder: sampling and training take turns.
- `async`: `TOPRAsyncGRPOTrainer` with TRL's rollout worker, which keeps requests in flight on the server while the
  trainer trains, the adapter published to the server over HTTP after each step (`max_staleness=2`).

Each arm starts its own server (the loop's needs trl-topr's worker extension, the adapter sync `--enable-lora`); the
clock starts when its server answers and stops when its last step is trained, the model's loading included. Where the
seconds went: the loop's sampling and training (the rest of its rounds is the adapter merged and saved and the
server reloading it), the async trainer's waits for samples and its adapter syncs. Writes `results.json` and
`table.md` to --out (default benchmarks/results/async-throughput).
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from provenance import save


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES = 4, 4  # a step's (a round's) prompts and samples of each
CUDA = __import__("torch").cuda.is_available()
# The server's options: on a GPU, a share of its memory beside the trainer; on a CPU, what the tests run
SERVER = ["--max-model-len", "1024", "--enforce-eager"]
SERVER += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"] if CUDA else ["--dtype", "float32"]
SERVER += [] if CUDA else ["--kv-cache-memory-bytes", str(1 << 30), "--no-enable-chunked-prefill"]
SERVER += [] if CUDA else ["--max-num-batched-tokens", "8192"]

# what both arms train with: the server's dtype, a step of a round's samples
TRAINING = dict(
    use_cpu=not CUDA,
    bf16=CUDA,
    report_to="none",
    learning_rate=1e-4,
    per_device_train_batch_size=PROMPTS * SAMPLES,
    save_strategy="no",
    disable_tqdm=True,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra: list[str], log: Path, **env) -> tuple[subprocess.Popen, int]:
    """A vLLM server for `model`, answering `/health`."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    process = subprocess.Popen(
        [*command, *SERVER, *extra],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", **env},
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process, port
        except OSError:
            time.sleep(3)
    process.kill()
    raise RuntimeError(f"The vLLM server did not start:\n{log.read_text()[-3000:]}")


def prompts(count: int):
    """The embedded task's prompts (one-shot arithmetic in GSM8K's format)."""
    from trl_topr.tasks import arithmetic_problems, few_shot_prompts

    problems = arithmetic_problems(0)
    return few_shot_prompts(problems[1 : 1 + count], problems[:1])


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def phases():
    """A loop callback adding up the seconds of each round's sampling (from the round's start: the server's weights
    loaded, its prompts sampled and scored) and training (the trainer's `train`); the rest of a round is the adapter
    merged and saved and the evaluation's reload."""
    from transformers import TrainerCallback

    from trl_topr import LoopCallback

    seconds = {"sampling": 0.0, "training": 0.0}

    class Training(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.begun = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            seconds["training"] += time.perf_counter() - self.begun

    class Phases(LoopCallback):
        def on_round_begin(self, round_index):
            self.begun = time.perf_counter()

        def on_trainer_created(self, round_index, trainer):
            seconds["sampling"] += time.perf_counter() - self.begun
            trainer.add_callback(Training())

    return Phases(), seconds


def run_sync(model: str, steps: int, work: Path) -> dict:
    """The loop through a server: rounds of sampling, then training; its seconds and samples trained, and where the
    seconds went."""
    from trl_topr import TOPRConfig, TOPRLoopConfig, gsm8k_reward, run_topr_loop

    server, port = start_server(
        model, ["--worker-extension-cls", "trl_topr.generation.vllm_engine.TOPRWorkerExtension"], work / "sync.log"
    )
    try:
        loop_args = TOPRLoopConfig(
            num_rounds=steps,
            prompts_per_round=PROMPTS,
            num_generations=SAMPLES,
            max_completion_length=32,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_host="127.0.0.1",
            vllm_server_port=port,
        )
        train_args = TOPRConfig(
            output_dir=str(work / "sync"),
            **TRAINING,
            activation_checkpointing=False,
        )
        callback, seconds = phases()
        started = time.perf_counter()
        run_topr_loop(
            model,
            prompts(PROMPTS * steps),
            gsm8k_reward,
            loop_args,
            train_args,
            peft_config=lora(),
            callbacks=[callback],
        )
        total = time.perf_counter() - started
        where = {f"{phase}_s": value for phase, value in seconds.items()}
        return {"seconds": total, "samples": steps * PROMPTS * SAMPLES, **where}
    finally:
        server.terminate()
        server.wait(60)


def run_async(model: str, steps: int, work: Path) -> dict:
    """The asynchronous trainer on TRL's worker through a server; its seconds and samples trained."""
    from transformers import AutoTokenizer

    from trl_topr import TOPRAsyncGRPOConfig, TOPRAsyncGRPOTrainer, gsm8k_reward, with_tool_template

    extra = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "4", "--logprobs-mode", "processed_logprobs"]
    server, port = start_server(model, extra, work / "async.log", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    try:
        args = TOPRAsyncGRPOConfig(
            output_dir=str(work / "async"),
            max_steps=steps,
            **TRAINING,
            num_generations=SAMPLES,
            max_completion_length=32,
            max_staleness=2,
            vllm_server_base_url=f"http://127.0.0.1:{port}",
            gradient_checkpointing=False,
        )
        started = time.perf_counter()
        tokenizer = with_tool_template(AutoTokenizer.from_pretrained(model))  # a template TRL's worker parses
        trainer = TOPRAsyncGRPOTrainer(
            model, gsm8k_reward, args, prompts(4 * PROMPTS * steps), tokenizer, peft_config=lora()
        )
        trainer.train()
        seconds = time.perf_counter() - started
        log = [entry for entry in trainer.state.log_history if "loss" in entry]
        waited = sum(entry.get("perf/rollout_wait_s", 0.0) for entry in log)  # the trainer waiting for samples
        synced = sum(entry.get("perf/weight_sync_s", 0.0) for entry in log)  # the adapter sent to the server
        samples = trainer.state.global_step * PROMPTS * SAMPLES
        return {"seconds": seconds, "samples": samples, "rollout_wait_s": waited, "weight_sync_s": synced}
    finally:
        server.terminate()
        server.wait(60)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps each")
    parser.add_argument("--steps", type=int, default=12, help="steps (rounds) of each arm")
    parser.add_argument("--out", help="results (default: benchmarks/results/async-throughput)")
    args = parser.parse_args(argv)
    steps = 2 if args.quick else args.steps
    out = Path(
        args.out or ROOT / ("outputs/async-throughput-quick" if args.quick else "benchmarks/results/async-throughput")
    )
    started = time.time()
    from trl_topr.embedded import smollm2_path

    model = smollm2_path()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        arms = {"sync": run_sync(model, steps, work), "async": run_async(model, steps, work)}
    for arm in arms.values():
        arm["samples_per_s"] = arm["samples"] / arm["seconds"]
    ratio = arms["async"]["samples_per_s"] / arms["sync"]["samples_per_s"]
    lines = ["| arm | samples trained | seconds | samples/s | ratio to sync | where the seconds went |"]
    lines.append("|---|---|---|---|---|---|")
    for name, arm in arms.items():
        ratio_cell = f"{arm['samples_per_s'] / arms['sync']['samples_per_s']:.2f}"
        parts = {
            key.removesuffix("_s").replace("_", " "): value
            for key, value in arm.items()
            if key.endswith("_s") and key != "samples_per_s"
        }
        where = ", ".join(f"{part} {value:.0f} s" for part, value in parts.items())
        cells = f"{arm['samples']} | {arm['seconds']:.0f} | {arm['samples_per_s']:.3f} | {ratio_cell} | {where}"
        lines.append(f"| {name} | {cells} |")
    table = "\n".join(lines)
    results = {"arms": arms, "ratio": ratio, "steps": steps, "prompts": PROMPTS, "samples": SAMPLES}
    save(out, {"results.json": results, "table.md": table + "\n"}, script=__file__, argv=argv, started=started)
    print(table)
    return table


if __name__ == "__main__":
    main()
