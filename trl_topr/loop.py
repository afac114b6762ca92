"""The paper's iterative TOPR: sample with the current model, score, curate, train, evaluate, save, repeat.

[`run_topr_loop`] reads as the paper's round; the helpers below it hold the rest: loading and saving each round's model
(the LoRA merge, ZeRO-3's whole-weight loading), the round's trainer, and the metrics file. Generation goes through one
[`~trl_topr.Sampler`], built once: its engine is started once and given each round's weights."""

import dataclasses
import importlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import PartialState
from accelerate.logging import get_logger
from accelerate.utils.memory import clear_device_cache
from datasets import Dataset
from peft import PeftModel
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from trl.trainer.utils import create_model_from_path

from .baseline import effective_positive_fraction
from .config import TOPRConfig
from .data import REWARD
from .distributed import (
    check_saves_whole_weights,
    give_back_freed_memory,
    naming_the_step,
    on_main_process,
    release_trainer,
    together,
    unsharded_loading,
)
from .environments import EnvironmentFactory
from .generation import GenerationEngine
from .loop_config import TOPRLoopConfig
from .replay import (
    SAMPLE_ROUND,
    TRAIN_ROWS_FILE,
    metrics_by_age,
    read_train_rows,
    replayed_rounds,
    with_replayed_rows,
)
from .sampling import (
    TOOL_CALL_COUNT,
    TOOL_FAILURE_COUNT,
    RewardFuncs,
    Sampler,
    behavior_logps_mismatch,
)
from .trainer import TOPRTrainer


logger = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
EVALUATION_FILE = "evaluation"  # round-<r>/evaluation[-<name>].jsonl: each held-out prompt's outcome
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
                raise ValueError(
                    f"{path}, line {number}, is not JSON ({error}): only a last line cut by a kill is "
                    "read as an unfinished round. Fix or remove the line."
                ) from error
            warnings.warn(
                f"{path} ends with a cut line (a round that was being recorded when the loop stopped): "
                "reading it as unfinished, so the loop redoes that round.",
                stacklevel=2,
            )
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


class LoopCallback:
    """
    Hooks into the rounds of [`run_topr_loop`], as `TrainerCallback` hooks into a trainer's steps: subclass it,
    override the events you need and pass instances as `callbacks`. Every process calls them. An exception raised in
    one, on any process, stops the loop there on every process (the rounds recorded so far stay: the loop resumes from
    them).
    """

    def on_round_begin(self, round_index: int) -> None:
        """Round `round_index` (1, 2, ...) is about to start: nothing of it is sampled or written yet."""

    def on_trainer_created(self, round_index: int, trainer) -> None:
        """The round's [`TOPRTrainer`] is built, before it trains."""

    def on_round_end(self, metrics: dict[str, Any]) -> None:
        """A round's line is recorded in `metrics.jsonl` (round 0 too, the initial model's evaluation): `metrics`."""


