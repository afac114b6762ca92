"""Sampling: what a policy writes for prompts, scored, with the behavior log-probs TOPR trains on.

A [`Sampler`] is built once from an engine, the tokenizer, the tools or environments and the reward functions, which
it prepares and checks then. [`Sampler.sample`] generates `num_samples` completions per prompt, scores them with TRL
GRPO-style reward functions, and computes `behavior_logps` exactly as [`TOPRTrainer`] will compute log pi for the same
model and row (same tokenization, same completion tokens, temperature-1 softmax, same mixed precision): training on
the result with that model starts with every importance ratio at 1. [`Sampler.evaluate`] measures a policy on
held-out prompts. [`sample_completions`], [`evaluate_policy`] and [`generate_completions`] are the same for one call.

About mu: the completions are *drawn* from the sampling distribution (temperature, top-p, top-k), but `behavior_logps`
is the log-probability of the completion under the model's plain softmax, the distribution TOPR's ratio pi/mu
compares pi with. With temperature 1 and no top-p/top-k truncation the two coincide; otherwise the ratio corrects
towards the model's own distribution, not the tempered or truncated one.
"""

import dataclasses
import math
from collections.abc import Callable

from accelerate import PartialState
from accelerate.logging import get_logger
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from trl import SFTConfig
from trl.trainer.utils import create_model_from_path

from .data import (
    BEHAVIOR_LOGPS,
    COMPLETION,
    COMPLETION_IDS,
    PROMPT,
    PROMPT_IDS,
    REWARD,
    TOOL_MASK,
    TOPRDataError,
    check_prompts,
)
from .distributed import on_main_process
from .environments import EnvironmentFactory, Environments, as_environments
from .evaluation import policy_metrics
from .generation import GenerationEngine, SamplingSettings, generation_engine
from .logprobs import behavior_logps, check_behavior_logps_source, completion_row, logps_settings
from .rollout import Trajectories, prepare_tool_calling, rollout
from .tokens import prompt_ids
from .trajectories import storable


logger = get_logger(__name__)

SAMPLER_LOGPS = "sampler_logps"
# A trajectory's tool calls and failed calls, with tools
TOOL_CALL_COUNT, TOOL_FAILURE_COUNT = "tool_call_count", "tool_failure_count"
TOOL_COLUMNS = (TOOL_MASK, TOOL_CALL_COUNT, TOOL_FAILURE_COUNT)
# The columns a sampler writes: in a prompts dataset (a sampled dataset sampled again) they are replaced
SAMPLING_COLUMNS = (
    PROMPT,
    COMPLETION,
    REWARD,
    BEHAVIOR_LOGPS,
    PROMPT_IDS,
    COMPLETION_IDS,
    SAMPLER_LOGPS,
    *TOOL_COLUMNS,
)
# `max_length` of a default training configuration: what prompts are checked against when no `args` is given
DEFAULT_MAX_LENGTH = SFTConfig.__dataclass_fields__["max_length"].default
REWARD_COLUMNS_PREFIX = "rewards/"
ENVIRONMENTS = "environments"  # the argument that gives reward functions the trajectories' environments, as in TRL
RewardFuncs = Callable | list[Callable] | dict[str, Callable]


def reward_column(name: str) -> str:
    """
    The column of a sampled dataset that holds one reward function's values: `rewards/<name>`, the name TRL's GRPO logs
    them under. The prefix keeps them apart from the data contract's columns (`reward`, `prompt`, ...) and from the
    prompts' own columns, whatever the functions are called.

    Args:
        name (`str`):
            The reward function's name (its `__name__`, or its key in a dict of reward functions).

    Returns:
        `str`: the column name.
    """
    return f"{REWARD_COLUMNS_PREFIX}{name}"


def _describe(func: Callable) -> str:
    # Where a reward function comes from, to tell two functions of one name apart
    module, name = getattr(func, "__module__", None), getattr(func, "__qualname__", type(func).__qualname__)
    return f"{module}.{name}" if module else name


