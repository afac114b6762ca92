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

import contextlib
import dataclasses
import inspect
import math
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate import PartialState
from accelerate.logging import get_logger
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, set_seed
from trl.data_utils import _tokenize
from trl.trainer.utils import create_model_from_path

from .config import CHECKPOINTING, TOPRConfig
from .data import BEHAVIOR_LOGPS, COMPLETION, COMPLETION_IDS, PROMPT, PROMPT_IDS, REWARD, TOPRDataError
from .distributed import full_weights
from .precision import autocast
from .trainer import TOPRTrainer
from .vllm import vllm_generation_from_config


logger = get_logger(__name__)

SAMPLER_LOGPS = "sampler_logps"
RewardFuncs = Callable | list[Callable] | dict[str, Callable]


def _named_reward_funcs(reward_funcs: RewardFuncs) -> dict[str, Callable]:
    if callable(reward_funcs):
        reward_funcs = [reward_funcs]
    if isinstance(reward_funcs, dict):
        return dict(reward_funcs)
    named = {}
    for func in reward_funcs:
        name = getattr(func, "__name__", type(func).__name__)
        if name in named:
            raise ValueError(f"Two reward functions are named {name!r}: pass a dict to name their columns.")
        named[name] = func
    return named


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
            Other dataset columns, one value per completion, passed to every function.

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
    funcs = _named_reward_funcs(reward_funcs)
    weights = [1.0] * len(funcs) if reward_weights is None else list(reward_weights)
    if len(weights) != len(funcs):
        raise ValueError(f"{len(weights)} reward weights for {len(funcs)} reward functions.")
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
    rewards = []
    for row in range(len(completions)):
        terms = [w * per_func[name][row] for name, w in zip(funcs, weights) if not math.isnan(per_func[name][row])]
        if not terms:
            raise ValueError(f"Every reward function returned None for completion {row}: {completions[row]!r}.")
        rewards.append(sum(terms))
    return rewards, per_func


def vllm_sampling_kwargs(
    num_samples: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int, seed: int | None
) -> dict[str, Any]:
    """
    Arguments of `vllm.SamplingParams` equivalent to the transformers settings of [`generate_completions`].

    Args:
        num_samples (`int`): Completions per prompt.
        temperature (`float`): Sampling temperature; 0 is greedy (one completion, repeated).
        top_p (`float`): Nucleus sampling threshold.
        top_k (`int`): Top-k, 0 to disable (vLLM's -1).
        max_new_tokens (`int`): Maximum completion length.
        seed (`int`, *optional*): Seed of the sampling.

    Returns:
        `dict[str, Any]`: keyword arguments of `vllm.SamplingParams`.

    Example:
    ```python
    >>> vllm_sampling_kwargs(16, 1.0, 1.0, 500, 512, seed=0)
    {'n': 16, 'temperature': 1.0, 'top_p': 1.0, 'top_k': 500, 'max_tokens': 512, 'seed': 0}

    ```
    """
    greedy = temperature == 0
    return {
        "n": 1 if greedy else num_samples,
        "temperature": temperature,
        "top_p": 1.0 if greedy else top_p,
        "top_k": -1 if greedy or top_k <= 0 else top_k,
        "max_tokens": max_new_tokens,
        "seed": seed,
    }