def run_topr_loop(
    model: str,
    train_prompts: Dataset,
    reward_funcs: RewardFuncs,
    loop_args: TOPRLoopConfig | None,
    train_args: TOPRConfig,
    *,
    eval_prompts: Dataset | dict[str, Dataset] | None = None,
    correct_func: Callable | None = None,
    answer_func: Callable[[str], str | None] | None = None,
    processing_class: PreTrainedTokenizerBase | None = None,
    peft_config=None,
    quantization_config=None,
    engine: GenerationEngine | None = None,
    callbacks: list[LoopCallback] | None = None,
    tools: list[Callable] | None = None,
    environment_factory: EnvironmentFactory | None = None,
) -> list[dict[str, Any]]:
    """
    Iterative TOPR, as in the paper: each round samples with the current model (mu = that model), scores, curates,
    trains on the result (`train_args.num_train_epochs`, the paper's one epoch by default), evaluates and saves.

    Everything goes to `train_args.output_dir`: `round-<r>/` holds the model after round r, its sampled dataset
    (`samples.jsonl`), the rows it sampled and trained on (`train.jsonl`: curated, with their behavior log-probs), its
    training logs (`trainer_state.json`) and each held-out prompt's outcome (`evaluation[-<name>].jsonl`, round 0 for
    the initial model); `metrics.jsonl` one line per completed round (round 0 evaluates the initial model) and
    `metrics.png` their plot. A round counts as completed once its line is written (the file is replaced whole, so a
    kill never leaves half a line): started again, the loop resumes after the last completed round, redoing an
    interrupted one from its start. Under `accelerate launch`, every process runs the loop: sampling and evaluation
    are split across the processes, training is data-parallel, and the main process writes the files.

    Args:
        model (`str`):
            Id or path of the initial model.
        train_prompts ([`~datasets.Dataset`]):
            Prompts to sample from (`prompt` column plus what the reward functions read): all of them every round, or
            the next `loop_args.prompts_per_round` of them ([`round_prompts`]).
        reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`):
            Reward functions with TRL GRPO's signature, see [`sample_completions`]; weighted by
            `loop_args.reward_weights`.
        loop_args ([`TOPRLoopConfig`], *optional*):
            The loop's own options: the rounds, replay and curation, how each round samples and the evaluation
            samples, the generation engine (vLLM with `use_vllm`: started once, it reloads each round's saved folder
            in place) and the tools' limits. `None` for its defaults.
        train_args ([`TOPRConfig`]):
            Training configuration of every round; `output_dir` is the loop's folder, and each round trains
            `num_train_epochs` on its data (or `max_steps` steps, when set), with a fresh optimizer and schedule;
            `seed` + r seeds round r's sampling, `seed` the evaluation's; `disable_tqdm` hides the progress bars.
            Where it sets no baseline (neither `baseline` nor `target_positive_fraction`), TOPR's rounds train with
            `target_positive_fraction` = `loop_args.default_target_positive_fraction` (0.8: what the iterative
            benchmark found above the paper's baseline 0 on-policy at its fast scale, see
            [`TOPRLoopConfig.training_args`]); `baseline=0.0` is
            the paper's setting. Each round records the `baseline` and `target_positive_fraction` it trained with in
            `metrics.jsonl`, its `training_args.bin` and its trainer state.
        eval_prompts ([`~datasets.Dataset`] or `dict[str, Dataset]`, *optional*):
            Held-out prompts evaluated after every round with [`evaluate_policy`] (needs `correct_func` and
            `answer_func`). A dict evaluates each of its datasets, as TRL's `eval_dataset` does, and names each metric
            after its dataset: `{"validation": val, "test": test}` gives `validation/pass@1`, `test/pass@1`, ...
        correct_func (`Callable`, *optional*):
            Reward function whose value > 0 means correct, for the evaluation.
        answer_func (`Callable[[str], str | None]`, *optional*):
            Final-answer extractor, for maj@k and the invalid rate.
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer; loaded from `model` if `None`.
        peft_config ([`~peft.PeftConfig`], *optional*):
            Train a fresh adapter each round (LoRA). It is merged into the model saved for the next round, in the
            precision of `train_args.model_init_kwargs`; the adapter alone is kept in `round-<r>/adapter`.
        quantization_config ([`~transformers.BitsAndBytesConfig`], *optional*):
            Load each round's model quantized, for sampling and training (QLoRA with `peft_config`).
        engine ([`~trl_topr.generation.GenerationEngine`], *optional*):
            Generate with this engine (e.g. one the caller also uses before or after the loop): the loop gives it
            each round's weights and leaves it open. By default the loop builds the engine `loop_args` asks for
            ([`~trl_topr.generation.generation_engine`]) when it first needs one, and closes it at the end.
        callbacks (`list[LoopCallback]`, *optional*):
            Hooks called at the start of each round, when its trainer is built and when its line is recorded (see
            [`LoopCallback`]).
        tools (`list[Callable]`, *optional*):
            Tools the policy may call while it samples and while it is evaluated, as TRL's GRPO trainer takes them
            (see [`sample_completions`]), up to `loop_args.max_tool_calling_iterations` rounds of calls per
            trajectory. Only the tokens the policy generated are trained (the trajectories' `tool_mask`, kept by
            replay); each round records `tools/call_frequency` and `tools/failure_frequency` (calls and failed calls
            per sample), and the evaluation its `tool_call_rate`.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*):
            TRL GRPO's environments, for sampling and evaluation alike (see
            [`~trl_topr.environments.Environments`]): each trajectory gets an instance, reset with its row, whose
            methods it may call as tools (beside `tools`); an environment's `get_reward` scores its trajectories as
            one more reward function, weight 1, and reward functions (`correct_func` too) get the instances as
            `environments`. Instances are made once and reset for each trajectory, over all the rounds.

    Returns:
        `list[dict[str, Any]]`: the metrics of every completed round, round 0 included.

    Raises:
        `ValueError`, `TypeError`, [`~trl_topr.TOPRDataError`]:
            For bad arguments, prompts or reward functions, before anything is loaded, generated or written (the
            prompts' errors name the column and the row).

    Replay (`loop_args.replay_rounds`): round r trains on its own rows plus the training rows of the rounds before
    it, read back from their `train.jsonl` with the behavior log-probs recorded when they were sampled (mu: the policy
    of their own round; never sampled or scored again). Curation applies to each round's new samples only. Each round
    then also reports metrics by sample age at the start of its training (`age_<k>/...`, see
    [`~trl_topr.replay.metrics_by_age`]). A `train.jsonl` to replay that is missing, or cut (fewer rows than its round
    recorded, or a line that is not a whole row), stops the loop with an error naming the file and the line, before
    the round samples (resumed rounds) or trains; no completed round is lost (see
    [`~trl_topr.replay.read_train_rows`]).
    """
    loop_args = loop_args if loop_args is not None else TOPRLoopConfig()
    _check_arguments(model, loop_args, train_args, correct_func=correct_func, answer_func=answer_func)
    train_args, curate = loop_args.training_args(train_args), curation_function(loop_args.curation)
    processing_class = processing_class or AutoTokenizer.from_pretrained(model)
    sampler = Sampler.from_config(
        None,
        processing_class,
        loop_args,
        train_args,
        reward_funcs,
        engine=engine,
        tools=tools,
        environment_factory=environment_factory,
        progress=not train_args.disable_tqdm,
    )
    _check_prompts(sampler, train_prompts, eval_prompts, loop_args, train_args, correct_func, answer_func)
    models = _RoundModels(model, train_args, processing_class, peft_config, quantization_config)
    log = _RoundLog(train_args.output_dir, callbacks or [])
    log.check_resumable(loop_args.num_rounds, loop_args.replay_rounds)  # before anything is written
    evaluate = _Evaluation(sampler, eval_prompts, correct_func, answer_func, loop_args, train_args.seed, log)
    with sampler, log.naming_steps():  # closes the engine it started; an error names the step it stopped
        if not log.rounds:
            policy = models.load(model)
            log.record({"round": 0, **evaluate(0, model, policy)})
            sampler.release_weights()
            del policy
        for round_index in range(log.rounds[-1]["round"] + 1, loop_args.num_rounds + 1):
            round_dir, previous = log.start_round(round_index), models.folder_before(round_index, log.output_dir)
            policy = models.load(previous)
            prompts = round_prompts(train_prompts, round_index, loop_args.prompts_per_round)
            sampler.load_weights(previous, model=policy)
            logger.info(f"Round {round_index}/{loop_args.num_rounds}: sampling completions of {len(prompts)} prompts")
            samples = sampler.sample(prompts, loop_args.sampling(seed=train_args.seed + round_index))
            log.save_samples(samples, round_dir)
            own = curate(samples) if curate is not None else samples
            own = own.add_column(SAMPLE_ROUND, [round_index] * len(own))
            log.save_train_rows(own, round_dir)
            train_data = with_replayed_rows(
                own, log.output_dir, round_index, loop_args.replay_rounds, log.recorded_rows()
            )
            trainer = _round_trainer(policy, train_data, train_args, round_dir, processing_class, peft_config)
            log.trainer_created(round_index, trainer)
            ages = _ages(policy, train_data, round_index, train_args, trainer, loop_args)
            train_loss = trainer.train().training_loss
            log.save_trainer_state(trainer, round_dir)
            models.save(trainer, previous, round_dir)
            held_out = evaluate(round_index, str(round_dir), trainer.model, getattr(trainer, "deepspeed", None))
            metrics = _round_metrics(samples, own, train_data, trainer, train_loss)
            log.record({"round": round_index, **metrics, **ages, **held_out})
            sampler.release_weights()
            release_trainer(trainer)  # the round's model, optimizer and training engine go with it
            del trainer, policy
            clear_device_cache(garbage_collection=True)  # now, not later: a model sits in reference cycles
            give_back_freed_memory()  # or the allocator's reserve of it grows round after round
    return on_main_process(lambda: read_rounds(str(log.output_dir)), step="reading metrics.jsonl back")