def reward_functions(
    reward_funcs: RewardFuncs | None,
    reward_weights: list[float] | None = None,
    environments: Environments | None = None,
) -> tuple[dict[str, Callable], list[float]]:
    """
    The reward functions by name, with their weights, checked: what sampling and the loop check before they generate.

    Args:
        reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`):
            Reward functions; a dict names them, otherwise each function's `__name__` does.
        reward_weights (`list[float]`, *optional*):
            Weight of each function, finite; defaults to 1 each.
        environments ([`~trl_topr.environments.Environments`], *optional*):
            Environments whose `get_reward` scores their trajectories: a function each, weight 1, after the others
            (as TRL's GRPO trainer adds them); `reward_funcs` may then be empty.

    Returns:
        `tuple[dict[str, Callable], list[float]]`: the functions by name, and their weights.

    Raises:
        `ValueError`: without a function, for two functions of one name (naming both), or for weights that are not
        one finite number per function.
        `TypeError`: for a function that is not callable.
    """
    if callable(reward_funcs):
        reward_funcs = [reward_funcs]
    reward_funcs = reward_funcs if reward_funcs is not None else []
    if isinstance(reward_funcs, dict):
        named = dict(reward_funcs)
    else:
        named, positions = {}, {}
        for position, func in enumerate(reward_funcs):
            name = getattr(func, "__name__", type(func).__name__)
            if name in named:
                raise ValueError(
                    f"Two reward functions are named {name!r}: {_describe(named[name])} (reward function "
                    f"{positions[name]}) and {_describe(func)} (reward function {position}). Their values would "
                    f"share the column {reward_column(name)!r}: pass a dict to name them, e.g. "
                    f"{{'{name}_{positions[name]}': ..., '{name}_{position}': ...}}."
                )
            named[name], positions[name] = func, position
    own = environments.reward_funcs() if environments is not None else {}
    if reward_weights is not None and own:
        reward_weights = [*reward_weights, *[1.0] * len(own)]
    for name, func in own.items():
        if name in named:
            raise ValueError(f"A reward function and an environment's `get_reward` are both named {name!r}.")
        named[name] = func
    if not named:
        raise ValueError(
            "No reward function was given: sampling needs at least one to score the completions (or an environment "
            "with `get_reward`)."
        )
    for name, func in named.items():
        if not callable(func):
            raise TypeError(
                f"Reward function {name!r} is a {type(func).__name__}, not a callable with TRL GRPO's "
                "signature `fn(prompts, completions, **columns)`."
            )
    weights = [1.0] * len(named) if reward_weights is None else list(reward_weights)
    if len(weights) != len(named):
        raise ValueError(f"{len(weights)} reward weights for {len(named)} reward functions.")
    if not all(_is_finite_number(w) for w in weights):
        raise ValueError(f"Reward weights must be finite numbers, got {weights}.")
    return named, [float(w) for w in weights]


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def score_completions(
    prompts: list,
    completions: list,
    reward_funcs: RewardFuncs,
    reward_weights: list[float] | None = None,
    completion_ids: list[list[int]] | None = None,
    **columns: list,
) -> tuple[list[float], dict[str, list[float]]]:
    """
    Score completions with reward functions of TRL's GRPO signature, `fn(prompts, completions, **columns)`.

    Args:
        prompts (`list`):
            One prompt per completion (text or messages).
        completions (`list`):
            Completions (text, or lists of messages for conversational prompts).
        reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`):
            Reward functions; a dict names their columns, otherwise each function's `__name__` does.
        reward_weights (`list[float]`, *optional*):
            Weight of each function in the combined reward. Defaults to 1 each. A weight of 0 keeps a function as
            a column only (e.g. an `invalid` flag).
        completion_ids (`list[list[int]]`, *optional*):
            Generated token ids, passed on as GRPO does.
        **columns:
            Other dataset columns, one value per completion, passed to every function; and `environments`, each
            completion's environment (see [`~trl_topr.environments.Environments`]), with which the functions run
            on the main process only, where the environments took their steps.

    Returns:
        `tuple[list[float], dict[str, list[float]]]`: the combined rewards (weighted sum, ignoring `None` as GRPO
        does) and each function's values (`nan` for `None`).

    Example:
    ```python
    >>> def has_digit(prompts, completions, **kwargs):
    ...     return [1.0 if any(c.isdigit() for c in text) else -1.0 for text in completions]
    >>> score_completions(["2+2?", "2+2?"], ["4", "four"], has_digit)
    ([1.0, -1.0], {'has_digit': [1.0, -1.0]})

    ```
    """
    funcs, weights = reward_functions(reward_funcs, reward_weights)
    return weighted_rewards(funcs, weights, prompts, completions, completion_ids, columns)


def weighted_rewards(
    funcs: dict[str, Callable],
    weights: list[float],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]] | None,
    columns: dict[str, list],
) -> tuple[list[float], dict[str, list[float]]]:
    """
    [`score_completions`] with reward functions already checked by [`reward_functions`] (what a [`Sampler`] holds):
    each function's values and their weighted sum.

    Args:
        funcs (`dict[str, Callable]`):
            The reward functions by name.
        weights (`list[float]`):
            Their weights.
        prompts (`list`):
            One prompt per completion.
        completions (`list`):
            The completions.
        completion_ids (`list[list[int]]`, *optional*):
            Their token ids.
        columns (`dict[str, list]`):
            The other columns, one value per completion (`environments` among them, with environments).

    Returns:
        `tuple[list[float], dict[str, list[float]]]`: as [`score_completions`].
    """

    def each_function() -> dict[str, list[float]]:
        per_func = {}
        for name, func in funcs.items():
            try:
                values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as error:
                raise RuntimeError(f"Reward function {name!r} raised {type(error).__name__}: {error}") from error
            if values is None or len(values) != len(completions):
                got = "None" if values is None else f"{len(values)} values"
                raise ValueError(f"Reward function {name!r} returned {got} for {len(completions)} completions.")
            per_func[name] = [math.nan if v is None else float(v) for v in values]
        return per_func

    # scored once, on the main process, and shared: every process then curates and trains the same rows whatever the
    # reward functions do (a judge that answers differently, a timeout on one process); environments' state is there
    per_func = on_main_process(each_function, step="scoring the completions")
    rewards = []
    for row in range(len(completions)):
        terms = [w * per_func[name][row] for name, w in zip(funcs, weights) if not math.isnan(per_func[name][row])]
        if not terms:
            raise ValueError(f"Every reward function returned None for completion {row}: {completions[row]!r}.")
        rewards.append(sum(terms))
    return rewards, per_func


def checked_prompt_ids(
    processing_class: PreTrainedTokenizerBase,
    prompts: list,
    max_length: int | None,
    dataset_name: str = "prompts",
    tools: list | None = None,
) -> list[list[int]]:
    """
    The prompts' token ids (see [`~trl_topr.generation.prompt_ids`]), each checked before anything is generated: a
    prompt of `max_length` tokens or more leaves no completion token to train on.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        prompts (`list`):
            The prompts, text or messages.
        max_length (`int`, *optional*):
            The training configuration's `max_length`; `None` checks nothing.
        dataset_name (`str`, *optional*, defaults to `"prompts"`):
            Name used in error messages.
        tools (`list` or `list[list]`, *optional*):
            Tools the chat template shows the model: for every prompt, or one list per prompt.

    Returns:
        `list[list[int]]`: the token ids of each prompt.

    Raises:
        [`TOPRDataError`]: naming the row of the first prompt that fills `max_length`.
    """
    per_prompt = tools if tools and isinstance(tools[0], list) else [tools] * len(prompts)
    all_ids = [prompt_ids(processing_class, prompt, own) for prompt, own in zip(prompts, per_prompt, strict=True)]
    for row, ids in enumerate(all_ids):
        length = len(ids)
        if max_length is not None and length >= max_length:
            raise TOPRDataError(
                f"{dataset_name} dataset, column '{PROMPT}', row {row}: the prompt has {length} tokens, which fill "
                f"`max_length` ({max_length}): no completion token would be left to train on. Raise `max_length` "
                "or shorten the prompt."
            )
    return all_ids


