"""Log-probabilities of completions under a policy, computed exactly as [`TOPRTrainer`] computes log pi: the forward of
TRL's fused LM head (per-token log-probs without the full logits), on prompt + completion token ids, in the training
precision. Plain functions of a model, so that the trainer (its loss and its behavior precompute) and sampling (the
behavior log-probs of fresh samples) share one computation, and training on fresh samples starts at a ratio of 1."""

import contextlib
import dataclasses
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from transformers.utils import is_bitsandbytes_available
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils import add_fused_lm_head

from .compat import CHECKPOINTING
from .data import PaddingFreeCollator
from .distributed import check_holds_weights, full_weights, is_meta_model, map_across_processes
from .precision import autocast as inference_autocast
from .precision import training_autocast
from .tokens import padding_id


# The per-token outputs of the fused LM head that TRL's SFTTrainer asks for (TOPR reports the entropy too)
FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")


def with_fused_lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """
    Give `model` TRL's fused LM head (`model(..., labels=labels, fused_lm_head=True)` returns per-token log-probs), as
    `SFTTrainer` does, unless it has it already.

    Args:
        model (`torch.nn.Module`):
            A causal LM, or a PEFT model around one.

    Returns:
        `torch.nn.Module`: `model`.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(base.forward, "__func__", None), "__code__", None) is None or (
        base.forward.__func__.__code__.co_name != "_fused_forward"
    ):
        add_fused_lm_head(base, outputs=FUSED_OUTPUTS)
    return model


# What a batch holds besides the model's inputs
NOT_MODEL_INPUTS = ("rewards", "behavior_logps")


def to_device(batch: dict, device: torch.device) -> dict:
    """`batch` with its tensors on `device` (a padding-free batch also holds ints: its longest sequence)."""
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()}


def is_padding_free(inputs: dict[str, torch.Tensor]) -> bool:
    """Whether `inputs` is a padding-free batch (TRL's layout: rows laid end to end in one, `position_ids` restarting
    at 0 for each, no `attention_mask`), as `DataCollatorForLanguageModeling(padding_free=True)` makes it."""
    return "attention_mask" not in inputs and "position_ids" in inputs


def compiles_per_length(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention compiles once per padding-free batch length (flex attention), so that its
    padding-free batches are padded to a bucket of lengths (see [`~trl_topr.data.PaddingFreeCollator`])."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "_attn_implementation", None) == "flex_attention"


def completion_rows(values: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Per-token values of a batch's completions, one row per sequence: what [`topr_loss`] takes.

    In a padded batch that is the batch itself. In a padding-free batch, the rows are laid end to end in one sequence:
    each completion's values are taken out of it and placed, in order, left-aligned in a row of their own, with the
    gradient. The sequences are told apart by their restarting `position_ids`, as the attention tells them apart;
    sequences without any completion token (the padding to `pad_to_multiple_of`) are no rows.

    Args:
        values (`torch.Tensor` of shape `(rows, length - 1)`):
            One value per predicted token: position t holds the value of token t + 1 (log-probs, entropies, behavior
            log-probs placed at their tokens and shifted).
        inputs (`dict[str, torch.Tensor]`):
            The batch, with `labels` (-100 off the completion) and, when padding-free, `position_ids`.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: the values, shaped `(B, T)` with one row per sequence, and the boolean
        mask of their completion tokens.
    """
    mask = inputs["labels"][:, 1:] != -100
    if not is_padding_free(inputs):
        return values, mask
    sequence = (inputs["position_ids"] == 0).cumsum(-1)[:, 1:]  # the sequence of each predicted token
    lengths = torch.bincount(sequence[mask])
    lengths = lengths[lengths > 0]  # in order: every sequence of the batch has completion tokens
    rows_mask = torch.arange(int(lengths.max()), device=values.device) < lengths[:, None].to(values.device)
    return values.new_zeros(rows_mask.shape).masked_scatter(rows_mask, values[mask]), rows_mask


def completion_logps(model: torch.nn.Module, inputs: dict[str, torch.Tensor]):
    """
    Per-token log pi of each next token, with TRL's fused LM head: what [`TOPRTrainer`]'s loss trains.

    Args:
        model (`torch.nn.Module`):
            The policy, with TRL's fused LM head (see [`with_fused_lm_head`]).
        inputs (`dict[str, torch.Tensor]`):
            A padded batch with `input_ids`, `attention_mask` and `labels` (-100 off the completion), or a
            padding-free one ([`is_padding_free`]) with `position_ids` instead of the mask (and the sequence
            boundaries for variable-length attention kernels, as TRL's collator gives them).

    Returns:
        `tuple`: the log-probs, one row per sequence (see [`completion_rows`]), the completion mask of the same shape,
        and the model's outputs.
    """
    model_inputs = {name: value for name, value in inputs.items() if name not in NOT_MODEL_INPUTS}
    # Without a cache: with one, transformers does not build the mask that keeps padding-free sequences apart.
    outputs = model(**model_inputs, use_cache=False, fused_lm_head=True)
    length = inputs["input_ids"].size(1) - 1
    # Prompt-learning PEFT prepends virtual tokens to the outputs: keep the positions of the real tokens.
    return *completion_rows(outputs.log_probs[:, -length:], inputs), outputs


