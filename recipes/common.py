"""What the recipes share: the GSM8K-format problems (GSM8K itself or the offline arithmetic task of
`trl_topr.tasks`, with its few-shot prompts), the per-round evaluation table, publishing to the Hub, and the progress
messages. Each recipe imports this module, never another recipe."""

import dataclasses
import json
from pathlib import Path

import datasets
import transformers
from datasets import load_dataset
from huggingface_hub import HfApi

from trl_topr import TOPRConfig, TOPRLoopConfig, show_messages
from trl_topr.tasks import arithmetic_problems, few_shot_prompts, solution_text  # noqa: F401  (the embedded task)


def load_problems(script_args, seed: int) -> tuple[list[dict], list[dict]]:
    """Training and test questions (dicts with `question` and `answer`) of the task that `script_args` chooses
    (`task`, `dataset_path`)."""
    if script_args.task == "arithmetic":
        problems = arithmetic_problems(seed)
        return problems[:160], problems[160:]
    if script_args.dataset_path is not None:
        files = {split: str(Path(script_args.dataset_path) / f"{split}.jsonl") for split in ("train", "test")}
        data = load_dataset("json", data_files=files)
    else:
        data = load_dataset("openai/gsm8k", "main")
    return list(data["train"]), list(data["test"])


def set_model_init_kwargs(training_args: TOPRConfig, model_args) -> None:
    """Load the models with TRL's `ModelConfig` options (`--dtype`, `--attn_implementation`, ...), under what
    `training_args.model_init_kwargs` sets explicitly, as TRL's scripts do."""
    options = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    training_args.model_init_kwargs = {**options, **(training_args.model_init_kwargs or {})}


def model_name(model: str) -> str:
    """The name of the model at `model` for the summary: where its weights were converted from (the embedded
    SmolLM2-135M-Instruct's GGUF file), else its id or folder."""
    return getattr(transformers.AutoConfig.from_pretrained(model), "converted_from", None) or model


def evaluation_table(rounds: list[dict]) -> str:
    """Markdown table of the per-round evaluation (round 0 is the initial model)."""
    names = [
        n
        for n in (
            "pass@1_greedy",
            "pass@1",
            *[k for k in rounds[0] if k.startswith("maj@")],
            "invalid_rate",
            "tool_call_rate",
            "reward",
            "baseline",
            "effective_positive_fraction",
        )
        if any(n in r for r in rounds)
    ]
    lines = ["| round | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in rounds:
        cells = [f"{r[n]:.3f}" if isinstance(r.get(n), float) else "" for n in names]
        lines.append(f"| {r['round']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def publish(
    folder: Path,
    rounds: list[dict],
    script_args,
    loop_args: TOPRLoopConfig,
    training_args: TOPRConfig,
    title: str = "GSM8K evaluation per round",
    extra: str = "",
    commit_message: str = "TOPR on GSM8K",
) -> None:
    """Add the per-round evaluation (then `extra`, markdown ending in a blank line) and the recipe's settings (its
    own, the loop's and TOPR's) to the model card, and upload the folder to the Hub."""
    card = folder / "README.md"
    settings = {**vars(script_args), **dataclasses.asdict(loop_args)}
    settings.update(
        {
            k: getattr(training_args, k)
            for k in (
                "loss_type",
                "ratio_level",
                "loss_normalization",
                "baseline",
                "target_positive_fraction",
                "learning_rate",
            )
        }
    )
    card.write_text(
        card.read_text()
        + f"\n## {title}\n\nRound 0 is the initial model.\n\n"
        + evaluation_table(rounds)
        + "\n\n"
        + extra
        + "## Recipe settings\n\n```json\n"
        + json.dumps(settings, indent=2)
        + "\n```\n"
    )
    if not training_args.push_to_hub:
        return
    repo_id = training_args.hub_model_id or Path(training_args.output_dir).name
    api = HfApi(token=training_args.hub_token)
    api.create_repo(repo_id, private=training_args.hub_private_repo, exist_ok=True)
    api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message=commit_message,
        ignore_patterns=["samples.jsonl", "checkpoint-*", "adapter/*"],
    )


def refuse_publishing_nothing(loop_args: TOPRLoopConfig, training_args: TOPRConfig) -> None:
    """Refuse `--push_to_hub` with `--num_rounds 0` before anything runs: evaluating alone trains no model to
    publish."""
    if training_args.push_to_hub and loop_args.num_rounds == 0:
        raise ValueError(
            "--push_to_hub with --num_rounds 0: evaluating alone trains no model to publish. Drop "
            "--push_to_hub, or train at least one round."
        )


def show_progress() -> None:
    """Print the loop's progress messages, and leave out the libraries' per-step progress bars (loading weights,
    tokenizing): the sampling and training bars remain."""
    show_messages()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