@dataclasses.dataclass
class Rollout:
    """
    What [`Sampler.rollout`] returns: the trajectories of a dataset's prompts, with what scoring them needs.

    Args:
        rows ([`~datasets.Dataset`]):
            The rows the trajectories were generated from: the prompts' dataset, or with environments one row per
            trajectory, its prompt as its environment's `reset` left it.
        prompt_ids (`list[list[int]]`):
            The token ids of each row's prompt.
        trajectories ([`~trl_topr.rollout.Trajectories`]):
            The trajectories, `num_samples` per row, row-major.
        num_samples (`int`):
            Trajectories per row (1 with environments).
        environments (`list`, *optional*):
            Each trajectory's environment, with environments.
    """

    rows: Dataset
    prompt_ids: list[list[int]]
    trajectories: Trajectories
    num_samples: int
    environments: list | None = None

    def repeated(self, values: list) -> list:
        """`values`, one per row, repeated for each of its trajectories."""
        return [value for value in values for _ in range(self.num_samples)]


class Sampler:
    """
    What a policy samples, built once: a generation engine, the tokenizer, the tools or environments, the reward
    functions and the limits, prepared and checked when it is built (the chat template's tool support and TRL's
    response parser, the environments' instances, the reward functions and their weights). It rolls prompts out into
    trajectories ([`~trl_topr.rollout.rollout`]: one turn, or several with tools), scores them with the reward
    functions or the environments, and records their behavior log-probs: [`sample`] makes a TOPR dataset,
    [`evaluate`] the metrics of held-out prompts. [`sample_completions`] and [`evaluate_policy`] build one for a call;
    the loop holds one for all its rounds, given each round's weights by [`load_weights`].

    The engine is the one given, or the one `engine_args` asks for ([`~trl_topr.generation.generation_engine`]: vLLM
    with `use_vllm`, else transformers' `generate` with `model`, in the precision of `args`), started when first needed
    and closed by [`close`] (a given engine is left open). A sampler is a context manager that closes on exit.

    Args:
        model (`str` or [`~transformers.PreTrainedModel`], *optional*):
            The policy, or its id or path (loaded the TRL way with `args.model_init_kwargs`): what the default engine
            generates with and what computes the behavior log-probs. `None` with an `engine` that holds the policy, or
            until [`load_weights`] gives one.
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            The tokenizer; loaded from the model's name if `None`.
        reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`, *optional*):
            Reward functions with TRL GRPO's signature, for [`sample`] (see [`sample_completions`]). `None` for a
            sampler that only generates or evaluates.
        reward_weights (`list[float]`, *optional*):
            Their weights in the combined `reward` (1 each by default).
        engine ([`~trl_topr.generation.GenerationEngine`], *optional*):
            Generate with this engine, holding the policy's weights (left open by [`close`]).
        engine_args ([`~trl_topr.TOPRLoopConfig`], *optional*):
            The options of the engine to build where none is given (`use_vllm`, `vllm_mode`, ...); `None` for
            transformers.
        args ([`TOPRConfig`], *optional*):
            The training configuration the samples are for: its `max_length` (prompts leaving no room for a completion
            are refused), mixed precision, `padding_free` and `model_init_kwargs` set how the behavior log-probs are
            computed and the default engine's precision. Defaults to training's defaults.
        behavior_logps_source (`str`, *optional*, defaults to `"trainer"`):
            Where the behavior log-probs come from: `"trainer"`, recomputed by the model as the trainer computes them;
            `"sampler"`, the engine's own (vLLM's).
        tools (`list[Callable]`, *optional*):
            Tools the policy may call, as TRL's GRPO trainer takes them (see [`sample_completions`]).
        max_tool_calling_iterations (`int`, *optional*):
            With tools, the most rounds of calls of a trajectory; `None`: no limit but the length.
        environment_factory (`Callable`, `dict[str, Callable]` or [`~trl_topr.environments.Environments`], *optional*):
            TRL GRPO's environments (see [`sample_completions`]); their instances are made once and reset for each
            trajectory, for as long as the sampler lives.
        bf16 (`bool`, *optional*):
            Generate under bf16 autocast with the default transformers engine; defaults to `args.bf16`, else the
            hardware (see [`~trl_topr.precision.bf16_is_faster`]).
        progress (`bool`, *optional*, defaults to `True`):
            Show progress bars.

    Raises:
        `ValueError`:
            For bad reward functions, tools, environments or options, before anything is generated (`TypeError` for
            an argument of the wrong type).

    Example:
    ```python
    >>> from trl_topr import Sampler, gsm8k_reward
    >>> from trl_topr.generation import SamplingSettings

    >>> with Sampler("HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=gsm8k_reward) as sampler:  # doctest: +SKIP
    ...     samples = sampler.sample(prompts, SamplingSettings(num_samples=8, seed=0))
    ...     metrics = sampler.evaluate(test_prompts, gsm8k_reward, extract_final_answer)
    ```
    """

    def __init__(
        self,
        model: "str | PreTrainedModel | None" = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_funcs: RewardFuncs | None = None,
        *,
        reward_weights: list[float] | None = None,
        engine: GenerationEngine | None = None,
        engine_args=None,
        args=None,
        behavior_logps_source: str = "trainer",
        tools: list[Callable] | None = None,
        max_tool_calling_iterations: int | None = None,
        environment_factory: EnvironmentFactory | Environments | None = None,
        bf16: bool | None = None,
        progress: bool = True,
    ):
        check_behavior_logps_source(behavior_logps_source)
        if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
            raise ValueError(f"`max_tool_calling_iterations` must be >= 0, got {max_tool_calling_iterations}.")
        if engine is not None and not isinstance(engine, GenerationEngine):
            raise TypeError(f"`engine` must be a `GenerationEngine`, got a {type(engine).__name__}.")
        PartialState()  # the processes' state, which accelerate's logger reads
        if isinstance(model, str):
            model = create_model_from_path(model, **(getattr(args, "model_init_kwargs", None) or {}))
        if processing_class is None:
            if model is None:
                raise ValueError("A `Sampler` without a `model` needs its `processing_class`.")
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        self.model, self.processing_class, self.args = model, processing_class, args
        self.behavior_logps_source, self.max_tool_calling_iterations = (
            behavior_logps_source,
            max_tool_calling_iterations,
        )
        self.max_length = getattr(args, "max_length", DEFAULT_MAX_LENGTH)  # where the configuration has one
        self.progress = progress
        self.tools = list(tools) if tools else None
        self.environments = as_environments(environment_factory, tools)
        self.reward_funcs, self.reward_weights = None, None
        if reward_funcs is not None or (self.environments is not None and self.environments.reward_funcs()):
            self.reward_funcs, self.reward_weights = reward_functions(reward_funcs, reward_weights, self.environments)
        for own in self._tool_sets():  # the chat template shows them, TRL's parser reads their calls
            prepare_tool_calling(processing_class, own)
        self._engine, self._engine_options, self.owns_engine = engine, (engine_args, bf16), engine is None

    @classmethod
    def from_config(
        cls,
        model,
        processing_class,
        loop_args,
        train_args=None,
        reward_funcs: RewardFuncs | None = None,
        *,
        engine: GenerationEngine | None = None,
        tools: list[Callable] | None = None,
        environment_factory: EnvironmentFactory | Environments | None = None,
        progress: bool = True,
    ) -> "Sampler":
        """
        The sampler a loop configuration describes: its engine options, reward weights, `behavior_logps_source` and
        tools' limit, for the training configuration `train_args`.

        Args:
            model (`str` or [`~transformers.PreTrainedModel`], *optional*):
                The policy (see [`Sampler`]).
            processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
                The tokenizer.
            loop_args ([`~trl_topr.TOPRLoopConfig`]):
                The sampling side's options.
            train_args ([`TOPRConfig`], *optional*):
                The training configuration the samples are for.
            reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`, *optional*):
                The reward functions.
            engine ([`~trl_topr.generation.GenerationEngine`], *optional*):
                An engine to use instead of the one `loop_args` asks for.
            tools (`list[Callable]`, *optional*):
                The tools the policy may call.
            environment_factory (`Callable` or `dict[str, Callable]`, *optional*):
                TRL GRPO's environments.
            progress (`bool`, *optional*, defaults to `True`):
                Show progress bars.

        Returns:
            [`Sampler`]: the sampler.
        """
        return cls(
            model,
            processing_class,
            reward_funcs,
            reward_weights=loop_args.reward_weights,
            engine=engine,
            engine_args=loop_args,
            args=train_args,
            behavior_logps_source=loop_args.behavior_logps_source,
            tools=tools,
            max_tool_calling_iterations=loop_args.max_tool_calling_iterations,
            environment_factory=environment_factory,
            progress=progress,
        )

    def _tool_sets(self) -> list[list[Callable]]:
        # each set of tools a trajectory may be shown: the tools, or each environment's tools and methods
        if self.environments is not None:
            return [self.environments.tools(name) for name in self.environments.factories]
        return [self.tools] if self.tools else []

    @property
    def engine(self) -> GenerationEngine:
        """The generation engine: the one given, else the one the options ask for, started at first use."""
        if self._engine is None:
            if self.model is None:
                raise ValueError("The sampler has neither an engine nor a model: give one, or `load_weights` first.")
            engine_args, bf16 = self._engine_options
            self._engine = generation_engine(self.model, self.processing_class, engine_args, self.args, bf16=bf16)
        return self._engine

    def load_weights(self, folder: str, model: "PreTrainedModel | None" = None, training_engine=None) -> None:
        """
        Sample with the weights saved in `folder` from now on (see
        [`~trl_topr.generation.GenerationEngine.load_weights`]), computing the behavior log-probs with `model`.

        Args:
            folder (`str`):
                Folder of the whole saved model.
            model ([`~transformers.PreTrainedModel`], *optional*):
                Those weights in memory: the behavior log-probs' model, and the default engine's first model.
            training_engine (`deepspeed.DeepSpeedEngine`, *optional*):
                The DeepSpeed engine holding `model`, if any.
        """
        self.model = model
        self.engine.load_weights(folder, model=model, training_engine=training_engine)

    def release_weights(self) -> None:
        """Drop the references to the model given to [`load_weights`], so that the caller can free it."""
        if self._engine is not None:
            self._engine.release_weights()
        self.model = None

    def close(self) -> None:
        """Close the engine the sampler started (a given engine is left open)."""
        if self.owns_engine and self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def check_prompts(self, dataset: Dataset, dataset_name: str = "prompts", max_length: int | None = None) -> None:
        """
        Check prompts before anything is generated: the data contract's `prompt` column
        ([`~trl_topr.data.check_prompts`]), conversational prompts where there are tools, and each prompt leaving room
        for a completion within `max_length` (with the tools its row is shown, before an environment's `reset` adds
        to it).

        Args:
            dataset ([`~datasets.Dataset`]):
                The prompts.
            dataset_name (`str`, *optional*, defaults to `"prompts"`):
                Name used in error messages.
            max_length (`int`, *optional*):
                The training's `max_length`; `None` checks no length.

        Raises:
            [`TOPRDataError`], `ValueError`: naming the column and the row.
        """
        check_prompts(dataset, dataset_name)
        tools = self.tools
        if self.environments is not None:
            tools = [self.environments.tools(name) for name in self.environments.names(dataset)]
        checked_prompt_ids(self.processing_class, list(dataset[PROMPT]), max_length, dataset_name, tools)

    def generate(self, prompts: list, sampling: SamplingSettings | None = None) -> Trajectories:
        """
        The trajectories of plain prompts (no rows, no environments): `sampling.num_samples` per prompt.

        Args:
            prompts (`list`):
                Prompts, text or messages.
            sampling ([`~trl_topr.generation.SamplingSettings`], *optional*):
                How to sample; one completion per prompt at temperature 1 by default.

        Returns:
            [`~trl_topr.rollout.Trajectories`]: the trajectories, prompt-major.
        """
        return self._roll(list(prompts), self.tools, sampling or SamplingSettings(), None)[0]

    def rollout(self, dataset: Dataset, sampling: SamplingSettings, max_length: int | None = None) -> Rollout:
        """
        The trajectories of a dataset's prompts: `sampling.num_samples` per prompt, each in its own environment where
        there are environments (reset with its row).

        Args:
            dataset ([`~datasets.Dataset`]):
                The prompts and their rows.
            sampling ([`~trl_topr.generation.SamplingSettings`]):
                How to sample.
            max_length (`int`, *optional*):
                Refuse prompts that leave no room for a completion within it.

        Returns:
            [`Rollout`]: the rows, their prompts' ids and the trajectories.
        """
        rows, tools, instances, repeats = dataset, self.tools, None, sampling.num_samples
        if self.environments is not None:  # one row per trajectory, its prompt as its environment's reset left it
            rows, tools, instances = self.environments.expand(dataset, sampling.num_samples)
            sampling, repeats = sampling.replace(num_samples=1), 1
        trajectories, ids = self._roll(list(rows[PROMPT]), tools, sampling, max_length)
        return Rollout(rows, ids, trajectories, repeats, instances)

    def _roll(self, prompts: list, tools, sampling: SamplingSettings, max_length) -> tuple[Trajectories, list]:
        if tools and not all(isinstance(prompt, list) for prompt in prompts):
            raise ValueError(
                "Sampling with `tools` needs conversational prompts (lists of messages): the chat template shows the "
                "tools and their results."
            )
        ids = checked_prompt_ids(self.processing_class, prompts, max_length, tools=tools)
        trajectories = rollout(
            self.engine,
            self.processing_class,
            prompts,
            ids,
            sampling,
            tools,
            self.max_tool_calling_iterations,
            self.progress,
        )
        return trajectories, ids

    def score(self, run: Rollout, reward_funcs: dict[str, Callable] | None = None, weights=None) -> tuple:
        """
        Score a rollout's trajectories with the sampler's reward functions (or `reward_funcs`, named, with `weights`):
        each function gets the rows' columns (sampling's own columns aside) and the environments.

        Args:
            run ([`Rollout`]):
                The rollout.
            reward_funcs (`dict[str, Callable]`, *optional*):
                Other reward functions by name (e.g. an evaluation's correctness).
            weights (`list[float]`, *optional*):
                Their weights (1 each by default).

        Returns:
            `tuple[list[float], dict[str, list[float]]]`: the combined rewards and each function's values.
        """
        if reward_funcs is None:
            if self.reward_funcs is None:
                raise ValueError("This sampler has no reward functions: give `reward_funcs` to score what it samples.")
            reward_funcs, weights = self.reward_funcs, self.reward_weights
        columns = {c: run.repeated(run.rows[c]) for c in run.rows.column_names if not _is_sampling_column(c)}
        if run.environments is not None:
            columns[ENVIRONMENTS] = run.environments
        prompts, out = run.repeated(run.rows[PROMPT]), run.trajectories
        weights = weights or [1.0] * len(reward_funcs)
        return weighted_rewards(reward_funcs, weights, prompts, out.completions, out.completion_ids, columns)

    def sample(self, dataset: Dataset, sampling: SamplingSettings | None = None) -> Dataset:
        """
        A scored TOPR dataset of the prompts: what [`sample_completions`] returns (its columns are described there).

        Args:
            dataset ([`~datasets.Dataset`]):
                Prompts in a `prompt` column; the other columns go to the reward functions and to every sample.
            sampling ([`~trl_topr.generation.SamplingSettings`], *optional*):
                How to sample. Defaults to `SamplingSettings(num_samples=4, seed=0)`.

        Returns:
            [`~datasets.Dataset`]: one row per completion.

        Raises:
            [`TOPRDataError`]: before anything is generated, for a prompt that leaves no room for a completion within
            `args.max_length`.
        """
        sampling = sampling or SamplingSettings(num_samples=4, seed=0)
        check_prompts(dataset)
        if self.reward_funcs is None:
            raise ValueError("This sampler has no reward functions: build it with `reward_funcs` to sample a dataset.")
        run = self.rollout(dataset, sampling, self.max_length)
        out = run.trajectories
        logger.info(f"Sampled {len(out.completion_ids)} completions at {out.tokens_per_s:.1f} tokens/s.")
        rewards, per_func = self.score(run)
        samples = _scored_samples(
            run.rows.select(run.repeated(range(len(run.rows)))),
            [storable(c) for c in out.completions] if self.tools or self.environments else out.completions,
            out.completion_ids,
            run.repeated(run.prompt_ids),
            rewards,
            per_func,
        )
        if out.tool_mask is not None:
            samples = samples.add_column(TOOL_MASK, out.tool_mask)
            samples = samples.add_column(TOOL_CALL_COUNT, out.tool_calls).add_column(
                TOOL_FAILURE_COUNT, out.tool_failures
            )
        if out.logprobs is not None:
            samples = samples.add_column(SAMPLER_LOGPS, out.logprobs)
        return samples.add_column(BEHAVIOR_LOGPS, self._behavior_logps(samples, out, sampling.batch_size))

    def _behavior_logps(self, samples: Dataset, out: Trajectories, batch_size: int) -> list[list[float]]:
        # mu: the engine's own log-probs, or as the trainer of these samples will compute log pi
        if self.behavior_logps_source == "sampler":
            if out.logprobs is None or any(v is None for row in out.logprobs for v in row):
                raise ValueError("`behavior_logps_source='sampler'` needs vLLM's log-prob of every sampled token.")
            return out.logprobs
        if self.model is None:
            raise ValueError("The behavior log-probs are the model's: give the sampler its `model`.")
        masks = out.tool_mask or [None] * len(samples)
        rows = [completion_row(*row) for row in zip(samples[PROMPT_IDS], out.completion_ids, masks, strict=True)]
        settings = logps_settings(self.args, self.processing_class, self.model.device, batch_size=batch_size)
        values = behavior_logps(self.model, rows, settings)
        if out.logprobs is not None:
            mismatch = logps_mismatch(out.logprobs, values)
            logger.info(
                f"Behavior log-probs, sampler against trainer, per sequence: mean |difference| "
                f"{mismatch['behavior_logps_mismatch_mean']:.2e}, max {mismatch['behavior_logps_mismatch_max']:.2e}"
            )
        return values

    def evaluate(
        self,
        dataset: Dataset,
        correct_func: Callable,
        answer_func: Callable[[str], str | None],
        sampling: SamplingSettings | None = None,
        return_per_prompt: bool = False,
    ) -> dict[str, float] | tuple[dict[str, float], list[dict[str, int]]]:
        """
        The metrics of held-out prompts, greedy and sampled: what [`evaluate_policy`] returns (see there).

        Args:
            dataset ([`~datasets.Dataset`]):
                Held-out prompts and the columns `correct_func` reads.
            correct_func (`Callable`):
                Reward function; a completion is correct when its value is > 0.
            answer_func (`Callable[[str], str | None]`):
                A completion's final answer, `None` when it has none.
            sampling ([`~trl_topr.generation.SamplingSettings`], *optional*):
                How to sample the k samples. Defaults to `SamplingSettings(num_samples=4, seed=0)`.
            return_per_prompt (`bool`, *optional*, defaults to `False`):
                Also return each prompt's outcome.

        Returns:
            `dict[str, float]`, or with `return_per_prompt` the tuple `(metrics, per_prompt)`.
        """
        settings = sampling or SamplingSettings(num_samples=4, seed=0)

        def judged(sampling: SamplingSettings) -> tuple[Trajectories, list[bool]]:
            run = self.rollout(dataset, sampling)
            _, per_func = self.score(run, {"correct": correct_func})
            return run.trajectories, [value > 0 for value in per_func["correct"]]

        metrics, per_prompt = policy_metrics(
            judged(settings.greedy()),
            judged(settings),
            answer_func,
            settings,
            self.engine.eos_ids,
            with_tools=bool(self.tools) or self.environments is not None,
        )
        return (metrics, per_prompt) if return_per_prompt else metrics