@contextlib.contextmanager
def inference_mode(model: torch.nn.Module, checkpointing_kwargs: dict | None = None):
    """
    Context for a forward that computes values only: eval mode (no dropout: mu is the policy that samples) and no
    activation checkpointing. bitsandbytes 4-bit layers stay in training mode: they hold no dropout but, on CPU in eval
    mode, repack their weights into an inference-only layout that later cuts the gradients of QLoRA training.

    Args:
        model (`torch.nn.Module`):
            The model.
        checkpointing_kwargs (`dict`, *optional*):
            The activation checkpointing arguments to restore it with, if it was enabled.
    """
    was_training = model.training
    checkpointing = getattr(model, f"is_{CHECKPOINTING}", False)
    model.eval()
    if checkpointing:
        getattr(model, f"{CHECKPOINTING}_disable")()
    if is_bitsandbytes_available():
        import bitsandbytes as bnb

        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.train()
    try:
        yield model
    finally:
        model.train(was_training)
        if checkpointing:
            getattr(model, f"{CHECKPOINTING}_enable")(checkpointing_kwargs)


def completion_row(
    prompt_ids: list[int], completion_ids: list[int], tool_mask: list[int] | None = None
) -> dict[str, list[int]]:
    """
    The tokenized row of a prompt and its completion, as training reads it: `input_ids` (prompt + completion) and
    `labels` (-100 on the prompt and on the completion tokens the policy did not produce, the ids elsewhere).

    Args:
        prompt_ids (`list[int]`):
            The prompt's token ids.
        completion_ids (`list[int]`):
            The completion's token ids.
        tool_mask (`list[int]`, *optional*):
            One 0 / 1 per completion token (TRL's `tool_mask`): 0 on a token the policy did not produce (a tool's
            result), which is context, not trained. By default every completion token is the policy's.

    Returns:
        `dict[str, list[int]]`: the row.
    """
    labels = completion_ids if tool_mask is None else [i if m else -100 for i, m in zip(completion_ids, tool_mask)]
    return {"input_ids": prompt_ids + completion_ids, "labels": [-100] * len(prompt_ids) + labels}


# Where the behavior log-probs mu of sampled completions come from: recomputed by the trainer's forward, or the
# sampler's own (vLLM's)
BEHAVIOR_LOGPS_SOURCES = ("trainer", "sampler")


def check_behavior_logps_source(source: str, use_vllm: bool | None = None) -> None:
    """
    Check where the behavior log-probs of sampled completions are to come from: the one check of the option, run by
    [`~trl_topr.TOPRLoopConfig`] (which knows the engine) and by [`~trl_topr.Sampler`].

    Args:
        source (`str`):
            `"trainer"` (recomputed by the trainer's forward) or `"sampler"` (the engine's own log-probs, vLLM's).
        use_vllm (`bool`, *optional*):
            Whether the engine is vLLM, where known: `"sampler"` needs it.

    Raises:
        `ValueError`: naming `behavior_logps_source`.
    """
    if source not in BEHAVIOR_LOGPS_SOURCES:
        raise ValueError(f"`behavior_logps_source` must be one of {BEHAVIOR_LOGPS_SOURCES}, got {source!r}.")
    if source == "sampler" and use_vllm is False:
        raise ValueError("`behavior_logps_source='sampler'` takes vLLM's log-probs: set `use_vllm=True` too.")


