"""Multi-turn sampling with a tool on the transformers engine: as it was, with the key/values kept between turns, and
with every key/value computed once (kept between turns, the prompts' shared prefix once per batch, a preallocated
cache).

    python benchmarks/tool_turns.py            # the calculator configuration's sampling (SmolLM2-135M): ~10 min
    python benchmarks/tool_turns.py --quick    # conftest-like tiny model (seconds; tests/test_benchmarks.py)

What `recipes/configs/embedded_cpu_calculator.yaml` samples in a round: its 16 training prompts (3 worked examples
calling the calculator, the tools' schemas) x 4 samples, 96 new tokens per trajectory, at most 2 rounds of calls,
batches of 16, seed 0, through `trl_topr.rollout.rollout` on the transformers engine. In one process, on the same
model, prompts and settings, each engine --reps times, in a rotating order (medians reported):
  before: `TransformersEngine(turn_cache=False, shared_prefix=False, static_cache=False)`, the engine before it kept
          anything between turns: every turn computes its whole sequence (each prompt once for its samples), in a
          cache that grows a token at a time
  turns:  `TransformersEngine(shared_prefix=False, static_cache=False)`: a turn after a tool's result computes only
          its new tokens
  after:  `TransformersEngine()`, the defaults: that, the prefix the prompts share (the worked examples and the tools'
          schemas) computed once per batch, and the key/values in a cache allocated once per batch
Reports the seconds of each, the speed-up of each against `before`, the tokens generated, and whether the greedy
trajectories of every engine are the same token for token (sampled ones may part where two sums round differently).

Writes `results.json` and `table.md`, with their provenance, to --out (default benchmarks/results/tool-turns).
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
    """The calculator configuration's training prompts and model (a tiny one with a tool template with --quick)."""
    from trl_topr.tasks import arithmetic_problems, few_shot_prompts

    problems = arithmetic_problems(0)[:160]  # the recipe's training questions, its seed 0
    shots, train = problems[:3], problems[3:19]
    prompts = list(few_shot_prompts(train, shots, tools=True)["prompt"])
    if quick:
        from trl.chat_template_utils import qwen2_5_chat_template

        from trl_topr.testing import build_tiny_model

        return prompts[:4], build_tiny_model(str(Path(work) / "tiny"), chat_template=qwen2_5_chat_template)
    from trl_topr.embedded import smollm2_path

    return prompts, smollm2_path()


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model (seconds)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each engine, in rotating order")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/tool-turns, outputs/ with --quick)")
    args = parser.parse_args(argv)
    out = Path(args.out or ROOT / ("outputs/tool-turns-quick" if args.quick else "benchmarks/results/tool-turns"))
    started = time.time()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_topr import with_tool_template
    from trl_topr.generation import SamplingSettings, TransformersEngine
    from trl_topr.precision import bf16_is_faster  # internal: the library's precision rule
    from trl_topr.rollout import prepare_tool_calling, rollout  # internal: the rollout under each engine variant
    from trl_topr.tasks import calculator
    from trl_topr.tokens import prompt_ids  # internal: the prompts' ids, as the rollout takes them

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        prompts, path = prompts_and_model(args.quick, work)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = with_tool_template(AutoTokenizer.from_pretrained(path))
    tools = [calculator]
    prepare_tool_calling(tokenizer, tools)
    ids = [prompt_ids(tokenizer, prompt, tools) for prompt in prompts]
    sampled = SamplingSettings(num_samples=4, temperature=1.0, top_k=0, max_new_tokens=96, batch_size=16, seed=0)
    bf16 = bf16_is_faster(model.device)
    options = {
        "before": dict(turn_cache=False, shared_prefix=False, static_cache=False),
        "turns": dict(shared_prefix=False, static_cache=False),
        "after": {},
    }
    engines = {name: TransformersEngine(model, tokenizer, bf16=bf16, **kwargs) for name, kwargs in options.items()}

    def run(name: str, settings: SamplingSettings):
        start = time.perf_counter()
        trajectories = rollout(engines[name], tokenizer, prompts, ids, settings, tools, 2, progress=False)
        return time.perf_counter() - start, trajectories

    names = list(engines)
    seconds, tokens, calls, greedy = {name: [] for name in names}, {}, {}, {}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # no engine always runs first
            elapsed, trajectories = run(name, sampled)
            seconds[name].append(elapsed)
            tokens[name] = sum(sum(mask) for mask in trajectories.tool_mask)
            calls[name] = sum(trajectories.tool_calls) / len(trajectories.tool_calls)
    for name in names:
        greedy[name] = run(name, sampled.greedy())[1]
    same_greedy = all(
        greedy[name].completion_ids == greedy["before"].completion_ids
        and greedy[name].tool_mask == greedy["before"].tool_mask
        for name in names
    )
    median = {name: statistics.median(values) for name, values in seconds.items()}
    results = {
        "trajectories": len(prompts) * sampled.num_samples,
        "precision": "bf16" if bf16 else "fp32",
        "engines": options,
        "seconds": seconds,
        "median_seconds": median,
        "speedup": {name: median["before"] / median[name] for name in names},
        "generated_tokens": tokens,
        "tool_calls_per_trajectory": calls,
        "greedy_same": same_greedy,
        "greedy_tool_calls": sum(greedy["after"].tool_calls),
    }
    report = "\n".join(
        [
            "| sampling with the calculator | before | key/values kept between turns | "
            "and the shared prefix once, a preallocated cache (defaults) |",
            "|---|---|---|---|",
            f"| seconds (median of {args.reps}) | " + " | ".join(f"{median[name]:.1f}" for name in names) + " |",
            "| speed-up against before | " + " | ".join(f"{results['speedup'][name]:.2f}" for name in names) + " |",
            "| generated tokens | " + " | ".join(str(tokens[name]) for name in names) + " |",
            "| tool calls per trajectory | " + " | ".join(f"{calls[name]:.3f}" for name in names) + " |",
            f"| greedy trajectories the same | {'yes' if same_greedy else 'no'} | | |",
        ]
    )
    print(report)
    save(out, {"results.json": results, "table.md": report}, script=__file__, argv=argv, started=started)
    return report


if __name__ == "__main__":
    main()