class _Evaluation:
    # The held-out evaluation of a round's model: each set of `eval_prompts`, through the loop's sampler, its metrics
    # named after the set and each prompt's outcome saved
    def __init__(self, sampler: Sampler, eval_prompts, correct_func, answer_func, loop_args, seed: int, log):
        self.sampler, self.sets, self.log = sampler, _named(eval_prompts), log
        self.correct_func, self.answer_func = correct_func, answer_func
        self.sampling = loop_args.eval_sampling(seed=seed)

    def __call__(self, round_index: int, folder: str, policy, training_engine=None) -> dict[str, float]:
        self.sampler.load_weights(folder, model=policy, training_engine=training_engine)
        metrics = {}
        for name, prompts in self.sets.items():
            logger.info(f"Evaluating on {len(prompts)} held-out prompts{f' ({name})' if name else ''}")
            values, per_prompt = self.sampler.evaluate(
                prompts, self.correct_func, self.answer_func, self.sampling, return_per_prompt=True
            )
            self.log.save_evaluation(per_prompt, round_index, name)
            metrics.update({f"{name}/{key}" if name else key: value for key, value in values.items()})
        return metrics


def curation_function(name: str | None) -> Callable[[Dataset], Dataset] | None:
    """
    The curation function a [`TOPRLoopConfig`] names (`curation`): a function of `trl_topr.curation` by its name, or
    any function by its dotted path.

    Args:
        name (`str`, *optional*):
            `"anna_karenina"`, or `"module.function"`; `None` for no curation.

    Returns:
        `Callable[[Dataset], Dataset]` or `None`.

    Raises:
        `ValueError`: naming what could not be found.
    """
    if name is None:
        return None
    from . import curation

    module_name, _, attribute = name.rpartition(".")
    try:
        module = importlib.import_module(module_name) if module_name else curation
    except ModuleNotFoundError as error:
        raise ValueError(f"`curation` {name!r}: {error}.") from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(
            f"`curation` {name!r} is neither a function of trl_topr.curation (e.g. 'anna_karenina') nor a dotted "
            "path to a function (`my_module.my_curation`)."
        )
    return function


