"""Cost of a TOPRTrainer step against TRL's SFTTrainer (the floor) and KTOTrainer, on the same model, rows and batches.

    python benchmarks/cost.py --quick            # tiny 2-layer Llama, L in {32, 128}, batch 4: about 1 minute
    python benchmarks/cost.py                    # ~21M Llama (SmolLM2-135M widths, 6 layers), L in {64, 256} x batch
                                                 # {4, 8}, 8 steps: about 4 minutes on 2 CPU cores
    python benchmarks/cost.py --quick --steps 2  # smoke run (tests/test_benchmarks.py)
    python benchmarks/cost.py --device cuda --arch qwen2.5-0.5b --trainers SFT TOPR [--qlora]
                                                 # on a GPU: Qwen2.5-0.5B's architecture, bf16 (or NF4 QLoRA)
    python benchmarks/cost.py ... --profile      # also each trainer's top operators by self time (torch.profiler)
    python benchmarks/cost.py --mix              # uneven lengths: tokens/s padded, padding-free, length-grouped

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
Precision: as trl-topr picks it (bf16 autocast where its probe finds bf16 faster, else fp32), the same
for every trainer; --fp32 forces fp32.

On CUDA (--device cuda): bf16 mixed precision (float32 weights, TRL's default on a GPU; --full_bf16 loads the weights
in bf16 too), step times synchronized with the device, peak memory = `torch.cuda.max_memory_allocated` of the run.
--arch qwen2.5-0.5b builds Qwen2.5-0.5B's architecture (494M parameters, vocabulary 151,936) with random weights: a
step's time and memory do not depend on the weights' values. --qlora loads the base in 4-bit NF4 (bf16 compute) with
LoRA r=16 on every linear layer, for SFT and TOPR alike. Model FLOPs per step: 6 x N x tokens for full fine-tuning, 4 x
N x tokens for QLoRA (the frozen base has no weight gradients), N = the parameters of the matrix products (the tied LM
head counted once), attention ignored; MFU = those FLOPs per second over the bf16 matrix-product rate measured on the
same device at the start (8192^3).

--profile runs torch.profiler over every step but the first, in the first repetition, and prints per profiled step
each trainer's total and its operators with the most self time (on CUDA: the device time of the kernels they launch;
on CPU: CPU time): where a trainer's step goes, to explain a ratio. The profiler's overhead makes those steps slower;
their times still enter s/step.

--mix measures the layouts of a batch on completions of very uneven lengths, like the paper's samples (up to 512 new
tokens, right and wrong answers of different lengths): completion lengths drawn log-uniformly from 4 to --max_length
tokens (default 512; 128 with --quick), prompts of 32 tokens, rewards +-1, per-token behavior log-probs. Each arm
trains two epochs from the same weights and seed; tokens/s is the dataset's tokens (prompt + completion, no padding)
over the time of the second epoch's steps, in which every arm trains every row once:
  SFT-pf        SFTTrainer, padding_free=True (TRL's flattened rows; max_length=None, as TRL requires there)
  TOPR          TOPRTrainer, padded batches of random rows (the same batches as SFT-pf's, in the same order)
  TOPR-pf       TOPRTrainer, padding_free=True
  TOPR-grouped  TOPRTrainer, padded batches of similar lengths: the rows in the order transformers' length-grouped
                sampler (`train_sampling_strategy="group_by_length"`) gives a large dataset, i.e. sorted by length
                in megabatches of 50 batches (here the whole dataset is one), trained in that order. (On a dataset
                of fewer than 200 batches the sampler itself groups in smaller megabatches, and pads more.)
"padded share" is the share of padding in the tokens of the collated batches (`input_ids`) of each padded arm.
With `--attn_implementation flex_attention`, which compiles once per batch shape, every arm pads to a few shapes:
padded batches to a multiple of 128 tokens, padding-free ones to TOPR's length buckets (SFT-pf too, through
`trl_topr.data.PaddingFreeCollator`).

Writes `results.json` (every run's step times, totals and peaks) and `table.md`, with their provenance, to --out
(default benchmarks/results/cost, cost-mix with --mix, cost-cuda on a GPU, outputs/ with --quick), again after each
cell, so that a run stopped on a time limit keeps the cells it finished.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from provenance import save


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32
TRAINERS = ["SFT", "TOPR", "TOPR+pre", "KTO"]
MIX_TRAINERS = ["SFT-pf", "TOPR", "TOPR-pf", "TOPR-grouped"]
# What each arm of --mix changes in its trainer's configuration (the grouped arm's rows come in grouped order)
LAYOUTS = {"-pf": {"padding_free": True}, "-grouped": {"train_sampling_strategy": "sequential"}}


ARCHS = {
    "tiny": "tiny 2-layer Llama (conftest)",
    "small": "~21M Llama (SmolLM2-135M widths, 6 layers)",
    "qwen2.5-0.5b": "Qwen2.5-0.5B architecture (random weights)",
}


def build_model(folder: str, arch: str) -> str:
    """The conftest tokenizer (BPE, ChatML) with a model of `arch` (`ARCHS`), saved to `folder` with random weights."""
    from trl_topr.testing import build_tiny_model

    build_tiny_model(folder)
    if arch == "tiny":
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(folder)
    special = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    if arch == "small":
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            **special,
        )
        LlamaForCausalLM(config).save_pretrained(folder)
    else:  # Qwen2.5-0.5B's config.json; the tokenizer's ids (< 200) are a subset of its vocabulary
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            **special,
        )
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def make_rows(folder: str, length: int, n: int) -> dict:
    """`n` rows of exactly PROMPT_TOKENS + `length` tokens: random letters (the conftest BPE has no merges)."""
    import random
    import string

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    words = [w for w in string.ascii_lowercase if len(tok(w, add_special_tokens=False)["input_ids"]) == 1]
    rng = random.Random(0)

    def text(k: int) -> str:
        return "".join(rng.choice(words) for _ in range(k))

    rows = {"prompt": [text(PROMPT_TOKENS) for _ in range(n)], "completion": [text(length) for _ in range(n)]}
    assert all(len(tok(c, add_special_tokens=False)["input_ids"]) == length for c in rows["completion"])
    rows["reward"] = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return rows


def make_mixed_rows(folder: str, n: int, max_length: int) -> dict:
    """`n` rows of PROMPT_TOKENS + a completion of 4 to `max_length` tokens, drawn log-uniformly (seeded)."""
    import math
    import random

    rng = random.Random(0)
    lengths = [round(math.exp(rng.uniform(math.log(4), math.log(max_length)))) for _ in range(n)]
    rows = {"prompt": [], "completion": []}
    for length in sorted(set(lengths)):
        same = make_rows(folder, length, lengths.count(length))
        rows["prompt"] += same["prompt"]
        rows["completion"] += same["completion"]
    order = rng.sample(range(n), n)  # lengths in no particular order
    rows = {k: [v[i] for i in order] for k, v in rows.items()}
    rows["reward"] = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return rows


def length_grouped(rows: dict, batch: int) -> dict:
    """
    `rows` in the order transformers' length-grouped sampler gives a dataset of at least 200 batches: shuffled, sorted
    by length (longest first) in megabatches of 50 batches, the longest batch first (seeded).
    """
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = [len(prompt) + len(completion) for prompt, completion in zip(rows["prompt"], rows["completion"])]
    order = get_length_grouped_indices(lengths, batch, mega_batch_mult=50, generator=torch.Generator().manual_seed(0))
    return {k: [v[i] for i in order] for k, v in rows.items()}


def bf16(fp32: bool, device: str = "cpu") -> bool:
    """The precision every trainer of the comparison uses: the library's rule for this device, unless --fp32."""
    from trl_topr.precision import bf16_is_faster  # internal: the library's rule, the same for every trainer

    return not fp32 and bf16_is_faster(device)