def generate_completions(
    model: PreTrainedModel,
    processing_class: PreTrainedTokenizerBase,
    prompts: list,
    *,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    seed: int | None = None,
    vllm_generation=None,
    progress: bool = True,
    bf16: bool | None = None,
) -> tuple[list, list[list[int]], float]:
    """
    Generate `num_samples` completions per prompt, with `model.generate` (batched, left padding) or vLLM.

    Prompts are tokenized as [`TOPRTrainer`] tokenizes them (the chat template with a generation prompt for messages),
    so the model samples in the context it is trained in. `temperature=0` decodes greedily. Under several processes
    (`accelerate launch`), each generates a share of the prompts with its copy of the model and every process gets all
    the completions, in prompt order. With transformers, the key/values of each prompt are computed once and shared by
    its `num_samples` completions.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            Causal LM (its generation config still gives the end-of-sequence tokens with `vllm_generation`).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            Its tokenizer.
        prompts (`list`):
            Prompts, text or lists of messages.
        num_samples (`int`, *optional*, defaults to `1`):
            Completions per prompt.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; 0 for greedy decoding.
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling threshold (1 disables it).
        top_k (`int`, *optional*, defaults to `0`):
            Top-k sampling (0 disables it; transformers' own default is 50).
        max_new_tokens (`int`, *optional*, defaults to `256`):
            Maximum completion length.
        batch_size (`int`, *optional*, defaults to `16`):
            Prompts per `generate` call (each yields `num_samples` sequences); vLLM gets every prompt at once.
        seed (`int`, *optional*):
            Seed of vLLM's sampling (transformers uses the global seed: call `set_seed` first).
        vllm_generation ([`~trl_topr.vllm.TOPRVLLMGeneration`], *optional*):
            Generate with this vLLM sampler (colocated engine or server) instead of transformers. It must hold the
            same weights as `model`.
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar over prompts, with the throughput.
        bf16 (`bool`, *optional*):
            Generate under bf16 autocast. Defaults to the hardware: where the model's device computes bf16 natively
            (see [`~trl_topr.precision.has_native_bf16`]).

    Returns:
        `tuple[list, list[list[int]], float]`: the completions (prompt-major: the samples of prompt 0 first; messages
        for conversational prompts), their token ids up to and including the first end-of-sequence token, and the
        generation throughput in tokens/s.
    """
    completions, sequences, _, tokens_per_s = _generate(
        model, processing_class, prompts, num_samples=num_samples, temperature=temperature, top_p=top_p, top_k=top_k,
        max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, vllm_generation=vllm_generation,
        progress=progress, bf16=bf16,
    )  # fmt: skip
    return completions, sequences, tokens_per_s