def round_prompts(prompts: Dataset, round_index: int, prompts_per_round: int | None) -> Dataset:
    """
    The prompts round `round_index` samples (see [`run_topr_loop`]'s `prompts_per_round`): all of them, or the
    `prompts_per_round` that follow those of the rounds before it, going through `prompts` in order and starting again
    from the top past its end.

    Args:
        prompts ([`~datasets.Dataset`]):
            The training prompts.
        round_index (`int`):
            The round (1, 2, ...).
        prompts_per_round (`int`, *optional*):
            Prompts a round; `None` for all of them.

    Returns:
        [`~datasets.Dataset`]: the round's prompts.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from trl_topr.loop import round_prompts

    >>> prompts = Dataset.from_dict({"prompt": ["a", "b", "c", "d", "e"]})
    >>> [list(round_prompts(prompts, r, 2)["prompt"]) for r in (1, 2, 3)]
    [['a', 'b'], ['c', 'd'], ['e', 'a']]

    ```
    """
    if prompts_per_round is None:
        return prompts
    start = (round_index - 1) * prompts_per_round
    return prompts.select([(start + i) % len(prompts) for i in range(prompts_per_round)])


def _check_arguments(model, loop_args, train_args, **callables) -> None:
    # The loop's own arguments, before anything is loaded or written
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"`model` is the id or path of the initial model, got a {type(model).__name__}: save a model "
            "in memory with `save_pretrained` and pass its folder (each round loads the previous round's "
            "folder)."
        )
    if not isinstance(loop_args, TOPRLoopConfig):
        raise TypeError(f"`loop_args` must be a `TOPRLoopConfig`, got a {type(loop_args).__name__}.")
    if not isinstance(train_args, TOPRConfig):
        raise TypeError(f"`train_args` must be a `TOPRConfig`, got a {type(train_args).__name__}.")
    for name, value in callables.items():
        if value is not None and not callable(value):
            raise TypeError(f"`{name}` must be callable, got a {type(value).__name__}.")
    curation_function(loop_args.curation)  # a name that resolves to no function fails here


