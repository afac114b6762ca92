"""Cost of a TOPRTrainer step against TRL's SFTTrainer (the floor) and KTOTrainer, on the same model, rows and batches.

    python benchmarks/cost.py --quick            # tiny 2-layer Llama, L in {32, 128}, batch 4: about 1 minute
    python benchmarks/cost.py                    # ~21M Llama (SmolLM2-135M widths, 6 layers), L in {64, 256} x batch
                                                 # {4, 8}, 8 steps: about 4 minutes on 2 CPU cores
    python benchmarks/cost.py --quick --steps 2  # smoke run (tests/test_benchmarks.py)

Every row trains, from the same saved weights and seed, on one dataset of prompt (32 tokens) / completion (L tokens)
rows with rewards +-1 and per-token `behavior_logps` (computed once with the initial model):
  SFT      SFTTrainer, completion_only_loss, same max_length        (one forward + backward: the floor)
  TOPR     TOPRTrainer with the behavior_logps column given
  TOPR+pre TOPRTrainer without it: it computes them at construction (only its total time is reported)
  KTO      KTOTrainer, label = reward > 0, default reference model (a second forward per step) and its KL term on
           mismatched prompt/completion pairs (another forward of policy and reference): ~2x more tokens than SFT
Each (trainer, length, batch) runs in its own subprocess, interleaved trainer after trainer (and repetition after
repetition with --reps). s/step: median of the step times after the first (TrainerCallback, perf_counter).
total: construction (tokenization, precompute) + train(). peak mem: peak RSS of that subprocess (sampled every 2 ms
from just before the model is loaded to the end of training) minus its RSS then (after the imports): weights,
optimizer states, gradients, activations, allocator slack; CPU RSS is coarse, so small ratios are noisy.
Precision: as the hardware computes fastest (bf16 autocast where the CPU has AMX, else fp32), the
same for every trainer; --fp32 forces fp32.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32
TRAINERS = ["SFT", "TOPR", "TOPR+pre", "KTO"]


def build_model(folder: str, quick: bool) -> str:
    """The conftest tokenizer (BPE, ChatML); with --quick its tiny Llama, else a ~21M Llama with SmolLM2 widths."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_model

    build_tiny_model(folder)
    if not quick:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(folder)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024, tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        )
        LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def make_rows(folder: str, length: int, n: int) -> dict:
    """`n` rows of exactly PROMPT_TOKENS + `length` tokens: random letters (the conftest BPE has no merges)."""
    import random
    import string

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    words = [w for w in string.ascii_lowercase if len(tok(w, add_special_tokens=False)["input_ids"]) == 1]
    rng = random.Random(0)
    text = lambda k: "".join(rng.choice(words) for _ in range(k))
    rows = {"prompt": [text(PROMPT_TOKENS) for _ in range(n)], "completion": [text(length) for _ in range(n)]}
    assert all(len(tok(c, add_special_tokens=False)["input_ids"]) == length for c in rows["completion"])
    rows["reward"] = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return rows


def bf16(fp32: bool) -> bool:
    """The precision every trainer of the comparison uses: the library's rule for this CPU, unless --fp32."""
    from trl_topr.precision import has_native_bf16

    return not fp32 and has_native_bf16("cpu")


def common_args(spec: dict) -> dict:
    from trl_topr.config import CHECKPOINTING  # the name of the transformers installed

    return {
        "output_dir": spec["out"], "use_cpu": True, "bf16": bf16(spec["fp32"]), "report_to": "none", "seed": 0,
        "per_device_train_batch_size": spec["batch"], "per_device_eval_batch_size": spec["batch"],
        "max_steps": spec["steps"], "logging_steps": 10**6, "save_strategy": "no", CHECKPOINTING: False,
        "learning_rate": 1e-5, "dataloader_num_workers": 0, "max_length": PROMPT_TOKENS + spec["length"] + 8,
    }


def worker(spec: dict) -> dict:
    """Train one trainer for spec["steps"] steps in this (fresh) process; return its step times, total and peak RSS."""
    import psutil
    import torch
    from datasets import Dataset, disable_caching
    from transformers import TrainerCallback
    from trl import KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

    from trl_topr import TOPRConfig, TOPRTrainer

    disable_caching()
    torch.manual_seed(0)
    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    times, begin = [], [0.0]

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begin[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - begin[0])

    rows = json.loads(Path(spec["data"]).read_text())
    name, model, kw = spec["trainer"], spec["model"], common_args(spec)
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if name == "SFT":
        data = Dataset.from_dict({k: rows[k] for k in ("prompt", "completion")})
        trainer = SFTTrainer(model, args=SFTConfig(completion_only_loss=True, **kw), train_dataset=data,
                             callbacks=[Timer()])
    elif name == "KTO":
        data = Dataset.from_dict({"prompt": rows["prompt"], "completion": rows["completion"],
                                  "label": [r > 0 for r in rows["reward"]]})
        trainer = KTOTrainer(model, args=KTOConfig(**kw), train_dataset=data, callbacks=[Timer()])
    else:
        if name == "TOPR+pre":
            rows = {k: v for k, v in rows.items() if k != "behavior_logps"}
        trainer = TOPRTrainer(model, args=TOPRConfig(**kw), train_dataset=Dataset.from_dict(rows),
                              callbacks=[Timer()])
    trainer.train()
    total = time.perf_counter() - start
    done.set()
    return {"times": times, "total": total, "peak_mb": (peak[0] - base) / 2**20}


