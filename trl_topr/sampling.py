"""Sampling: turn prompts into a scored TOPR dataset with behavior log-probs, using the model being trained.

[`sample_completions`] generates `num_samples` completions per prompt, scores them with TRL GRPO-style reward
functions, and computes `behavior_logps` exactly as [`TOPRTrainer`] will compute log pi for the same model and row
(same tokenization, same completion tokens, temperature-1 softmax, same mixed precision): training on the result with
that model starts with every importance ratio at 1.

About mu: the completions are *drawn* from the sampling distribution (temperature, top-p, top-k), but `behavior_logps`
is the log-probability of the completion under the model's plain softmax, the distribution TOPR's ratio pi/mu
compares pi with. With temperature 1 and no top-p/top-k truncation the two coincide; otherwise the ratio corrects
towards the model's own distribution, not the tempered or truncated one.
"""

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
from .generation import (
    BEHAVIOR_LOGPS_SOURCES,
    GenerationEngine,
    SamplingSettings,
    TransformersEngine,
    generation_engine,
    prompt_ids,
)
from .logprobs import behavior_logps, completion_row, logps_settings
from .rollout import prepare_tool_calling, rollout
from .trajectories import storable


logger = get_logger(__name__)

SAMPLER_LOGPS = "sampler_logps"
# A trajectory's tool calls and failed calls, with tools
TOOL_CALL_COUNT, TOOL_FAILURE_COUNT = "tool_call_count", "tool_failure_count"
TOOL_COLUMNS = (TOOL_MASK, TOOL_CALL_COUNT, TOOL_FAILURE_COUNT)
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

    # environments' state is on the main process, which took their steps: score there, once
    per_func = on_main_process(each_function) if ENVIRONMENTS in columns else each_function()
    rewards = []
    for row in range(len(completions)):
        terms = [w * per_func[name][row] for name, w in zip(funcs, weights) if not math.isnan(per_func[name][row])]
        if not terms:
            raise ValueError(f"Every reward function returned None for completion {row}: {completions[row]!r}.")
        rewards.append(sum(terms))
    return rewards, per_func


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
    engine.

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
    engine = engine or TransformersEngine(model, processing_class, bf16=bf16)
    prompts = list(prompts)
    ids = [prompt_ids(processing_class, p) for p in prompts]
    out = rollout(engine, processing_class, prompts, ids, sampling or SamplingSettings(), progress=progress)
    return out.completions, out.completion_ids, out.tokens_per_s


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
    sampling = sampling or SamplingSettings(num_samples=4, seed=0)
    if behavior_logps_source not in BEHAVIOR_LOGPS_SOURCES:
        raise ValueError(
            f"`behavior_logps_source` must be one of {BEHAVIOR_LOGPS_SOURCES}, got {behavior_logps_source!r}."
        )
    check_prompts(dataset)
    environments = as_environments(environment_factory, tools)
    reward_funcs, reward_weights = reward_functions(reward_funcs, reward_weights, environments)  # before generating
    PartialState()  # the processes' state, which accelerate's logger reads
    if isinstance(model, str):
        model = create_model_from_path(model, **(getattr(args, "model_init_kwargs", None) or {}))
    processing_class = processing_class or AutoTokenizer.from_pretrained(model.config._name_or_path)
    instances = None
    if environments is not None:  # one row per trajectory, its prompt as its environment's reset left it
        dataset, tools, instances = environments.expand(dataset, sampling.num_samples)
        sampling = sampling.replace(num_samples=1)
    prompts = list(dataset[PROMPT])
    prepare_tool_calling(processing_class, tools, prompts)
    max_length = args.max_length if args is not None else DEFAULT_MAX_LENGTH
    all_prompt_ids = checked_prompt_ids(processing_class, prompts, max_length, tools=tools)
    engine = engine or generation_engine(model, processing_class, train_args=args)
    out = rollout(
        engine, processing_class, prompts, all_prompt_ids, sampling, tools, max_tool_calling_iterations, progress
    )
    logger.info(f"Sampled {len(out.completion_ids)} completions at {out.tokens_per_s:.1f} tokens/s.")
    rows = [i for i in range(len(dataset)) for _ in range(sampling.num_samples)]
    completions = out.completions
    samples = _scored_samples(
        dataset.select(rows),
        completions,
        out.completion_ids,
        [all_prompt_ids[row] for row in rows],
        reward_funcs,
        reward_weights,
        stored=[storable(c) for c in completions] if tools else None,  # tool call arguments as JSON text
        environments=instances,
    )
    masks = out.tool_mask or [None] * len(samples)
    if tools:
        samples = samples.add_column(TOOL_MASK, out.tool_mask)
        samples = samples.add_column(TOOL_CALL_COUNT, out.tool_calls).add_column(TOOL_FAILURE_COUNT, out.tool_failures)
    if out.logprobs is not None:
        samples = samples.add_column(SAMPLER_LOGPS, out.logprobs)
    if behavior_logps_source == "sampler":
        if out.logprobs is None or any(v is None for row in out.logprobs for v in row):
            raise ValueError("`behavior_logps_source='sampler'` needs vLLM's log-prob of every sampled token.")
        return samples.add_column(BEHAVIOR_LOGPS, out.logprobs)
    rows = [completion_row(*row) for row in zip(samples[PROMPT_IDS], out.completion_ids, masks, strict=True)]
    # as the trainer of these samples will compute log pi
    settings = logps_settings(args, processing_class, model.device, batch_size=sampling.batch_size)
    samples = samples.add_column(BEHAVIOR_LOGPS, behavior_logps(model, rows, settings))
    if out.logprobs is not None:
        mismatch = behavior_logps_mismatch(samples)
        logger.info(
            f"Behavior log-probs, sampler against trainer, per sequence: mean |difference| "
            f"{mismatch['behavior_logps_mismatch_mean']:.2e}, max {mismatch['behavior_logps_mismatch_max']:.2e}"
        )
    return samples


def _scored_samples(
    samples, completions, completion_ids, row_prompt_ids, reward_funcs, reward_weights, stored=None, environments=None
) -> Dataset:
    # One row per completion: the prompt's columns, the completion, its ids, its rewards (combined and per function).
    # Sampling's own columns in the prompts (a sampled dataset sampled again) are replaced, and not passed to the
    # reward functions; the prompts' other columns stay, whatever the functions are called.
    replaced = [
        c
        for c in samples.column_names
        if c in (PROMPT, COMPLETION, REWARD, BEHAVIOR_LOGPS, PROMPT_IDS, COMPLETION_IDS, SAMPLER_LOGPS, *TOOL_COLUMNS)
        or c.startswith(REWARD_COLUMNS_PREFIX)
    ]
    others = {c: list(samples[c]) for c in samples.column_names if c not in replaced}
    others |= {ENVIRONMENTS: environments} if environments is not None else {}
    rewards, per_func = score_completions(
        list(samples[PROMPT]), completions, reward_funcs, reward_weights, completion_ids, **others
    )
    samples = samples.remove_columns([c for c in replaced if c != PROMPT])
    samples = samples.add_column(COMPLETION, stored or completions).add_column(REWARD, rewards)
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
    differences = []
    for sampler, trainer in zip(samples[SAMPLER_LOGPS], samples[BEHAVIOR_LOGPS], strict=True):
        length = min(len(sampler), len(trainer))
        differences.append(abs(math.fsum(sampler[:length]) - math.fsum(trainer[:length])))
    return {
        "behavior_logps_mismatch_mean": sum(differences) / max(len(differences), 1),
        "behavior_logps_mismatch_max": max(differences, default=0.0),
    }
