"""The paper's iterative TOPR: sample with the current model, score, curate, train one epoch, evaluate, save, repeat."""

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.logging import get_logger
from datasets import Dataset
from peft import PeftModel
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from trl.trainer.utils import create_model_from_path

from .composition import effective_positive_fraction
from .config import TOPRConfig
from .data import REWARD
from .distributed import check_saves_whole_weights, full_weights, unsharded_loading
from .evaluation import evaluate_policy
from .sampling import RewardFuncs, behavior_logps_mismatch, sample_completions
from .trainer import TOPRTrainer
from .vllm import vllm_generation_from_config


logger = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOTTED = ("reward", "pass@1", "invalid_rate", "effective_positive_fraction")


def read_rounds(output_dir: str) -> list[dict[str, Any]]:
    """
    Per-round metrics written by [`run_topr_loop`] so far (round 0 evaluates the initial model).

    A last line that is not complete JSON (a loop killed while an older version appended it) is an unfinished round:
    it is left out, with a warning, and the loop redoes that round.

    Args:
        output_dir (`str`):
            The loop's output folder.

    Returns:
        `list[dict[str, Any]]`: one dict per completed round, in order.

    Raises:
        `ValueError`: when a line other than the last is not JSON (the file was edited or damaged).
    """
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rounds = []
    for number, line in enumerate(lines, start=1):
        try:
            rounds.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}, is not JSON ({error}): only a last line cut by a kill is "
                                 "read as an unfinished round. Fix or remove the line.") from error
            warnings.warn(f"{path} ends with a cut line (a round that was being recorded when the loop stopped): "
                          "reading it as unfinished, so the loop redoes that round.", stacklevel=2)
    return rounds