def _check_prompts(sampler, train_prompts, eval_prompts, loop_args, train_args, correct_func, answer_func) -> None:
    # The prompts, before anything is generated: each training prompt leaving room for a completion (before its
    # environment's reset adds to it), the evaluation sets as the sampler reads them
    sampler.check_prompts(train_prompts, "train prompts", train_args.max_length)
    if loop_args.prompts_per_round is not None and loop_args.prompts_per_round > len(train_prompts):
        raise ValueError(
            f"`prompts_per_round` ({loop_args.prompts_per_round}) is more than the {len(train_prompts)} train "
            "prompts: a round would sample some prompts twice. Give at most as many, or `None` for every prompt "
            "every round."
        )
    if eval_prompts is not None:
        if correct_func is None or answer_func is None:
            raise ValueError("Evaluating `eval_prompts` needs `correct_func` and `answer_func`.")
        if isinstance(eval_prompts, dict) and not eval_prompts:
            raise ValueError("`eval_prompts` is an empty dict: give at least one named dataset, or `None`.")
        for name, prompts in _named(eval_prompts).items():
            sampler.check_prompts(prompts, f"eval prompts {name!r}" if name else "eval prompts")


def _named(eval_prompts) -> dict[str, Dataset]:
    # The evaluation sets by name ("" for a single dataset, whose metrics keep their plain names)
    if eval_prompts is None:
        return {}
    return dict(eval_prompts) if isinstance(eval_prompts, dict) else {"": eval_prompts}


class _RoundModels:
    # Each round's starting model: loaded (quantized for QLoRA, whole under ZeRO-3 where the trainer needs it) and
    # saved whole for the next round (a LoRA adapter merged into an unquantized copy of the round's starting model).
    def __init__(self, model: str, args: TOPRConfig, processing_class, peft_config, quantization_config):
        self.initial, self.args, self.processing_class, self.peft_config = model, args, processing_class, peft_config
        self.init_kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            if peft_config is None:
                raise ValueError("A quantized model cannot be fully fine-tuned: give a `peft_config` too (QLoRA).")
            self.init_kwargs["quantization_config"] = quantization_config

    def folder_before(self, round_index: int, output_dir: Path) -> str:
        return self.initial if round_index == 1 else str(output_dir / f"round-{round_index - 1}")

    def load(self, path: str):
        return create_model_from_path(path, **self.init_kwargs)

    def save(self, trainer: TOPRTrainer, previous: str, round_dir: Path) -> None:
        trainer.save_model(str(round_dir if self.peft_config is None else round_dir / "adapter"))
        # With LoRA, the main process merges the adapter into an unquantized copy of the round's starting model, loaded
        # on this process alone (whole under ZeRO-3); every process's engine reloads the folder after
        with together(f"{round_dir.name}: saving the model"):
            if self.peft_config is not None and PartialState().is_main_process:
                with unsharded_loading():
                    base = create_model_from_path(previous, **(self.args.model_init_kwargs or {}))
                merged = PeftModel.from_pretrained(base, str(round_dir / "adapter")).merge_and_unload()
                merged.save_pretrained(str(round_dir))
                self.processing_class.save_pretrained(str(round_dir))
                shutil.copy(round_dir / "adapter" / "README.md", round_dir / "README.md")