def common_args(spec: dict) -> dict:
    from trl_topr.compat import CHECKPOINTING  # the name of the transformers installed

    return {
        "output_dir": spec["out"],
        "use_cpu": spec["device"] == "cpu",
        "bf16": bf16(spec["fp32"], spec["device"]),
        "report_to": "none",
        "seed": 0,
        "per_device_train_batch_size": spec["batch"],
        "per_device_eval_batch_size": spec["batch"],
        "max_steps": spec["steps"],
        "logging_steps": 10**6,
        "save_strategy": "no",
        CHECKPOINTING: False,
        "learning_rate": 1e-5,
        "dataloader_num_workers": 0,
        "max_length": PROMPT_TOKENS + spec["length"] + 8,
        **({"model_init_kwargs": model_init_kwargs(spec)} if model_init_kwargs(spec) else {}),
        **({"padding_free": True} if spec.get("padding_free") else {}),
    }


def model_init_kwargs(spec: dict) -> dict:
    """The models' `from_pretrained` options: the attention implementation, and bf16 weights with --full_bf16."""
    return {
        **({"attn_implementation": spec["attn"]} if spec.get("attn") else {}),
        **({"dtype": "bfloat16"} if spec.get("full_bf16") else {}),
    }


def qlora_configs(spec: dict) -> dict:
    """
    With `spec["qlora"]`, the trainer keywords of an NF4 4-bit base with bf16 compute and LoRA r=16 on every linear
    layer (the QLoRA setup of the recipes); none otherwise.
    """
    if not spec.get("qlora"):
        return {}
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    return {"quantization_config": quantization, "peft_config": lora}