def plot_rounds(rounds: list[dict[str, Any]], path: str) -> None:
    """
    Plot the reward, pass@1, invalid rate and effective positive fraction per round to a PNG file.

    Args:
        rounds (`list[dict[str, Any]]`):
            Per-round metrics, as returned by [`read_rounds`].
        path (`str`):
            PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
    for axis, name in zip(axes, PLOTTED, strict=True):
        points = [(r["round"], r[name]) for r in rounds if r.get(name) is not None]
        axis.plot([x for x, _ in points], [y for _, y in points], marker="o")
        axis.set_title(name)
        axis.set_xlabel("round")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run_topr_loop(
    model: str,
    train_prompts: Dataset,
    reward_funcs: RewardFuncs,
    args: TOPRConfig,
    *,
    num_rounds: int = 1,
    reward_weights: list[float] | None = None,
    eval_prompts: Dataset | None = None,
    correct_func: Callable | None = None,
    answer_func: Callable[[str], str | None] | None = None,
    curate: Callable[[Dataset], Dataset] | None = None,
    processing_class: PreTrainedTokenizerBase | None = None,
    peft_config=None,
    quantization_config=None,
    sampling_kwargs: dict[str, Any] | None = None,
    eval_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """
    Iterative TOPR, as in the paper: each round samples with the current model (mu = that model), scores, curates,
    trains one epoch of TOPR on the result, evaluates and saves.

    Everything goes to `args.output_dir`: `round-<r>/` holds the model after round r, its sampled dataset
    (`samples.jsonl`) and its training logs (`trainer_state.json`), `metrics.jsonl` one line per completed round (round 0 evaluates the initial model) and
    `metrics.png` their plot. A round counts as completed once its line is written (the file is replaced whole, so a
    kill never leaves half a line): started again, the loop resumes after the last completed round, redoing an
    interrupted one from its start. Under `accelerate launch`, every
    process runs the loop: sampling and evaluation are split across the processes, training is data-parallel, and the
    main process writes the files.

    Args:
        model (`str`):
            Id or path of the initial model.
        train_prompts ([`~datasets.Dataset`]):
            Prompts to sample from each round (`prompt` column plus what the reward functions read).
        reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`):
            Reward functions with TRL GRPO's signature, see [`sample_completions`].
        args ([`TOPRConfig`]):
            Training configuration of every round; `output_dir` is the loop's folder and each round trains one
            epoch. With `use_vllm` (TRL's `vllm_*` options), vLLM samples and evaluates: started once, it reloads each
            round's saved folder in place, and its log-probs are compared with the trainer's
            (`behavior_logps_mismatch_*` metrics); see [`~trl_topr.config.VLLMArguments`].
        num_rounds (`int`, *optional*, defaults to `1`):
            Total number of rounds.
        reward_weights (`list[float]`, *optional*):
            Weights of the reward functions.
        eval_prompts ([`~datasets.Dataset`], *optional*):
            Held-out prompts evaluated after every round with [`evaluate_policy`] (needs `correct_func` and
            `answer_func`).
        correct_func (`Callable`, *optional*):
            Reward function whose value > 0 means correct, for the evaluation.
        answer_func (`Callable[[str], str | None]`, *optional*):
            Final-answer extractor, for maj@k and the invalid rate.
        curate (`Callable[[Dataset], Dataset]`, *optional*):
            Transformation of each round's samples before training (e.g. [`~trl_topr.curation.anna_karenina`]).
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer; loaded from `model` if `None`.
        peft_config ([`~peft.PeftConfig`], *optional*):
            Train a fresh adapter each round (LoRA). It is merged into the model saved for the next round, in the
            precision of `args.model_init_kwargs`; the adapter alone is kept in `round-<r>/adapter`.
        quantization_config ([`~transformers.BitsAndBytesConfig`], *optional*):
            Load each round's model quantized, for sampling and training (QLoRA with `peft_config`).
        sampling_kwargs (`dict[str, Any]`, *optional*):
            Keyword arguments of [`sample_completions`] (`num_samples`, `temperature`, `top_k`, `max_new_tokens`...).
        eval_kwargs (`dict[str, Any]`, *optional*):
            Keyword arguments of [`evaluate_policy`].

    Returns:
        `list[dict[str, Any]]`: the metrics of every completed round, round 0 included.
    """
    if eval_prompts is not None and (correct_func is None or answer_func is None):
        raise ValueError("Evaluating `eval_prompts` needs `correct_func` and `answer_func`.")
    state = PartialState()  # under `accelerate launch`, every process runs the loop; the main one writes
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    processing_class = processing_class or AutoTokenizer.from_pretrained(model)
    sampling_kwargs, eval_kwargs = dict(sampling_kwargs or {}), dict(eval_kwargs or {})
    model_init_kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        if peft_config is None:
            raise ValueError("A quantized model cannot be fully fine-tuned: give a `peft_config` too (QLoRA).")
        model_init_kwargs["quantization_config"] = quantization_config

    def load(path: str):
        return create_model_from_path(path, **model_init_kwargs)

    def save_for_next_round(trainer: TOPRTrainer, previous: str, round_dir: Path) -> None:
        if peft_config is None:
            trainer.save_model(str(round_dir))
        else:
            trainer.save_model(str(round_dir / "adapter"))
        if peft_config is not None and state.is_main_process:  # merge the adapter into an unquantized copy
            with unsharded_loading():  # of the round's starting model, on this process alone, whole under ZeRO-3
                base = create_model_from_path(previous, **(args.model_init_kwargs or {}))
            merged = PeftModel.from_pretrained(base, str(round_dir / "adapter")).merge_and_unload()
            merged.save_pretrained(str(round_dir))
            processing_class.save_pretrained(str(round_dir))
            shutil.copy(round_dir / "adapter" / "README.md", round_dir / "README.md")
        state.wait_for_everyone()  # the main process writes the folder; every process's engine reloads from it

    sampler = None  # vLLM (`args.use_vllm`), started once with the first model, then reloaded from round folders
    sampler_folder = None  # the folder whose weights the sampler holds (`None`: the initial model)

    def sampler_for(policy, folder: str | None):
        nonlocal sampler, sampler_folder
        if args.use_vllm and sampler is None:
            sampler = vllm_generation_from_config(policy, processing_class, args)
            sampler_folder = None if folder == model else folder
        if sampler is not None and folder != model and folder != sampler_folder:
            sampler.reload_weights(folder)  # the weights trained last round, saved whole, without a restart
            sampler_folder = folder
        return sampler

    def evaluate(policy, folder: str, engine=None) -> dict[str, float]:
        if eval_prompts is None:
            return {}
        logger.info(f"Evaluating on {len(eval_prompts)} held-out prompts")
        vllm_generation = sampler_for(policy, folder)
        # transformers reads the weights whole (ZeRO-3: gathered once, with the training engine's hooks removed)
        with full_weights(policy, engine) if vllm_generation is None else contextlib.nullcontext():
            return evaluate_policy(
                policy, processing_class, eval_prompts, correct_func, answer_func, vllm_generation=vllm_generation,
                **{"bf16": args.bf16, **eval_kwargs},
            )  # in the training precision unless `eval_kwargs` says otherwise

    rounds = read_rounds(str(output_dir))  # the completed rounds: the loop resumes after the last

    def record(metrics: dict[str, Any]) -> None:
        rounds.append(metrics)
        if state.is_main_process:  # the line marks the round as completed: the file is replaced whole, never cut
            partial = output_dir / f"{METRICS_FILE}.partial"
            partial.write_text("".join(json.dumps(r) + "\n" for r in rounds))
            os.replace(partial, output_dir / METRICS_FILE)
            plot_rounds(rounds, str(output_dir / "metrics.png"))
        state.wait_for_everyone()
        shown = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        logger.info(f"Round {metrics['round']} done: {shown}")

    if not rounds:
        record({"round": 0, **evaluate(load(model), model)})
    for round_index in range(rounds[-1]["round"] + 1, num_rounds + 1):
        round_dir = output_dir / f"round-{round_index}"
        if state.is_main_process:
            shutil.rmtree(round_dir, ignore_errors=True)  # an interrupted attempt is redone from its start
            round_dir.mkdir(parents=True)
        state.wait_for_everyone()
        previous = model if round_index == 1 else str(output_dir / f"round-{round_index - 1}")
        policy = load(previous)

        logger.info(f"Round {round_index}/{num_rounds}: sampling completions of {len(train_prompts)} prompts")
        samples = sample_completions(
            policy, train_prompts, reward_funcs, processing_class=processing_class, reward_weights=reward_weights,
            seed=args.seed + round_index, args=args, vllm_generation=sampler_for(policy, previous), **sampling_kwargs,
        )  # fmt: skip
        if state.is_main_process:
            samples.to_json(str(round_dir / "samples.jsonl"))
        train_data = curate(samples) if curate is not None else samples
        # the model is loaded here, and the loop's caller publishes the final model: not every round's trainer
        round_args = dataclasses.replace(
            args, output_dir=str(round_dir), num_train_epochs=1, max_steps=-1, model_init_kwargs=None, push_to_hub=False
        )
        if args.target_positive_fraction is not None and len(set(train_data[REWARD])) < 2:
            # no baseline changes a one-sided round's composition: train it with baseline 0, as the online trainer
            # does for such a batch, rather than stop the loop
            logger.info(f"Round {round_index}/{num_rounds}: every reward is {train_data[REWARD][0]}, so "
                        "`target_positive_fraction` cannot be met: this round trains with baseline 0")
            round_args = dataclasses.replace(round_args, target_positive_fraction=None)
        trainer = TOPRTrainer(
            policy, args=round_args, train_dataset=train_data, processing_class=processing_class,
            peft_config=peft_config,
        )  # fmt: skip
        check_saves_whole_weights(trainer)  # the next round loads this round's saved model
        positives = sum(r - trainer.baseline >= 0 for r in train_data[REWARD]) / len(train_data)
        logger.info(f"Round {round_index}/{num_rounds}: training one epoch of TOPR on {len(train_data)} completions "
                    f"({positives:.0%} positive)")
        train_loss = trainer.train().training_loss
        if state.is_main_process:  # the round's training logs (TOPR's metrics per step), as in a Trainer checkpoint
            trainer.state.save_to_json(str(round_dir / "trainer_state.json"))
        save_for_next_round(trainer, previous, round_dir)
        rewards = list(samples[REWARD])
        record(
            {
                "round": round_index,
                "reward": sum(rewards) / len(rewards),
                "positive_fraction": sum(r >= 0 for r in rewards) / len(rewards),
                "effective_positive_fraction": effective_positive_fraction(train_data[REWARD], trainer.baseline),
                "num_samples": len(samples),
                "num_train_rows": len(train_data),
                "train_loss": train_loss,
                **behavior_logps_mismatch(samples),
                **evaluate(trainer.model, str(round_dir), getattr(trainer, "deepspeed", None)),
            }
        )
        del trainer, policy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if sampler is not None:
        sampler.close()  # keeps the processes' torch.distributed group for the script's next steps
    return read_rounds(str(output_dir))