@dataclasses.dataclass
class LogpsSettings:
    """
    How [`behavior_logps`] computes log-probs so that they are exactly training's log pi: the few settings of a
    training configuration it needs, made by [`logps_settings`] (or a trainer's `logps_settings`) for one call.

    Args:
        pad_token_id (`int`):
            The tokenizer's padding id.
        batch_size (`int`, *optional*, defaults to `16`):
            Rows per forward.
        padding_free (`bool`, *optional*, defaults to `False`):
            Lay each batch's rows end to end without padding, as training with `padding_free=True` does.
        autocast (`contextlib.AbstractContextManager`, *optional*):
            The training's mixed precision context (a trainer's `accelerator.autocast()`,
            [`~trl_topr.precision.training_autocast`]); none by default.
        training_engine (`deepspeed.DeepSpeedEngine`, *optional*):
            The DeepSpeed engine holding the model once training has started (see
            [`~trl_topr.distributed.full_weights`]).
        checkpointing_kwargs (`dict`, *optional*):
            The model's activation checkpointing arguments, restored after.
    """

    pad_token_id: int
    batch_size: int = 16
    padding_free: bool = False
    autocast: contextlib.AbstractContextManager | None = None
    training_engine: Any = None
    checkpointing_kwargs: dict | None = None


def logps_settings(
    args, processing_class, device, *, batch_size: int | None = None, autocast=None, training_engine=None
) -> LogpsSettings:
    """
    The [`LogpsSettings`] of a training configuration: what every caller of [`behavior_logps`] passes.

    Args:
        args ([`~trl_topr.TOPRConfig`], *optional*):
            The training configuration (its mixed precision, `padding_free`, behavior precompute batch size and
            activation checkpointing arguments). `None`: training's defaults (the precision the hardware computes
            fastest, padded batches).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer (its padding id).
        device (`str` or `torch.device`):
            The model's device.
        batch_size (`int`, *optional*):
            Rows per forward; defaults to `args.precompute_behavior_batch_size`, else
            `args.per_device_eval_batch_size`.
        autocast (`contextlib.AbstractContextManager`, *optional*):
            The mixed precision context; defaults to `args`' ([`~trl_topr.precision.training_autocast`]).
        training_engine (`deepspeed.DeepSpeedEngine`, *optional*):
            The DeepSpeed engine holding the model, if any.

    Returns:
        [`LogpsSettings`]: the settings, for one call (an autocast context may be entered once only).
    """
    if args is None:
        autocast = autocast if autocast is not None else inference_autocast(device)
        return LogpsSettings(padding_id(processing_class), batch_size or 16, autocast=autocast)
    batch_size = batch_size or getattr(args, "precompute_behavior_batch_size", None) or args.per_device_eval_batch_size
    return LogpsSettings(
        padding_id(processing_class),
        batch_size,
        padding_free=bool(getattr(args, "padding_free", False)),
        autocast=autocast if autocast is not None else training_autocast(args, device),
        training_engine=training_engine,
        checkpointing_kwargs=getattr(args, f"{CHECKPOINTING}_kwargs", None),
    )


@torch.no_grad()
def behavior_logps(
    model: torch.nn.Module, rows: list[dict[str, list[int]]], settings: LogpsSettings
) -> list[list[float]]:
    """
    The per-token log-probs of each row's completion under `model`, computed as training computes log pi (the
    behavior log-probs mu when `model` sampled the rows). Under several processes each computes a share of the rows
    ([`~trl_topr.distributed.map_across_processes`]) and every process gets them all.

    Args:
        model (`torch.nn.Module`):
            The policy (unwrapped). It gets TRL's fused LM head if it has none.
        rows (`list[dict[str, list[int]]]`):
            Tokenized rows: `input_ids` (prompt + completion) and `labels` (-100 on the prompt), see
            [`completion_row`].
        settings ([`LogpsSettings`]):
            How training computes log pi: padding, batch size, precision, layout ([`logps_settings`]).

    Returns:
        `list[list[float]]`: one value per completion token of each row, in order.
    """
    check_holds_weights(model)  # on every process, or none: each runs the same collectives below
    buckets = compiles_per_length(model)
    collator = PaddingFreeCollator(settings.pad_token_id, padding_free=settings.padding_free, length_buckets=buckets)
    with_fused_lm_head(model)
    device = next(model.parameters()).device
    batch_size = settings.batch_size

    def score(share: list, first: int) -> list:
        values = []
        for start in range(0, len(share), batch_size):
            batch = collator(
                [{k: row[k] for k in ("input_ids", "labels")} for row in share[start : start + batch_size]]
            )
            batch = to_device(batch, device)
            per_token, mask, _ = completion_logps(model, batch)
            values += [row[keep].tolist() for row, keep in zip(per_token.float().cpu(), mask.cpu(), strict=True)]
        return values

    with (
        # ZeRO-3: the whole weights on every process, gathered once rather than layer by layer
        full_weights(model, settings.training_engine),
        inference_mode(model, settings.checkpointing_kwargs),
        settings.autocast if settings.autocast is not None else contextlib.nullcontext(),
    ):
        return map_across_processes(rows, score)