def _is_sampling_column(name: str) -> bool:
    # Sampling's own columns in a prompts dataset (a sampled dataset sampled again): replaced, and not passed to the
    # reward functions; the prompts' other columns stay, whatever the functions are called
    return name in SAMPLING_COLUMNS or name.startswith(REWARD_COLUMNS_PREFIX)


def generate_completions(
    model: PreTrainedModel | None,
    processing_class: PreTrainedTokenizerBase,
    prompts: list,
    sampling: SamplingSettings | None = None,
    *,
    engine: GenerationEngine | None = None,
    progress: bool = True,
    bf16: bool | None = None,
) -> tuple[list, list[list[int]], float]:
    """
    Generate `sampling.num_samples` completions per prompt, with `model.generate` (batched, left padding) or another
    engine: a [`Sampler`] without rewards, for one call ([`Sampler.generate`]).

    Prompts are tokenized as [`TOPRTrainer`] tokenizes them (the chat template with a generation prompt for messages),
    so the model samples in the context it is trained in. Under several processes (`accelerate launch`), each
    generates a share of the prompts with its copy of the model and every process gets all the completions, in prompt
    order. With transformers, the key/values of each prompt are computed once and shared by its samples.

    Args:
        model ([`~transformers.PreTrainedModel`], *optional*):
            Causal LM (`None` with an `engine`).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            Its tokenizer.
        prompts (`list`):
            Prompts, text or lists of messages.
        sampling ([`~trl_topr.generation.SamplingSettings`], *optional*):
            How to sample (`temperature=0` decodes greedily). Defaults to `SamplingSettings()`: one completion per
            prompt at temperature 1.
        engine ([`~trl_topr.generation.GenerationEngine`], *optional*):
            Generate with this engine (e.g. vLLM, from [`~trl_topr.generation.generation_engine`]) instead of
            `model.generate`. It must hold the same weights as `model`.
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar over prompts, with the throughput.
        bf16 (`bool`, *optional*):
            Generate under bf16 autocast (transformers). Defaults to the hardware: where bf16 is faster on the
            model's device (see [`~trl_topr.precision.bf16_is_faster`]).

    Returns:
        `tuple[list, list[list[int]], float]`: the completions (prompt-major: the samples of prompt 0 first; messages
        for conversational prompts), their token ids up to and including the first end-of-sequence token, and the
        generation throughput in tokens/s.
    """
    with Sampler(model, processing_class, engine=engine, bf16=bf16, progress=progress) as sampler:
        out = sampler.generate(prompts, sampling)
    return out.completions, out.completion_ids, out.tokens_per_s