def behavior_logps(folder: str, rows: dict, spec: dict) -> list:
    """Per-token log-probs of the completions under the initial model, as TOPRTrainer computes them (not shuffled)."""
    from datasets import Dataset  # in memory: no cache files (and this runs in the caller's process)

    from trl_topr import TOPRConfig, TOPRTrainer

    trainer = TOPRTrainer(folder, args=TOPRConfig(**common_args(spec)), train_dataset=Dataset.from_dict(rows))
    return [list(v) for v in trainer.train_dataset["behavior_logps"]]


def run_worker(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, __file__, "--worker", f.name], capture_output=True, text=True, cwd=ROOT, check=False)
    os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{spec['trainer']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, small grid (about 1 minute)")
    parser.add_argument("--lengths", type=int, nargs="+", help="completion lengths in tokens")
    parser.add_argument("--batches", type=int, nargs="+", help="per-device train batch sizes")
    parser.add_argument("--steps", type=int, help="training steps per run (the first is warmup)")
    parser.add_argument("--reps", type=int, default=1, help="repetitions, trainer order rotated each time")
    parser.add_argument("--fp32", action="store_true", help="fp32 even where the CPU has native bf16")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(Path(args.worker).read_text()))), flush=True)
        return ""
    lengths = args.lengths or ([32, 128] if args.quick else [64, 256])
    batches = args.batches or ([4] if args.quick else [4, 8])
    steps = args.steps or (6 if args.quick else 8)

    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(str(Path(tmp) / "model"), args.quick)
        for length in lengths:
            for batch in batches:
                spec = {"model": folder, "length": length, "batch": batch, "steps": steps, "fp32": args.fp32,
                            "out": str(Path(tmp) / "out"), "data": str(Path(tmp) / f"data-{length}-{batch}.json")}
                rows = make_rows(folder, length, steps * batch)
                rows["behavior_logps"] = behavior_logps(folder, rows, spec)
                Path(spec["data"]).write_text(json.dumps(rows))
                runs = {name: [] for name in TRAINERS}
                for rep in range(args.reps):
                    order = TRAINERS[rep % 4:] + TRAINERS[:rep % 4]
                    for name in order:
                        runs[name].append(run_worker(dict(spec, trainer=name)))
                results.append((length, batch, runs))
                print(f"done L={length} B={batch} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    def step(runs):  # median over all steps but the first of each run
        return statistics.median(t for r in runs for t in (r["times"][1:] or r["times"]))

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    header = ["L", "batch", "SFT s/step", "TOPR s/step", "TOPR/SFT", "TOPR+pre total/SFT total", "KTO s/step",
              "TOPR/KTO", "SFT peak MB", "mem TOPR/SFT", "mem TOPR+pre/SFT", "mem TOPR/KTO"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for length, batch, runs in results:
        sft, topr, kto = step(runs["SFT"]), step(runs["TOPR"]), step(runs["KTO"])
        mem = {k: med(v, "peak_mb") for k, v in runs.items()}
        cells = [length, batch, f"{sft:.3f}", f"{topr:.3f}", f"{topr / sft:.2f}",
                 f"{med(runs['TOPR+pre'], 'total') / med(runs['SFT'], 'total'):.2f}", f"{kto:.3f}",
                 f"{topr / kto:.2f}", f"{mem['SFT']:.0f}", f"{mem['TOPR'] / mem['SFT']:.2f}",
                 f"{mem['TOPR+pre'] / mem['SFT']:.2f}", f"{mem['TOPR'] / mem['KTO']:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    table = "\n".join(lines)
    model = "tiny 2-layer Llama (conftest)" if args.quick else "~21M Llama (SmolLM2-135M widths, 6 layers)"
    print(f"{model}, {'bf16 autocast' if bf16(args.fp32) else 'fp32'}, CPU, prompt {PROMPT_TOKENS} tokens, {steps} steps, "
          f"{args.reps} rep(s); KTO = policy + reference forwards on matched and mismatched (KL) pairs; "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