def matmul_params(folder: str) -> int:
    """Parameters of the saved model that take part in a matrix product per token: all but an untied input
    embedding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the unquantized architecture, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    total = sum(p.numel() for p in model.parameters())  # tied weights are one parameter, counted once
    embedding = model.get_input_embeddings().weight
    return total if model.get_output_embeddings().weight is embedding else total - embedding.numel()


def worker(spec: dict) -> dict:
    """Train one trainer for spec["steps"] steps in this (fresh) process; return its step times, total and peak
    memory."""
    import psutil
    import torch
    from datasets import Dataset, disable_caching
    from transformers import TrainerCallback
    from trl import KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

    from trl_topr import TOPRConfig, TOPRTrainer
    from trl_topr.data import PaddingFreeCollator  # internal: the bucketed padding-free layout, for SFT too

    disable_caching()
    torch.manual_seed(0)
    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    times, begin = [], [0.0]
    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # CUDA runs ahead of Python: time the device's work

    profiler = [None]

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if spec.get("profile") and state.global_step == 1:  # after the warmup step
                activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
                profiler[0] = torch.profiler.profile(activities=activities)
                profiler[0].__enter__()
            sync()
            begin[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            times.append(time.perf_counter() - begin[0])

    rows = json.loads(Path(spec["data"]).read_text())
    name, model, kw = spec["trainer"], spec["model"], common_args(spec)
    for suffix, options in LAYOUTS.items():
        if name.endswith(suffix):
            name, kw = name[: -len(suffix)], {**kw, **options}
    if name == "SFT" and kw.get("padding_free"):
        kw["max_length"] = None  # TRL's SFT enforces no max_length padding-free without packing (rows are shorter)
    flex = spec.get("attn") == "flex_attention"  # compiled once per batch shape: a few shapes, not one per batch
    if flex and not kw.get("padding_free"):
        kw["pad_to_multiple_of"] = 128  # padded batches' widths; TOPR's padding-free batches go to length buckets
    qlora = qlora_configs(spec)
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if name == "SFT":
        data = Dataset.from_dict({k: rows[k] for k in ("prompt", "completion")})
        trainer = SFTTrainer(
            model, args=SFTConfig(completion_only_loss=True, **kw), train_dataset=data, callbacks=[Timer()], **qlora
        )
    elif name == "KTO":
        data = Dataset.from_dict(
            {"prompt": rows["prompt"], "completion": rows["completion"], "label": [r > 0 for r in rows["reward"]]}
        )
        trainer = KTOTrainer(model, args=KTOConfig(**kw), train_dataset=data, callbacks=[Timer()])
    else:
        if name == "TOPR+pre":
            rows = {k: v for k, v in rows.items() if k != "behavior_logps"}
        trainer = TOPRTrainer(
            model, args=TOPRConfig(**kw), train_dataset=Dataset.from_dict(rows), callbacks=[Timer()], **qlora
        )
    if flex and name == "SFT" and kw.get("padding_free"):  # TRL's collator, with TOPR's length buckets
        fields = {f.name: getattr(trainer.data_collator, f.name) for f in dataclasses.fields(trainer.data_collator)}
        trainer.data_collator = PaddingFreeCollator(**fields, length_buckets=True)
    collate, held = trainer.data_collator, []  # the tokens each collated batch holds, padding included

    def counting(examples):
        batch = collate(examples)
        held.append(batch["input_ids"].numel())
        return batch

    trainer.data_collator = counting
    trainer.train()
    total = time.perf_counter() - start
    done.set()
    peak_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else (peak[0] - base) / 2**20
    result = {
        "times": times,
        "total": total,
        "peak_mb": peak_mb,
        "held_tokens": sum(held),
        "dataset_tokens": sum(len(ids) for ids in trainer.train_dataset["input_ids"])
        if "input_ids" in trainer.train_dataset.column_names
        else None,
    }  # KTO tokenizes into other columns
    if profiler[0] is not None:
        profiler[0].__exit__(None, None, None)
        result["profile"] = top_operators(profiler[0], cuda, steps=len(times) - 1)
    return result


def top_operators(profiler, cuda: bool, steps: int, limit: int = 12) -> list:
    """
    The `limit` operators with the most self time, in ms per profiled step, after the total. On CUDA: the device time
    of the kernels each operator launched, and the total of every kernel (kernels are not listed themselves, so that
    no time counts twice); on CPU: CPU self time.
    """
    from torch.autograd import DeviceType

    averages = profiler.key_averages()
    if cuda:
        total = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
        # "Activity Buffer Request" is the profiler's own bookkeeping, not an operator of the step
        events = [
            (e, e.self_device_time_total)
            for e in averages
            if e.device_type == DeviceType.CPU and e.key != "Activity Buffer Request"
        ]
    else:
        events = [(e, e.self_cpu_time_total) for e in averages]
        total = sum(time for _, time in events)
    events = sorted((pair for pair in events if pair[1] > 0), key=lambda pair: pair[1], reverse=True)
    rows = [["all " + ("kernels" if cuda else "operators"), total / 1e3 / steps, None]]
    rows += [[e.key[:70], time / 1e3 / steps, e.count // steps] for e, time in events[:limit]]
    return rows


def behavior_logps(folder: str, rows: dict, spec: dict) -> list:
    """Per-token log-probs of the completions under the initial model, as TOPRTrainer computes them (not shuffled)."""
    from datasets import Dataset  # in memory: no cache files (and this runs in the caller's process)

    from trl_topr import TOPRConfig, TOPRTrainer

    trainer = TOPRTrainer(
        folder, args=TOPRConfig(**common_args(spec)), train_dataset=Dataset.from_dict(rows), **qlora_configs(spec)
    )
    return [list(v) for v in trainer.train_dataset["behavior_logps"]]


def matmul_tflops() -> float:
    """The device's bf16 matrix-product rate (TFLOP/s): median of 10 timed 8192^3 products on random data."""
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def run_worker(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", f.name], capture_output=True, text=True, cwd=ROOT, check=False
    )
    os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{spec['trainer']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, small grid (about 1 minute)")
    parser.add_argument("--lengths", type=int, nargs="+", help="completion lengths in tokens")
    parser.add_argument("--batches", type=int, nargs="+", help="per-device train batch sizes")
    parser.add_argument("--steps", type=int, help="training steps per run (the first is warmup)")
    parser.add_argument("--reps", type=int, default=1, help="repetitions, trainer order rotated each time")
    parser.add_argument("--fp32", action="store_true", help="fp32 even where bf16 is faster on the hardware")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every trainer runs")
    parser.add_argument("--arch", choices=list(ARCHS), help="model (default: small; tiny with --quick)")
    parser.add_argument("--qlora", action="store_true", help="4-bit NF4 base + LoRA for SFT and TOPR (CUDA)")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=TRAINERS, help="trainers to compare")
    parser.add_argument("--profile", action="store_true", help="print each trainer's top operators (torch.profiler)")
    parser.add_argument("--mix", action="store_true", help="uneven completion lengths: tokens/s of batch layouts")
    parser.add_argument("--max_length", type=int, help="--mix: longest completion (default 512, 128 with --quick)")
    parser.add_argument(
        "--attn_implementation",
        help="the models' attention (e.g. flex_attention, flash_attention_2; default: transformers')",
    )
    parser.add_argument(
        "--full_bf16",
        action="store_true",
        help="weights in bf16 too (full bf16 training, no float32 master weights; CUDA)",
    )
    parser.add_argument(
        "--padding_free",
        action="store_true",
        help="SFT and TOPR padding-free (not with --mix, whose arms choose their layouts)",
    )
    parser.add_argument(
        "--out",
        help="results folder (default: benchmarks/results/cost[-mix][-cuda][-qlora][-profile], outputs/ with --quick)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    name = "cost" + "-mix" * args.mix + "-cuda" * (args.device == "cuda") + "-qlora" * args.qlora
    name += "-bf16" * args.full_bf16 + "-pf" * args.padding_free + "-profile" * args.profile
    out = Path(args.out or ROOT / (f"outputs/{name}-quick" if args.quick else f"benchmarks/results/{name}"))
    started = time.time()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(Path(args.worker).read_text()))), flush=True)
        return ""
    if args.mix:
        return mix_main(args, out, started, argv)
    if not {"SFT", "TOPR"} <= set(args.trainers):
        parser.error("--trainers must include SFT and TOPR (every ratio is TOPR's over another trainer's)")
    if args.qlora and (args.device != "cuda" or "KTO" in args.trainers):
        parser.error("--qlora runs on --device cuda, for SFT and TOPR (+pre)")
    arch = args.arch or ("tiny" if args.quick else "small")
    lengths = args.lengths or ([32, 128] if args.quick else [64, 256])
    batches = args.batches or ([4] if args.quick else [4, 8])
    steps = args.steps or (6 if args.quick else 8)
    trainers = [name for name in TRAINERS if name in args.trainers]
    peak_tflops = matmul_tflops() if args.device == "cuda" else None

    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(str(Path(tmp) / "model"), arch)
        params = matmul_params(folder)
        for length in lengths:
            for batch in batches:
                spec = {
                    "model": folder,
                    "length": length,
                    "batch": batch,
                    "steps": steps,
                    "fp32": args.fp32,
                    "device": args.device,
                    "qlora": args.qlora,
                    "profile": args.profile,
                    "attn": args.attn_implementation,
                    "padding_free": args.padding_free,
                    "full_bf16": args.full_bf16,
                    "out": str(Path(tmp) / "out"),
                    "data": str(Path(tmp) / f"data-{length}-{batch}.json"),
                }
                rows = make_rows(folder, length, steps * batch)
                rows["behavior_logps"] = behavior_logps(folder, rows, spec)
                Path(spec["data"]).write_text(json.dumps(rows))
                runs = {name: [] for name in trainers}
                for rep in range(args.reps):
                    shift = rep % len(trainers)
                    for name in trainers[shift:] + trainers[:shift]:
                        runs[name].append(run_worker(dict(spec, trainer=name, profile=args.profile and rep == 0)))
                results.append((length, batch, runs))
                print(f"done L={length} B={batch} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                table = write(args, out, results, arch, steps, trainers, params, peak_tflops, t0, started, argv)
    return table


def write(args, out, results, arch, steps, trainers, params, peak_tflops, t0, started, argv) -> str:
    """Print and save the table of the cells finished so far (see the module's docstring)."""

    def step(runs):  # median over all steps but the first of each run
        return statistics.median(t for r in runs for t in (r["times"][1:] or r["times"]))

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    pre, kto = "TOPR+pre" in trainers, "KTO" in trainers
    header = ["L", "batch", "SFT s/step", "TOPR s/step", "TOPR/SFT"] + ["TOPR+pre total/SFT total"] * pre
    header += ["KTO s/step", "TOPR/KTO"] * kto + ["SFT peak MB", "mem TOPR/SFT"] + ["mem TOPR+pre/SFT"] * pre
    header += ["mem TOPR/KTO"] * kto + ["SFT TFLOP/s", "TOPR TFLOP/s", "SFT MFU", "TOPR MFU"] * bool(peak_tflops)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for length, batch, runs in results:
        times = {name: step(r) for name, r in runs.items()}
        mem = {name: med(r, "peak_mb") for name, r in runs.items()}
        cells = [length, batch, f"{times['SFT']:.3f}", f"{times['TOPR']:.3f}", f"{times['TOPR'] / times['SFT']:.2f}"]
        if pre:
            cells.append(f"{med(runs['TOPR+pre'], 'total') / med(runs['SFT'], 'total'):.2f}")
        if kto:
            cells += [f"{times['KTO']:.3f}", f"{times['TOPR'] / times['KTO']:.2f}"]
        cells += [f"{mem['SFT']:.0f}", f"{mem['TOPR'] / mem['SFT']:.2f}"]
        if pre:
            cells.append(f"{mem['TOPR+pre'] / mem['SFT']:.2f}")
        if kto:
            cells.append(f"{mem['TOPR'] / mem['KTO']:.2f}")
        if peak_tflops:
            flops = (4 if args.qlora else 6) * params * batch * (PROMPT_TOKENS + length)
            rate = {name: flops / times[name] / 1e12 for name in ("SFT", "TOPR")}
            cells += [
                f"{rate['SFT']:.1f}",
                f"{rate['TOPR']:.1f}",
                f"{rate['SFT'] / peak_tflops:.1%}",
                f"{rate['TOPR'] / peak_tflops:.1%}",
            ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    table = "\n".join(lines)
    if args.device == "cuda":
        import torch

        where = f"{torch.cuda.get_device_name()} (bf16 matrix products measured at {peak_tflops:.0f} TFLOP/s)"
    else:
        where = "CPU"
    precision = "bf16 autocast" if bf16(args.fp32, args.device) else "fp32"
    precision = "bf16 weights, " + precision if args.full_bf16 else precision
    if args.qlora:
        precision = "NF4 4-bit base + LoRA r=16 (all linear layers), " + precision
    extra = "; KTO = policy + reference forwards on matched and mismatched (KL) pairs" if kto else ""
    precision += ", padding-free" * args.padding_free + f", {args.attn_implementation} attention" * bool(
        args.attn_implementation
    )
    title = (
        f"{ARCHS[arch]}, {precision}, {where}, prompt {PROMPT_TOKENS} tokens, {steps} steps, {args.reps} rep(s)"
        f"{extra}; {time.perf_counter() - t0:.0f} s in all"
    )
    profiles = []
    for length, batch, runs in results:
        for name, r in runs.items():
            if "profile" in r[0]:
                unit = "device" if args.device == "cuda" else "CPU"
                profiles.append(f"{name}, L={length}, batch {batch}: {unit} self time per profiled step (ms)\n")
                profiles.append(
                    "| operator | ms/step | calls/step |\n|---|---|---|\n"
                    + "\n".join(
                        f"| {op.replace('|', '/')} | {ms:.2f} | {'' if calls is None else calls} |"
                        for op, ms, calls in r[0]["profile"]
                    )
                    + "\n"
                )
    report = "\n".join([f"{title}\n", table, *(["", *profiles] if profiles else [])])
    print(report)
    cells = [{"length": length, "batch": batch, "runs": runs} for length, batch, runs in results]
    settings = {
        "arch": ARCHS[arch],
        "precision": precision,
        "device": where,
        "prompt_tokens": PROMPT_TOKENS,
        "steps": steps,
        "reps": args.reps,
        "matmul_params": params,
        "peak_tflops": peak_tflops,
    }
    save(
        out,
        {"results.json": {"title": title, "settings": settings, "cells": cells}, "table.md": report + "\n"},
        script=__file__,
        argv=argv,
        started=started,
    )
    return table


def mix_main(args, out: Path, started: float, argv) -> str:
    """--mix: tokens/s of each batch layout on uneven lengths (see the module's docstring)."""
    arch = args.arch or ("tiny" if args.quick else "small")
    longest = args.max_length or (128 if args.quick else 512)
    batches = args.batches or ([4] if args.quick else [8, 32])
    steps_per_epoch = args.steps or (3 if args.quick else 6)
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(str(Path(tmp) / "model"), arch)
        for batch in batches:
            spec = {
                "model": folder,
                "length": longest,
                "batch": batch,
                "steps": 2 * steps_per_epoch,
                "fp32": args.fp32,
                "device": args.device,
                "out": str(Path(tmp) / "out"),
                "attn": args.attn_implementation,
                "data": str(Path(tmp) / f"data-{batch}.json"),
            }
            rows = make_mixed_rows(folder, steps_per_epoch * batch, longest)
            rows["behavior_logps"] = behavior_logps(folder, rows, spec)
            Path(spec["data"]).write_text(json.dumps(rows))
            grouped = str(Path(tmp) / f"data-{batch}-grouped.json")
            Path(grouped).write_text(json.dumps(length_grouped(rows, batch)))
            runs = {name: [] for name in MIX_TRAINERS}
            for rep in range(args.reps):
                shift = rep % len(MIX_TRAINERS)
                for name in MIX_TRAINERS[shift:] + MIX_TRAINERS[:shift]:
                    data = grouped if name.endswith("-grouped") else spec["data"]
                    runs[name].append(run_worker(dict(spec, trainer=name, data=data)))
            tokens = {r["dataset_tokens"] for name in runs for r in runs[name]}
            assert len(tokens) == 1, f"the arms trained different tokens: {runs}"  # the same rows, tokenized alike
            results.append((batch, tokens.pop(), runs))
            print(f"done B={batch} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            table = write_mix(args, out, results, arch, longest, steps_per_epoch, t0, started, argv)
    return table


def write_mix(args, out, results, arch, longest, steps_per_epoch, t0, started, argv) -> str:
    """--mix: print and save the table of the batch sizes finished so far."""

    def rate(runs, tokens):  # the second epoch: every row once; median over the repetitions
        return statistics.median(tokens / sum(r["times"][steps_per_epoch:]) for r in runs)

    header = [
        "batch",
        "rows",
        "tokens/epoch",
        "padded share TOPR",
        "padded share TOPR-grouped",
        *(f"{n} tok/s" for n in MIX_TRAINERS),
        "TOPR-pf/SFT-pf",
        "TOPR-pf/TOPR",
        "TOPR-grouped/TOPR",
        "mem TOPR-pf/TOPR",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch, tokens, runs in results:
        rates = {name: rate(r, tokens) for name, r in runs.items()}
        padded = {name: 1 - 2 * tokens / runs[name][0]["held_tokens"] for name in ("TOPR", "TOPR-grouped")}
        mem = {name: statistics.median(r["peak_mb"] for r in runs[name]) for name in ("TOPR", "TOPR-pf")}
        cells = [
            batch,
            steps_per_epoch * batch,
            tokens,
            f"{padded['TOPR']:.0%}",
            f"{padded['TOPR-grouped']:.0%}",
            *(f"{rates[name]:.0f}" for name in MIX_TRAINERS),
            f"{rates['TOPR-pf'] / rates['SFT-pf']:.2f}",
            f"{rates['TOPR-pf'] / rates['TOPR']:.2f}",
            f"{rates['TOPR-grouped'] / rates['TOPR']:.2f}",
            f"{mem['TOPR-pf'] / mem['TOPR']:.2f}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    table = "\n".join(lines)
    precision = "bf16 autocast" if bf16(args.fp32, args.device) else "fp32"
    where = torch_device_name(args.device)
    precision += f", {args.attn_implementation} attention" * bool(args.attn_implementation)
    title = (
        f"{ARCHS[arch]}, {precision}, {where}, prompt {PROMPT_TOKENS} tokens, completions of 4-{longest} tokens "
        f"(log-uniform), {steps_per_epoch} steps an epoch, tokens/s over epoch 2 of 2, {args.reps} rep(s); "
        f"{time.perf_counter() - t0:.0f} s in all"
    )
    report = f"{title}\n\n{table}"
    print(report)
    cells = [{"batch": batch, "tokens": tokens, "runs": runs} for batch, tokens, runs in results]
    settings = {
        "arch": ARCHS[arch],
        "precision": precision,
        "device": where,
        "prompt_tokens": PROMPT_TOKENS,
        "max_completion_tokens": longest,
        "steps_per_epoch": steps_per_epoch,
        "reps": args.reps,
    }
    save(
        out,
        {"results.json": {"title": title, "settings": settings, "cells": cells}, "table.md": report + "\n"},
        script=__file__,
        argv=argv,
        started=started,
    )
    return table


def torch_device_name(device: str) -> str:
    """The GPU's name on CUDA, else "CPU"."""
    if device != "cuda":
        return "CPU"
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