def _round_trainer(policy, train_data: Dataset, args: TOPRConfig, round_dir: Path, processing_class, peft_config):
    # `args.num_train_epochs` (or `max_steps`) of TOPR on the round's data. The model is loaded here, and the loop's
    # caller publishes the final model: not every round's trainer.
    round_args = dataclasses.replace(args, output_dir=str(round_dir), model_init_kwargs=None, push_to_hub=False)
    trainer = TOPRTrainer(
        policy, args=round_args, train_dataset=train_data, processing_class=processing_class, peft_config=peft_config
    )
    check_saves_whole_weights(trainer)  # the next round loads this round's saved model
    positives = sum(r - trainer.baseline >= 0 for r in train_data[REWARD]) / len(train_data)
    logger.info(
        f"{round_dir.name}: training {args.num_train_epochs:g} epoch(s) of TOPR on {len(train_data)} "
        f"completions ({positives:.0%} positive)"
    )
    return trainer


def _ages(policy, train_data: Dataset, round_index: int, args: TOPRConfig, trainer, loop_args: TOPRLoopConfig):
    # With replay, the metrics by sample age, with the round's starting policy, before its first update
    if not loop_args.replay_rounds:
        return {}
    return metrics_by_age(
        policy,
        train_data,
        round_index,
        args,
        trainer.baseline,
        trainer.processing_class,
        batch_size=loop_args.sampling_batch_size,
    )


def _round_metrics(
    samples: Dataset, own: Dataset, train_data: Dataset, trainer: TOPRTrainer, train_loss: float
) -> dict[str, Any]:
    # What a round's line records besides the evaluation
    rewards = list(samples[REWARD])
    return {
        "reward": sum(rewards) / len(rewards),
        "positive_fraction": sum(r > 0 for r in rewards) / len(rewards),  # a reward of 0 is not a success
        "effective_positive_fraction": effective_positive_fraction(train_data[REWARD], trainer.baseline),
        "num_samples": len(samples),
        "num_new_train_rows": len(own),  # the rows of train.jsonl, which replay checks its reading against
        "num_train_rows": len(train_data),
        "train_loss": train_loss,
        "baseline": trainer.baseline,  # what the round trained with
        "target_positive_fraction": trainer.args.target_positive_fraction,
        **behavior_logps_mismatch(samples),
        **_tool_frequencies(samples),
    }


def _tool_frequencies(samples: Dataset) -> dict[str, float]:
    # TRL GRPO's names: tool calls and failed calls per sample (with tools)
    if TOOL_CALL_COUNT not in samples.column_names:
        return {}
    return {
        "tools/call_frequency": sum(samples[TOOL_CALL_COUNT]) / len(samples),
        "tools/failure_frequency": sum(samples[TOOL_FAILURE_COUNT]) / len(samples),
    }