def sample_completions(
    model: str | PreTrainedModel,
    dataset: Dataset,
    reward_funcs: RewardFuncs,
    *,
    processing_class: PreTrainedTokenizerBase | None = None,
    reward_weights: list[float] | None = None,
    sampling: SamplingSettings | None = None,
    args=None,
    engine: GenerationEngine | None = None,
    behavior_logps_source: str = "trainer",
    tools: list[Callable] | None = None,
    max_tool_calling_iterations: int | None = None,
    environment_factory: EnvironmentFactory | Environments | None = None,
    progress: bool = True,
) -> Dataset:
    """
    Sample a TOPR dataset: completions of the prompts by `model`, their rewards, and their behavior log-probs.

    Args:
        model (`str` or [`~transformers.PreTrainedModel`]):
            The sampling (behavior) model, or its id/path (loaded the TRL way with `args.model_init_kwargs`).
        dataset ([`~datasets.Dataset`]):
            Prompts in a `prompt` column (text or messages); other columns are passed to the reward functions and
            copied to every sample of their prompt.
        reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`):
            Reward functions with TRL GRPO's signature `fn(prompts, completions, **columns) -> list[float | None]`;
            any function written for `GRPOTrainer` works. Each gets a column of its own, `rewards/<name>`
            (see [`reward_column`]), whatever its name.
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer; loaded from the model's name if `None`.
        reward_weights (`list[float]`, *optional*):
            Weights of the functions in the combined `reward` column (default 1 each).
        sampling ([`~trl_topr.generation.SamplingSettings`], *optional*):
            How to sample: completions per prompt, temperature, top-p, top-k, length, batch size (also that of the
            behavior log-prob computation) and seed. Defaults to `SamplingSettings(num_samples=4, seed=0)`; the
            paper's GSM8K runs used `SamplingSettings(num_samples=16, top_k=500, max_new_tokens=512)`.
        args ([`TOPRConfig`], *optional*):
            The configuration the dataset will be trained with: its `max_length`, mixed precision, `padding_free` and
            `model_init_kwargs` set how the behavior log-probs are computed. Defaults to training's defaults (the
            precision the hardware computes fastest). The returned columns always have the canonical names.
        engine ([`~trl_topr.generation.GenerationEngine`], *optional*):
            Generate with this engine (e.g. vLLM, from [`~trl_topr.generation.generation_engine`]), holding the same
            weights as `model`. Defaults to transformers' `generate` with `model`, in the precision of `args`.
        behavior_logps_source (`str`, *optional*, defaults to `"trainer"`):
            Where the behavior log-probs come from: `"trainer"`, recomputed by `model` as the trainer computes them;
            `"sampler"`, the engine's own (vLLM's), free but computed by other kernels.
        tools (`list[Callable]`, *optional*):
            Tools the policy may call, as TRL's GRPO trainer takes them (functions with type hints and a docstring
            describing their arguments; conversational prompts, and a chat template that supports tools). Each
            completion is then a trajectory ([`~trl_topr.rollout.rollout`]): the policy's turns
            and the tools' results, within `sampling.max_new_tokens` tokens in all. Its `tool_mask` marks the tokens
            the policy generated, which alone are trained and make up its behavior log-probs; reward functions see
            the whole trajectory.
        max_tool_calling_iterations (`int`, *optional*):
            With `tools`, the most rounds of calls of a trajectory (TRL GRPO's option); `None`: no limit but the
            length.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*):
            TRL GRPO's environments (see [`~trl_topr.environments.Environments`]): each trajectory gets an instance,
            reset with its row, whose methods are its tools (beside `tools`); its `prompt` is the prompt as `reset`
            left it, reward functions get the instances as `environments`, and an environment's `get_reward` scores
            its trajectories as one more reward function, named after its class (weight 1). An `Environments`
            keeps its instances from call to call.
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar over prompts.

    Returns:
        [`~datasets.Dataset`]: one row per completion with `prompt`, `completion`, `reward`, `behavior_logps` (one
        value per completion token, the whole completion), `prompt_ids` and `completion_ids` (the token ids generated
        from and generated, which training uses exactly: a completion cut at `max_new_tokens` gets no end token), one
        column `rewards/<name>` per reward function, `sampler_logps` (vLLM's raw log-prob of each completion token,
        with vLLM only), and the prompt's other columns — the [`TOPRTrainer`] data contract, trainable
        with `args`. With `tools`, also `tool_mask`, `tool_call_count` and `tool_failure_count`, and
        `behavior_logps` has one value per generated token; the `completion` column holds each tool call's arguments
        as JSON text (OpenAI's format: one column type for any tool), reward functions get them parsed. An empty
        completion (the model ended at once) is kept:
        it is trained on its end-of-sequence token, the decision to stop.

    Raises:
        [`TOPRDataError`]:
            Before anything is generated, when a prompt leaves no room for a completion within `args.max_length`.

    Example:
    ```python
    >>> from trl_topr import sample_completions
    >>> from trl_topr.generation import SamplingSettings
    >>> from trl_topr.rewards import gsm8k_reward

    >>> samples = sample_completions(  # doctest: +SKIP
    ...     "HuggingFaceTB/SmolLM2-135M-Instruct", prompts, gsm8k_reward, sampling=SamplingSettings(num_samples=8)
    ... )
    ```
    """
    sampler = Sampler(
        model,
        processing_class,
        reward_funcs,
        reward_weights=reward_weights,
        engine=engine,
        args=args,
        behavior_logps_source=behavior_logps_source,
        tools=tools,
        max_tool_calling_iterations=max_tool_calling_iterations,
        environment_factory=environment_factory,
        progress=progress,
    )
    with sampler:
        return sampler.sample(dataset, sampling)