# ----------------------------------------------------------------------------------- padding-free training
# Padding-free training: whether a model keeps sequences apart when its rows are laid end to end.
#
# With `padding_free=True` a batch is one sequence made of its rows, each with `position_ids` restarting at 0 and no
# attention mask (TRL's layout). Each row must then attend to itself only. Whether it does depends on the model's code,
# not only on its attention implementation: transformers builds a block-diagonal mask from the positions for most
# architectures under `eager`, `sdpa` and `flex_attention` when no cache is used (Llama, Qwen2/3, Mistral, Gemma2,
# GPT-2, GPT-NeoX, GPT-J, OLMo2 here), and FlashAttention's variable-length kernels take the boundaries on a GPU; but
# some architectures (OPT, BLOOM) take their positions or mask from elsewhere and let a row attend to the rows before
# it. So the model itself is asked: two rows run apart and laid end to end must give the second row the same log-probs.

# Two rows of different lengths (token ids taken modulo the vocabulary), every token after the first scored.
PROBE_ROWS = (list(range(5, 5 + 12 * 24, 12)), list(range(7, 7 + 12 * 8, 12)))
# Laid after the first row, the second row's log-probs must move, on average, by less than this fraction of how much
# they move when that row does see the first one. Measured here: SmolLM2-135M moves by exactly 0 under `sdpa` and
# `eager`, in float32 and bfloat16, where seeing the first row moves it by 1.6 nats on average; tiny random OPT and
# BLOOM models, which mix rows, move by 0.16 to 1.0 of it.
MIXING_TOLERANCE = 0.05


@torch.no_grad()
def sequence_mixing(model: torch.nn.Module, pad_token_id: int) -> tuple[float, float]:
    """
    How far a padding-free forward of `model` is from running its rows apart, next to how far it would be if the rows
    attended to each other.

    Args:
        model (`torch.nn.Module`):
            The model (unwrapped), as it will train: its attention implementation and precision.
        pad_token_id (`int`):
            The tokenizer's padding id.

    Returns:
        `tuple[float, float]`: the mean absolute difference of the second row's log-probs between the padding-free
        forward and the rows run apart, and the same when that row follows the first in one sequence (so sees it).
    """
    vocab_size = model.get_input_embeddings().num_embeddings
    rows = [[token % vocab_size for token in row] for row in PROBE_ROWS]
    examples = [{"input_ids": row, "labels": [-100] + row[1:]} for row in rows]
    joined = [{"input_ids": rows[0] + rows[1], "labels": [-100] * (len(rows[0]) + 1) + rows[1][1:]}]
    device = next(model.parameters()).device

    def second_row(examples, padding_free):
        batch = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=padding_free)(examples)
        values, mask, _ = completion_logps(model, to_device(batch, device))
        return values[-1][mask[-1]].float().cpu()

    apart = second_row(examples, False)
    gap = (second_row(examples, True) - apart).abs().mean().item()
    return gap, (second_row(joined, False) - apart).abs().mean().item()


def check_sequences_kept_apart(model: torch.nn.Module, pad_token_id: int) -> None:
    """
    Raise a clear error unless `model` keeps the rows of a padding-free batch apart (see the module's docstring). Every
    process must call it: the first one measures (with the whole weights, under ZeRO-3 gathered), and all of them get
    its verdict.

    Args:
        model (`torch.nn.Module`):
            The model (unwrapped), before training.
        pad_token_id (`int`):
            The tokenizer's padding id.

    Raises:
        `ValueError`:
            When the rows' log-probs change when they are laid end to end: they attend to one another.
    """
    verdict = [None]
    if not is_meta_model(model):  # under FSDP's CPU-RAM-efficient loading only the first process holds the weights
        with full_weights(model), inference_mode(with_fused_lm_head(model)):
            verdict = [sequence_mixing(model, pad_token_id)]
    broadcast_object_list(verdict, from_process=0)
    gap, mixed = verdict[0]
    if gap > MIXING_TOLERANCE * mixed:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        raise ValueError(
            f"`padding_free=True` needs a model that keeps the rows of a batch apart when they are laid end to end, "
            f"but {type(base).__name__} with attn_implementation={base.config._attn_implementation!r} lets them "
            f"attend to one another: a row's log-probs moved by {gap:.3g} on average (by {mixed:.3g} when it sees "
            "the row before it). Its positions or mask do not come from `position_ids`. Train padded "
            "(`padding_free=False`), with `train_sampling_strategy='group_by_length'` to cut the padding, or try "
            "another `attn_implementation` in `model_init_kwargs` (e.g. 'flash_attention_2' on a GPU, 'sdpa', "
            "'eager')."
        )
