"""Padding-free training: whether a model keeps sequences apart when its rows are laid end to end.

With `padding_free=True` a batch is one sequence made of its rows, each with `position_ids` restarting at 0 and no
attention mask (TRL's layout). Each row must then attend to itself only. Whether it does depends on the model's code,
not only on its attention implementation: transformers builds a block-diagonal mask from the positions for most
architectures under `eager`, `sdpa` and `flex_attention` when no cache is used (Llama, Qwen2/3, Mistral, Gemma2,
GPT-2, GPT-NeoX, GPT-J, OLMo2 here), and FlashAttention's variable-length kernels take the boundaries on a GPU; but
some architectures (OPT, BLOOM) take their positions or mask from elsewhere and let a row attend to the rows before
it. So the model itself is asked: two rows run apart and laid end to end must give the second row the same log-probs.
"""

import torch
from accelerate.utils import broadcast_object_list
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from .behavior import completion_logps, inference_mode, to_device, with_fused_lm_head
from .distributed import full_weights, is_meta_model


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