def evaluate_policy(
    model: PreTrainedModel | None,
    processing_class: PreTrainedTokenizerBase,
    dataset: Dataset,
    correct_func: Callable,
    answer_func: Callable[[str], str | None],
    sampling: SamplingSettings | None = None,
    *,
    engine: GenerationEngine | None = None,
    progress: bool = True,
    bf16: bool | None = None,
    tools: list[Callable] | None = None,
    max_tool_calling_iterations: int | None = None,
    environment_factory: EnvironmentFactory | Environments | None = None,
    return_per_prompt: bool = False,
) -> dict[str, float] | tuple[dict[str, float], list[dict[str, int]]]:
    """
    Accuracy and validity of a policy's answers, as the TOPR paper reports them: greedy decoding, then
    `sampling.num_samples` samples per prompt.

    Args:
        model ([`~transformers.PreTrainedModel`], *optional*):
            Policy to evaluate (`None` with an `engine` that holds it).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            Its tokenizer.
        dataset ([`~datasets.Dataset`]):
            Held-out prompts (`prompt` column) and the columns `correct_func` needs (e.g. `answer`).
        correct_func (`Callable`):
            Reward function with TRL GRPO's signature; a completion is correct when its value is > 0 (e.g.
            [`~trl_topr.rewards.gsm8k_reward`]).
        answer_func (`Callable[[str], str | None]`):
            Final answer of a completion text, `None` when it has none (an invalid output); used for maj@k and the
            invalid rate (e.g. [`~trl_topr.rewards.extract_final_answer`]).
        sampling ([`~trl_topr.generation.SamplingSettings`], *optional*):
            How to sample the k samples of the sampled pass@1 and maj@k (k = `num_samples`). Defaults to
            `SamplingSettings(num_samples=4, seed=0)`.
        engine ([`~trl_topr.generation.GenerationEngine`], *optional*):
            Generate with this engine (e.g. vLLM, from [`~trl_topr.generation.generation_engine`]), holding the
            policy's weights, instead of `model.generate`.
        progress (`bool`, *optional*, defaults to `True`):
            Show progress bars.
        bf16 (`bool`, *optional*):
            Generate under bf16 autocast (transformers, without an `engine`). Defaults to the hardware (see
            [`~trl_topr.precision.bf16_is_faster`]).
        tools (`list[Callable]`, *optional*):
            Tools the policy may call, as in [`~trl_topr.sample_completions`]: each answer is then the last turn of
            a trajectory ([`~trl_topr.rollout.rollout`]).
        max_tool_calling_iterations (`int`, *optional*):
            The most rounds of tool calls of a trajectory; `None` for no limit but the length.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*):
            TRL GRPO's environments, as in [`~trl_topr.sample_completions`]: each trajectory, greedy or sampled, gets
            an instance reset with its row; `correct_func` gets them as `environments`.
        return_per_prompt (`bool`, *optional*, defaults to `False`):
            Also return each prompt's outcome, in the dataset's order: `{"greedy_correct": 0 or 1, "correct": the
            number of its k samples that are correct, "invalid": the number without a final answer}`. Paired
            comparisons of two policies on the same prompts (a bootstrap over prompts) need them.

    Returns:
        `dict[str, float]`: `pass@1_greedy` (greedy accuracy), `pass@1` (mean accuracy of the samples),
        `maj@k` (accuracy of the most frequent valid answer among the k samples), `invalid_rate` (share of samples
        without a final answer), `invalid_rate_greedy`, and two signs of degeneration: `truncated_rate` (share of
        samples that reach `max_new_tokens` without ending) and `mean_length` (mean sample length in tokens). With
        `tools`, also `tool_call_rate` and `tool_call_rate_greedy` (tool calls per sample) and `tool_failure_rate`
        (failed calls per sample); the lengths count the tools' results too. With `return_per_prompt`, the tuple
        `(metrics, per_prompt)`.
    """
    sampler = Sampler(
        model,
        processing_class,
        engine=engine,
        tools=tools,
        max_tool_calling_iterations=max_tool_calling_iterations,
        environment_factory=environment_factory,
        bf16=bf16,
        progress=progress,
    )
    with sampler:
        return sampler.evaluate(dataset, correct_func, answer_func, sampling, return_per_prompt)