class _RoundLog:
    # The loop's folder: the completed rounds (`metrics.jsonl`, replaced whole at each round, and its plot), and each
    # round's folder, its samples and training logs. What decides the rounds to run is read once, by the main process,
    # and shared; the main process writes, and every process goes on from each write together (`together`: all of
    # them stop where one fails, and an error if they are not at the same step). Every process keeps the rounds and
    # calls the callbacks.
    def __init__(self, output_dir: str, callbacks: list[LoopCallback]):
        self.output_dir, self.state, self.callbacks = Path(output_dir), PartialState(), callbacks
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise NotADirectoryError(f"`output_dir` {self.output_dir} is a file: the loop needs a folder.")
        # the completed rounds, as the main process read them before anything was written: the loop resumes after
        # the last
        self.rounds = on_main_process(lambda: read_rounds(str(self.output_dir)), step="reading metrics.jsonl")
        self.step = f"resuming after round {self.rounds[-1]['round']}" if self.rounds else "round 0: evaluation"

    def naming_steps(self):
        # An error of any process names the step it was at (under several processes: the others' say theirs)
        return naming_the_step(lambda: f"{self.step} of the loop")

    def check_resumable(self, num_rounds: int, replay_rounds: int) -> None:
        # What the folder holds agrees with the call: no more rounds than asked for, and the rows of every completed
        # round that the next rounds replay readable and whole (read by the main process, every process raising)
        done = self.rounds[-1]["round"] if self.rounds else None
        if done is not None and done > num_rounds:
            raise ValueError(
                f"{self.output_dir / METRICS_FILE} records {done} completed round(s), more than `num_rounds` "
                f"({num_rounds}): the loop resumes a folder, it does not undo rounds. Ask for `num_rounds` >= {done} "
                "to go on (or = to read it back), or use a new `output_dir`."
            )
        if done is not None and done < num_rounds and replay_rounds:

            def check() -> None:
                for earlier in replayed_rounds(done + 1, replay_rounds):
                    read_train_rows(self.output_dir, earlier, self.recorded_rows().get(earlier))

            on_main_process(check, step="checking the rows to replay")

    def recorded_rows(self) -> dict[int, int]:
        # the rows each completed round saved to its train.jsonl (rounds recorded before this count was kept: none)
        return {r["round"]: r["num_new_train_rows"] for r in self.rounds if "num_new_train_rows" in r}

    def _together(self, step: str):
        # `together` at `step`, the step an error names until the next
        self.step = step
        return together(step)

    def start_round(self, round_index: int) -> Path:
        round_dir = self.output_dir / f"round-{round_index}"
        with self._together(f"round {round_index}: start"):  # the processes agree on the round they start
            for callback in self.callbacks:
                callback.on_round_begin(round_index)
            if self.state.is_main_process:
                shutil.rmtree(round_dir, ignore_errors=True)  # an interrupted attempt is redone from its start
                round_dir.mkdir(parents=True)
        self.step = f"round {round_index}: sampling"
        return round_dir

    def trainer_created(self, round_index: int, trainer: TOPRTrainer) -> None:
        with self._together(f"round {round_index}: on_trainer_created"):
            for callback in self.callbacks:
                callback.on_trainer_created(round_index, trainer)
        self.step = f"round {round_index}: training"

    def save_samples(self, samples: Dataset, round_dir: Path) -> None:
        with self._together(f"{round_dir.name}: saving samples.jsonl"):
            if self.state.is_main_process:
                samples.to_json(str(round_dir / "samples.jsonl"))
        self.step = f"{round_dir.name}: curating and replaying"

    def save_train_rows(self, rows: Dataset, round_dir: Path) -> None:
        with self._together(f"{round_dir.name}: saving {TRAIN_ROWS_FILE}"):  # every process reads it back after
            if self.state.is_main_process:  # what later rounds replay: written whole or not at all
                partial = round_dir / f"{TRAIN_ROWS_FILE}.partial"
                rows.to_json(str(partial))
                os.replace(partial, round_dir / TRAIN_ROWS_FILE)

    def save_evaluation(self, per_prompt: list[dict[str, int]], round_index: int, name: str) -> None:
        file = f"{EVALUATION_FILE}{'-' + name if name else ''}.jsonl"
        with self._together(f"round {round_index}: saving {file}"):
            if self.state.is_main_process:  # each held-out prompt's outcome, in its dataset's order
                round_dir = self.output_dir / f"round-{round_index}"
                round_dir.mkdir(parents=True, exist_ok=True)
                (round_dir / file).write_text("".join(json.dumps(row) + "\n" for row in per_prompt))

    def save_trainer_state(self, trainer: TOPRTrainer, round_dir: Path) -> None:
        with self._together(f"{round_dir.name}: saving trainer_state.json"):
            if self.state.is_main_process:  # the round's training logs (TOPR's metrics per step), as in a checkpoint
                trainer.state.save_to_json(str(round_dir / "trainer_state.json"))
        self.step = f"{round_dir.name}: saving and evaluating the model"

    def record(self, metrics: dict[str, Any]) -> None:
        self.rounds.append(metrics)
        with self._together(f"round {metrics['round']}: recording it in {METRICS_FILE}"):
            if self.state.is_main_process:  # the line marks the round as completed: the file is replaced whole
                self.output_dir.mkdir(parents=True, exist_ok=True)
                partial = self.output_dir / f"{METRICS_FILE}.partial"
                partial.write_text("".join(json.dumps(r) + "\n" for r in self.rounds))
                os.replace(partial, self.output_dir / METRICS_FILE)
                plot_rounds(self.rounds, str(self.output_dir / "metrics.png"))
        shown = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        logger.info(f"Round {metrics['round']} done: {shown}")
        with self._together(f"round {metrics['round']}: on_round_end"):
            for callback in self.callbacks:
                callback.on_round_end(metrics)
        self.step = f"after round {metrics['round']}"
