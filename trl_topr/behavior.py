"""Log-probabilities of completions under a policy, computed exactly as [`TOPRTrainer`] computes log pi: the forward of
TRL's fused LM head (per-token log-probs without the full logits), on prompt + completion token ids, in the training
precision. Plain functions of a model, so that the trainer (its loss and its behavior precompute) and sampling (the
behavior log-probs of fresh samples) share one computation, and training on fresh samples starts at a ratio of 1."""

import contextlib

import torch
from transformers.utils import is_bitsandbytes_available
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils import add_fused_lm_head

from .config import CHECKPOINTING
from .distributed import full_weights, map_across_processes


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


@torch.no_grad()
def behavior_logps(
    model: torch.nn.Module,
    rows: list[dict[str, list[int]]],
    *,
    pad_token_id: int,
    batch_size: int = 16,
    autocast: contextlib.AbstractContextManager | None = None,
    training_engine=None,
    checkpointing_kwargs: dict | None = None,
    padding_free: bool = False,
) -> list[list[float]]:
    """
    The per-token log-probs of each row's completion under `model`, computed as training computes log pi (the
    behavior log-probs mu when `model` sampled the rows). Under several processes each computes a share of the rows
    ([`~trl_topr.distributed.map_across_processes`]) and every process gets them all.

    Args:
        model (`torch.nn.Module`):
            The policy (unwrapped). It gets TRL's fused LM head if it has none.
        rows (`list[dict[str, list[int]]]`):
            Tokenized rows: `input_ids` (prompt + completion) and `labels` (-100 on the prompt).
        pad_token_id (`int`):
            The tokenizer's padding id.
        batch_size (`int`, *optional*, defaults to `16`):
            Rows per forward.
        autocast (`contextlib.AbstractContextManager`, *optional*):
            The training's mixed precision context (e.g. a trainer's `accelerator.autocast()`,
            [`~trl_topr.precision.training_autocast`]); none by default.
        training_engine (`deepspeed.DeepSpeedEngine`, *optional*):
            The DeepSpeed engine holding `model` once training has started (see
            [`~trl_topr.distributed.full_weights`]).
        checkpointing_kwargs (`dict`, *optional*):
            The model's activation checkpointing arguments, restored after.
        padding_free (`bool`, *optional*, defaults to `False`):
            Lay each batch's rows end to end without padding, as training with `padding_free=True` does.

    Returns:
        `list[list[float]]`: one value per completion token of each row, in order.
    """
    collator = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=padding_free)
    with_fused_lm_head(model)
    device = next(model.parameters()).device

    def score(share: list, first: int) -> list:
        values = []
        for start in range(0, len(share), batch_size):
            batch = collator([{k: row[k] for k in ("input_ids", "labels")} for row in share[start : start + batch_size]])
            batch = to_device(batch, device)
            per_token, mask, _ = completion_logps(model, batch)
            values += [row[keep].tolist() for row, keep in zip(per_token.float().cpu(), mask.cpu(), strict=True)]
        return values

    with (
        # ZeRO-3: the whole weights on every process, gathered once rather than layer by layer
        full_weights(model, training_engine),
        inference_mode(model, checkpointing_kwargs),
        autocast if autocast is not None else contextlib.nullcontext(),
    ):
        return map_across_processes(rows, score)