def _scored_samples(samples, completions, completion_ids, row_prompt_ids, rewards, per_func) -> Dataset:
    # One row per completion: the prompt's columns, the completion, its ids, its rewards (combined and per function).
    # Sampling's own columns in the prompts are replaced; the prompts' other columns stay.
    replaced = [c for c in samples.column_names if _is_sampling_column(c)]
    samples = samples.remove_columns([c for c in replaced if c != PROMPT])
    samples = samples.add_column(COMPLETION, completions).add_column(REWARD, rewards)
    # The ids the model generated from and generated: what training trains on, exactly (no text round trip, no
    # end-of-sequence token added to a completion cut at `max_new_tokens`).
    samples = samples.add_column(PROMPT_IDS, row_prompt_ids).add_column(COMPLETION_IDS, completion_ids)
    for name, values in per_func.items():
        samples = samples.add_column(reward_column(name), values)
    return samples


def behavior_logps_mismatch(samples: Dataset) -> dict[str, float]:
    """
    The training/inference mismatch of sampled completions: per sequence, |log mu_sampler - log mu_trainer|, the
    summed log-probs of the completion under the sampler (`sampler_logps`, vLLM) and under the trainer's forward
    (`behavior_logps`), over the tokens both cover.

    Args:
        samples ([`~datasets.Dataset`]):
            Output of [`sample_completions`] with vLLM and `behavior_logps_source="trainer"`.

    Returns:
        `dict[str, float]`: `behavior_logps_mismatch_mean` and `behavior_logps_mismatch_max` (nats per sequence);
        empty without a `sampler_logps` column.
    """
    if SAMPLER_LOGPS not in samples.column_names:
        return {}
    return logps_mismatch(samples[SAMPLER_LOGPS], samples[BEHAVIOR_LOGPS])


def logps_mismatch(sampler_logps: list[list[float]], trainer_logps: list[list[float]]) -> dict[str, float]:
    """
    [`behavior_logps_mismatch`] of two lists of per-token log-probs, one list per sequence.

    Args:
        sampler_logps (`list[list[float]]`):
            The sampler's log-probs.
        trainer_logps (`list[list[float]]`):
            The trainer's.

    Returns:
        `dict[str, float]`: `behavior_logps_mismatch_mean` and `behavior_logps_mismatch_max`.
    """
    differences = []
    for sampler, trainer in zip(sampler_logps, trainer_logps, strict=True):
        length = min(len(sampler), len(trainer))
        differences.append(abs(math.fsum(sampler[:length]) - math.fsum(trainer[:length])))
    return {
        "behavior_logps_mismatch_mean": sum(differences) / max(len(differences), 1),
        "behavior_logps_mismatch_max": max(differences, default=0.0),
    }