def _generate(model, processing_class, prompts, *, num_samples, progress, vllm_generation, **settings):
    # `generate_completions`, with the sampler's log-prob of each completion token (vLLM) or `None` (transformers)
    state = PartialState()
    settings.update(num_samples=num_samples, vllm_generation=vllm_generation)
    # The model's weights are read whole by transformers' generate (gathered once under ZeRO-3), not by vLLM
    gathered = full_weights(model) if model is not None and vllm_generation is None else contextlib.nullcontext()
    if state.num_processes == 1:
        with gathered:
            return _generate_local(model, processing_class, prompts, progress=progress, **settings)
    # Each process generates an equal contiguous share of the prompts, the last shares padded with copies of the last
    # prompt (dropped after gathering): under FSDP2 and ZeRO-3 every forward is a collective, so every process runs
    # as many batches (and `generate` keeps their steps in sync). Gathering in rank order restores the order.
    # (accelerate's `apply_padding` pads each short share in place, which leaves the copies mid-list after gathering,
    # and fails for a process that gets no prompt at all.)
    prompts = list(prompts)
    padded = prompts + prompts[-1:] * (-len(prompts) % state.num_processes)
    if settings.get("seed") is not None:  # vLLM seeds prompt i with seed + i, whatever the number of processes
        settings["seed"] += state.process_index * (len(padded) // state.num_processes)
    with state.split_between_processes(padded) as shard, gathered:
        completions, sequences, logprobs, tokens_per_s = _generate_local(
            model, processing_class, shard, progress=progress and state.is_main_process, **settings
        )
    kept = len(prompts) * num_samples
    logprobs = None if logprobs is None else gather_object(logprobs)[:kept]
    return (gather_object(completions)[:kept], gather_object(sequences)[:kept], logprobs,
            sum(gather_object([tokens_per_s])))  # fmt: skip


def end_of_sequence_ids(model: PreTrainedModel | None, processing_class: PreTrainedTokenizerBase) -> set[int]:
    """The token ids that end a generation: the tokenizer's EOS and those of the model's generation config."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    eos_ids = {tokenizer.eos_token_id}
    if model is not None and model.generation_config.eos_token_id is not None:
        configured = model.generation_config.eos_token_id
        eos_ids |= set(configured if isinstance(configured, list) else [configured])
    return eos_ids


def _prompt_ids(processing_class, prompt) -> list[int]:
    # As TOPRTrainer tokenizes a prompt: text as is, messages with the chat template and its generation prompt.
    if isinstance(prompt, list):
        return _tokenize(processing_class, prompt, add_generation_prompt=True)["input_ids"]
    return _tokenize(processing_class, prompt)["input_ids"]


def _prompt_cache_inputs(model: PreTrainedModel, inputs: dict[str, torch.Tensor], copies: int) -> dict[str, Any]:
    """
    Inputs of `model.generate` for `copies` completions of each prompt of `inputs` (left-padded `input_ids` and
    `attention_mask`), with the prompts' key/values computed once and shared by their copies, as a cache of all but
    the last prompt token. `model.generate(num_return_sequences=copies)` would compute them for every copy: with
    several samples per prompt, the prompts are most of the cost.
    """
    expanded = {name: tensor.repeat_interleave(copies, dim=0) for name, tensor in inputs.items()}
    if copies == 1 or inputs["input_ids"].size(1) < 2 or not model._supports_default_dynamic_cache():
        return expanded
    cache = DynamicCache(config=model.config)
    name = _cache_argument(model)
    model(input_ids=inputs["input_ids"][:, :-1], attention_mask=inputs["attention_mask"][:, :-1],
          **{name: cache}, use_cache=True)  # fmt: skip
    cache.batch_repeat_interleave(copies)
    return {**expanded, name: cache}


def _cache_argument(model: PreTrainedModel) -> str:
    # transformers 5.24 renamed the `past_key_values` argument of `forward` and `generate` to `cache` (the old name
    # warns until its removal); earlier versions know only the old one
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def _generate_local(
    model, processing_class, prompts, *, num_samples, temperature, top_p, top_k, max_new_tokens, batch_size, seed,
    vllm_generation, progress, bf16,
):
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    eos_ids = end_of_sequence_ids(model, processing_class)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    greedy = temperature == 0
    sequences, logprobs, start = [], [], time.perf_counter()
    bar = tqdm(total=len(prompts), desc="Sampling", unit="prompt", disable=not progress)
    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    # vLLM schedules its own batches: it gets every prompt at once
    step = max(len(prompts), 1) if vllm_generation is not None else batch_size
    for first in range(0, len(prompts), step):
        batch = prompts[first : first + step]
        prompt_ids = [_prompt_ids(processing_class, p) for p in batch]
        generated_logprobs = None
        if vllm_generation is not None:
            kwargs = vllm_sampling_kwargs(num_samples, temperature, top_p, top_k, max_new_tokens,
                                          None if seed is None else seed + first)  # fmt: skip
            generated, generated_logprobs = vllm_generation.sample(prompt_ids, kwargs)
        else:
            inputs = tokenizer.pad({"input_ids": prompt_ids}, padding_side="left", return_tensors="pt").to(model.device)
            with autocast(model.device, bf16):
                outputs = model.generate(
                    **_prompt_cache_inputs(model, dict(inputs), 1 if greedy else num_samples),
                    do_sample=not greedy,
                    temperature=None if greedy else temperature,
                    top_p=None if greedy else top_p,
                    top_k=None if greedy else top_k,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad_id,
                )
            generated = outputs[:, inputs["input_ids"].size(1) :].tolist()
        if greedy:  # every sample of a prompt is the same greedy completion
            generated = [ids for ids in generated for _ in range(num_samples)]
            if generated_logprobs is not None:
                generated_logprobs = [lp for lp in generated_logprobs for _ in range(num_samples)]
        # cut at the first end-of-sequence token (what follows is padding)
        cut = [next((i + 1 for i, t in enumerate(ids) if t in eos_ids), len(ids)) for ids in generated]
        sequences += [ids[:end] for ids, end in zip(generated, cut, strict=True)]
        if generated_logprobs is None:
            logprobs = None
        elif logprobs is not None:
            logprobs += [lp[:end] for lp, end in zip(generated_logprobs, cut, strict=True)]
        bar.update(len(batch))
        bar.set_postfix(tokens_per_s=f"{sum(map(len, sequences)) / (time.perf_counter() - start):.0f}")
    bar.close()
    if model is not None:
        model.train(was_training)
    completions = []
    for index, ids in enumerate(sequences):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        prompt = prompts[index // num_samples]
        completions.append([{"role": "assistant", "content": text}] if isinstance(prompt, list) else text)
    return completions, sequences, logprobs, sum(map(len, sequences)) / max(time.perf_counter() - start, 1e-9)


class _SelfScorer(TOPRTrainer):
    # Computes the behavior log-probs of samples exactly as training will; mu is the sampling model itself, as
    # expected, so no warning about it.
    _behavior_is_this_model = True


def _checked_prompt_ids(processing_class, prompts: list, max_length: int | None) -> list[list[int]]:
    # The prompts' token ids, each checked before anything is generated: a prompt of `max_length` tokens or more
    # leaves no completion token to train on.
    all_ids = [_prompt_ids(processing_class, prompt) for prompt in prompts]
    for row, ids in enumerate(all_ids):
        length = len(ids)
        if max_length is not None and length >= max_length:
            raise TOPRDataError(
                f"prompts dataset, column '{PROMPT}', row {row}: the prompt has {length} tokens, which fill "
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
    num_samples: int = 4,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 256,
    seed: int = 0,
    batch_size: int = 16,
    args: TOPRConfig | None = None,
    vllm_generation=None,
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
            any function written for `GRPOTrainer` works. Each gets a column of its own.
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer; loaded from the model's name if `None`.
        reward_weights (`list[float]`, *optional*):
            Weights of the functions in the combined `reward` column (default 1 each).
        num_samples (`int`, *optional*, defaults to `4`):
            Completions per prompt (the paper: 16 for GSM8K).
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature (the paper: 1).
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling threshold.
        top_k (`int`, *optional*, defaults to `0`):
            Top-k sampling, 0 to disable (the paper: 500).
        max_new_tokens (`int`, *optional*, defaults to `256`):
            Maximum completion length (the paper: 512).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the sampling.
        batch_size (`int`, *optional*, defaults to `16`):
            Prompts per generation batch, and batch size of the behavior log-prob computation.
        args ([`TOPRConfig`], *optional*):
            The configuration the dataset will be trained with: its `max_length`, mixed precision and
            `model_init_kwargs` set how the behavior log-probs are computed. Defaults to a default [`TOPRConfig`].
            The returned columns always have the canonical names.
        vllm_generation ([`~trl_topr.vllm.TOPRVLLMGeneration`], *optional*):
            Generate with this vLLM sampler, holding the same weights as `model`. Without it, `args.use_vllm` starts
            one for this call ([`~trl_topr.vllm.vllm_generation_from_config`]). The behavior log-probs come from
            `args.behavior_logps_source`: recomputed by `model` as the trainer computes them (default), or vLLM's own.
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar over prompts.

    Returns:
        [`~datasets.Dataset`]: one row per completion with `prompt`, `completion`, `reward`, `behavior_logps` (one
        value per completion token, the whole completion), `prompt_ids` and `completion_ids` (the token ids generated
        from and generated, which training uses exactly: a completion cut at `max_new_tokens` gets no end token), one
        column per reward function, `sampler_logps` (vLLM's raw log-prob of each completion token, with vLLM only),
        and the prompt's other columns — the [`TOPRTrainer`] data contract, trainable
        with `args`. An empty completion (the model ended at once) is kept: it is trained on its end-of-sequence
        token, the decision to stop.

    Raises:
        [`TOPRDataError`]:
            Before anything is generated, when a prompt leaves no room for a completion within `args.max_length`.
    """

    if PROMPT not in dataset.column_names:
        raise ValueError(f"The prompts dataset needs a '{PROMPT}' column (found {dataset.column_names}).")
    with tempfile.TemporaryDirectory() as scratch:
        if args is None:
            args = TOPRConfig(output_dir=scratch, use_cpu=not torch.cuda.is_available(), report_to="none")
        max_length = args.max_length
        # The scoring trainer keeps every completion token (`max_length=None`): the per-token behavior log-probs cover
        # the whole completion, and training truncates them with it, whatever its `max_length`.
        args = dataclasses.replace(
            args, output_dir=scratch, report_to="none", **{CHECKPOINTING: False}, shuffle_dataset=False,
            precompute_behavior_batch_size=batch_size, push_to_hub=False, prompt_column=PROMPT, max_length=None,
            completion_column=COMPLETION, reward_column=REWARD, behavior_logps_column=BEHAVIOR_LOGPS,
            target_positive_fraction=None,  # scoring needs no baseline (and a one-sided sample has none)
        )  # fmt: skip
        if isinstance(model, str):
            model = create_model_from_path(model, **(args.model_init_kwargs or {}))
        args = dataclasses.replace(args, model_init_kwargs=None)  # the scoring trainer gets the loaded model
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        prompts = list(dataset[PROMPT])
        prompt_ids = _checked_prompt_ids(processing_class, prompts, max_length)

        engine_of_this_call = vllm_generation is None and args.use_vllm
        if engine_of_this_call:
            vllm_generation = vllm_generation_from_config(model, processing_class, args)
        set_seed(seed + PartialState().process_index)  # processes sample different shares of the prompts
        completions, completion_ids, sampler_logps, tokens_per_s = _generate(
            model, processing_class, prompts, num_samples=num_samples, temperature=temperature, top_p=top_p,
            top_k=top_k, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
            vllm_generation=vllm_generation, progress=progress, bf16=args.bf16,
        )  # fmt: skip
        if engine_of_this_call:
            vllm_generation.close()  # its memory back before the trainer's forward
        logger.info(f"Sampled {len(completions)} completions at {tokens_per_s:.1f} tokens/s.")
        rows = [i for i in range(len(dataset)) for _ in range(num_samples)]
        samples = dataset.select(rows)
        others = {c: list(samples[c]) for c in samples.column_names if c not in (PROMPT, COMPLETION, REWARD)}
        rewards, per_func = score_completions(
            list(samples[PROMPT]), completions, reward_funcs, reward_weights, completion_ids, **others
        )
        replaced = (COMPLETION, REWARD, BEHAVIOR_LOGPS, PROMPT_IDS, COMPLETION_IDS, SAMPLER_LOGPS)
        samples = samples.remove_columns([c for c in replaced if c in samples.column_names])
        samples = samples.add_column(COMPLETION, completions).add_column(REWARD, rewards)
        # The ids the model generated from and generated: what training trains on, exactly (no text round trip, no
        # end-of-sequence token added to a completion cut at `max_new_tokens`).
        samples = samples.add_column(PROMPT_IDS, [prompt_ids[row] for row in rows])
        samples = samples.add_column(COMPLETION_IDS, completion_ids)
        for name, values in per_func.items():
            samples = samples.remove_columns(name) if name in samples.column_names else samples
            samples = samples.add_column(name, values)
        if sampler_logps is not None:
            samples = samples.add_column(SAMPLER_LOGPS, sampler_logps)
        if args.behavior_logps_source == "sampler":
            if sampler_logps is None or any(v is None for row in sampler_logps for v in row):
                raise ValueError("`behavior_logps_source='sampler'` needs vLLM's log-prob of every sampled token.")
            return samples.add_column(BEHAVIOR_LOGPS, sampler_logps)
        was_training = model.training
        scorer = _SelfScorer(model, args=args, train_dataset=samples, processing_class=processing_class)
        behavior = list(scorer.train_dataset[BEHAVIOR_LOGPS])
        model.train(was_training)
        samples = samples.add_column(BEHAVIOR_LOGPS, behavior)
    if sampler_logps is not None:
        mismatch = behavior_logps_mismatch(samples)
        logger.info(f"Behavior log-probs, sampler against trainer, per sequence: mean |difference| "
                    f"{mismatch['behavior_logps_mismatch_mean']:.2e}, max {mismatch['behavior_logps_mismatch_max']:.2e}")
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
    return {"behavior_logps_mismatch_mean": sum(differences) / max(len(differences), 1),
            "behavior_logps_mismatch_max": max(differences, default=0.0)}  # fmt: skip
