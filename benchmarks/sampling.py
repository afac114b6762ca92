"""Throughput of trl-topr's sampler and behavior-log-prob precompute against plain transformers on the same batches.

    python benchmarks/sampling.py            # SmolLM2-135M-Instruct, the README's one-shot arithmetic prompts: ~5 min
    python benchmarks/sampling.py --quick    # conftest's tiny Llama: seconds (tests/test_benchmarks.py)
    python benchmarks/sampling.py --vllm     # adds vLLM beside transformers (in vLLM's environment, docs/sampling.md)

In one process, on the same model, prompts and batches, alternating A and B --reps times (medians reported):
  sampling    A: `generate_completions` (prompt tokenization, left padding, generate, cut at EOS, decode)
              B: the same batches through `tokenizer.pad` + `model.generate` directly, same seed and settings
  precompute  A: TOPRTrainer's behavior-log-prob precompute (dataloader, autocast, fused LM head, gather)
              B: a plain loop `model(input_ids, attention_mask)` + log_softmax + gather over the same collated batches
              and, to locate the difference, the precompute's forward alone (`trl_topr.logprobs.completion_logps`,
              fused LM head) over those batches, and the weights hash alone (the precompute's cache key, for datasets
              read from files; none here)
Tokens/s counts generated tokens (sampling) and all tokens of the scored sequences (precompute).

With --vllm, first, alternating too: `generate_completions` with a colocated vLLM engine (`use_vllm=True`) against
`generate_completions` with transformers, on the same prompts and settings; plus the engine's start-up and its
per-round weight reload from a saved folder, and the throughput of one loop round's sampling counting both.

Writes `results.json` and `table.md`, with their provenance, to --out (default benchmarks/results/sampling, or
sampling-vllm with --vllm).
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from provenance import save


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]


def prompts_and_model(quick: bool, work: str):
    if quick:
        from trl_topr.testing import build_tiny_model

        folder = build_tiny_model(str(Path(work) / "tiny"))
        return [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(16)], folder
    from trl_topr.embedded import smollm2_path
    from trl_topr.tasks import arithmetic_problems, few_shot_prompts

    problems = arithmetic_problems(0)
    return list(few_shot_prompts(problems[1:33], problems[:1])["prompt"]), smollm2_path()


def direct_generate(model, tokenizer, prompts, *, num_samples, max_new_tokens, batch_size, seed):
    """Plain transformers: what a user would write without the sampler."""
    import torch
    from transformers import set_seed

    set_seed(seed)
    generated = 0
    with torch.no_grad():
        for first in range(0, len(prompts), batch_size):
            texts = [
                tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                for p in prompts[first : first + batch_size]
            ]
            inputs = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
            inputs = inputs.to(model.device)
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=num_samples,
                pad_token_id=tokenizer.pad_token_id,
            )[:, inputs["input_ids"].size(1) :]
            ended = (out == tokenizer.eos_token_id).int()
            # tokens up to and including the first EOS (all of them when there is none)
            lengths = torch.where(ended.any(-1), ended.argmax(-1) + 1, torch.full_like(ended[:, 0], out.size(1)))
            generated += int(lengths.sum())
    return generated


def plain_logps(model, batch):
    """Per-token log-probs of the completion tokens from materialized logits: the plain transformers way."""
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return logps * (batch["labels"][:, 1:] != -100)


def forward_loop(score, batches, autocast) -> int:
    """Score every batch with `score(batch)` under no_grad and autocast, converting to lists as the precompute does;
    return the number of tokens scored."""
    import torch

    tokens = 0
    with torch.no_grad(), autocast():
        for batch in batches:
            score(batch).sum(-1).tolist()
            tokens += int(batch["attention_mask"].sum())
    return tokens


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model (seconds)")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions of each pair")
    parser.add_argument("--num_samples", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=16, help="prompts per generate call / rows per forward")
    parser.add_argument("--vllm", action="store_true", help="add the vLLM backend (needs vLLM)")
    parser.add_argument(
        "--out", help="results folder (default: benchmarks/results/sampling[-vllm], outputs/ with --quick)"
    )
    args = parser.parse_args(argv)
    name = "sampling" + ("-vllm" if args.vllm else "")
    out = Path(args.out or ROOT / (f"outputs/{name}-quick" if args.quick else f"benchmarks/results/{name}"))
    started = time.time()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from trl_topr import TOPRConfig, TOPRTrainer, generate_completions
    from trl_topr.data import BEHAVIOR_LOGPS  # internal: the column the precompute writes, dropped to redo it
    from trl_topr.distributed import weights_fingerprint  # internal: the check that both stages saw the same weights
    from trl_topr.generation import SamplingSettings
    from trl_topr.logprobs import completion_logps  # internal: the precompute's forward alone, to place the difference

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        prompts, folder = prompts_and_model(args.quick, work)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        cuda = torch.cuda.is_available()  # on a GPU: bf16 weights, as a GPU user loads them
        dtype = torch.bfloat16 if cuda else torch.float32
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda" if cuda else "cpu").eval()
        settings = {
            "num_samples": args.num_samples,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size,
        }
        sampled = SamplingSettings(temperature=1.0, top_k=0, **settings)
        vllm_table, vllm_results = (
            vllm_comparison(model, tokenizer, prompts, work, args, settings) if args.vllm else ("", None)
        )
        times = {"sampler": [], "generate": [], "precompute": [], "forward": []}
        tokens = {}
        for rep in range(args.reps):
            for name in ["sampler", "generate"] if rep % 2 == 0 else ["generate", "sampler"]:
                start = time.perf_counter()
                if name == "sampler":
                    torch.manual_seed(rep)
                    _, ids, _ = generate_completions(model, tokenizer, prompts, sampled, progress=False)
                    tokens[name] = sum(map(len, ids))
                else:
                    tokens[name] = direct_generate(model, tokenizer, prompts, seed=rep, **settings)
                times[name].append(time.perf_counter() - start)

        # The sampled completions, scored by the trainer's precompute and by a plain forward loop.
        torch.manual_seed(0)
        completions, _, _ = generate_completions(model, tokenizer, prompts, sampled, progress=False)
        rows = Dataset.from_dict(
            {
                "prompt": [p for p in prompts for _ in range(args.num_samples)],
                "completion": completions,
                "reward": [1.0] * len(completions),
            }
        )
        config = TOPRConfig(
            output_dir=str(Path(work) / "out"),
            use_cpu=not torch.cuda.is_available(),
            report_to="none",
            precompute_behavior_batch_size=args.batch_size,
        )
        trainer = TOPRTrainer(model, args=config, train_dataset=rows, processing_class=tokenizer)
        precision = "bf16 autocast" if config.bf16 else "fp32"  # the library's choice for this hardware
        tokenized = trainer.train_dataset.remove_columns(BEHAVIOR_LOGPS)
        collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
        columns = tokenized.select_columns(["input_ids", "labels"])
        batches = [
            collator([columns[j] for j in range(i, min(i + args.batch_size, len(columns)))])
            for i in range(0, len(columns), args.batch_size)
        ]
        batches = [{k: v.to(model.device) for k, v in batch.items()} for batch in batches]
        scorers = {
            "forward": lambda batch: plain_logps(model, batch),
            "fused": lambda batch: completion_logps(trainer.model, batch)[0],
        }  # the trainer's own
        times.update(fused=[], hash=[])
        for rep in range(args.reps):
            order = ["precompute", "forward", "fused"]
            for name in order[rep % 3 :] + order[: rep % 3]:
                start = time.perf_counter()
                if name == "precompute":
                    trainer.precompute_behavior_logps(tokenized, "train")
                    tokens[name] = sum(map(len, tokenized["input_ids"]))
                else:
                    tokens[name] = forward_loop(scorers[name], batches, trainer.accelerator.autocast)
                times[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            weights_fingerprint(trainer.model)
            times["hash"].append(time.perf_counter() - start)

    hash_s = statistics.median(times.pop("hash"))
    rate = {name: tokens[name] / statistics.median(t) for name, t in times.items()}
    header = ["stage", "trl-topr tokens/s", "plain transformers tokens/s", "ratio (target >= 0.9)"]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        f"| sampling | {rate['sampler']:.0f} | {rate['generate']:.0f} | {rate['sampler'] / rate['generate']:.2f} |",
        f"| precompute | {rate['precompute']:.0f} | {rate['forward']:.0f} | "
        f"{rate['precompute'] / rate['forward']:.2f} |",
        f"| precompute's forward alone (fused LM head) | {rate['fused']:.0f} | {rate['forward']:.0f} | "
        f"{rate['fused'] / rate['forward']:.2f} |",
    ]
    table = "\n".join(lines)
    model_name = "tiny 2-layer Llama (conftest)" if args.quick else "SmolLM2-135M-Instruct"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    title = (
        f"{model_name}, {str(dtype).removeprefix('torch.')} weights, {device}: {len(prompts)} prompts x "
        f"{args.num_samples} samples, {args.max_new_tokens} new tokens, batch {args.batch_size}; precompute in "
        f"{precision}; median of {args.reps} alternating reps; weights hash (the cache key of datasets read from "
        f"files) {hash_s:.2f} s; tokens per rep: " + ", ".join(f"{k} {v}" for k, v in tokens.items())
    )
    results = {
        "title": title,
        "settings": {
            **settings,
            "reps": args.reps,
            "model": model_name,
            "device": device,
            "precompute_precision": precision,
        },
        "tokens_per_s": rate,
        "tokens": tokens,
        "seconds": times,
        "hash_seconds": hash_s,
        "vllm": vllm_results,
    }
    report = (vllm_table + "\n\n" if args.vllm else "") + f"{title}\n\n{table}\n"
    save(out, {"results.json": results, "table.md": report}, script=__file__, argv=argv, started=started)
    print(f"{title}\n")
    print(table)
    return table if not args.vllm else vllm_table + "\n\n" + table


def vllm_comparison(model, tokenizer, prompts, work, args, settings) -> tuple[str, dict]:
    """vLLM (colocated, as the loop starts it) against transformers, both through `generate_completions`: its
    title and table, and its results."""
    import torch

    from trl_topr import TOPRLoopConfig, generate_completions
    from trl_topr.generation import SamplingSettings, VLLMEngine

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    loop_args = TOPRLoopConfig(use_vllm=True, vllm_max_model_length=2048)
    start = time.perf_counter()
    engine = VLLMEngine.from_config(model, tokenizer, loop_args, bf16=False)
    start_s = time.perf_counter() - start
    folder = str(Path(work) / "round")
    model.save_pretrained(folder)
    times, tokens, reload_s = {"vllm": [], "transformers": []}, {}, []
    for rep in range(args.reps):
        for name in ["vllm", "transformers"] if rep % 2 == 0 else ["transformers", "vllm"]:
            torch.manual_seed(rep)
            start = time.perf_counter()
            sampled = SamplingSettings(temperature=1.0, top_k=0, seed=rep, **settings)
            _, ids, _ = generate_completions(
                model,
                tokenizer,
                prompts,
                sampled,
                progress=False,
                bf16=False,
                engine=engine if name == "vllm" else None,
            )
            times[name].append(time.perf_counter() - start)
            tokens[name] = sum(map(len, ids))
        start = time.perf_counter()
        engine.vllm_generation.reload_weights(folder)  # timed: the engine itself skips a folder it holds
        reload_s.append(time.perf_counter() - start)
    rate = {name: tokens[name] / statistics.median(t) for name, t in times.items()}
    vllm_round = tokens["vllm"] / (statistics.median(times["vllm"]) + statistics.median(reload_s))
    header = ["sampling backend", "tokens/s", "ratio to transformers (target >= 2)"]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        f"| transformers `generate` | {rate['transformers']:.0f} | 1.00 |",
        f"| vLLM, colocated | {rate['vllm']:.0f} | {rate['vllm'] / rate['transformers']:.2f} |",
        f"| vLLM, with the round's weight reload | {vllm_round:.0f} | {vllm_round / rate['transformers']:.2f} |",
        f"| vLLM, one round with the engine start-up | "
        f"{tokens['vllm'] / (statistics.median(times['vllm']) + start_s):.0f} | "
        f"{tokens['vllm'] / (statistics.median(times['vllm']) + start_s) / rate['transformers']:.2f} |",
    ]
    table = "\n".join(lines)
    title = (
        f"vLLM against transformers, fp32, {len(prompts)} prompts x {args.num_samples} samples, "
        f"{args.max_new_tokens} new tokens, batch {args.batch_size}, median of {args.reps} alternating reps: "
        f"engine start-up {start_s:.0f} s, weight reload {statistics.median(reload_s):.2f} s"
    )
    print(f"{title}\n\n{table}\n")
    results = {
        "title": title,
        "tokens_per_s": rate,
        "round_tokens_per_s": vllm_round,
        "tokens": tokens,
        "seconds": times,
        "start_seconds": start_s,
        "reload_seconds": reload_s,
    }
    return f"{title}\n\n{table}", results


if __name__ == "__main__":
    main()
