"""Token helpers, at the bottom of the package (they import nothing of it but the TRL seam): a processing class's
tokenizer and padding id, a prompt's token ids as training tokenizes it, and the ids and texts that end a turn (the
generation config's stop ids), which the sampler stops at and the cut of a trajectory into the policy's tokens uses
alike."""

from transformers import PreTrainedTokenizerBase

from .trl_seam import tokenize_like_trl


def prompt_ids(processing_class: PreTrainedTokenizerBase, prompt, tools: list | None = None) -> list[int]:
    """
    The token ids of a prompt as [`~trl_topr.TOPRTrainer`] tokenizes it: text as is, messages with the chat template
    and its generation prompt.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        prompt (`str` or `list[dict]`):
            A prompt, text or messages.
        tools (`list`, *optional*):
            Tools the chat template shows the model (functions or schemas), for messages.

    Returns:
        `list[int]`: its token ids.
    """
    if isinstance(prompt, list):
        return tokenize_like_trl(processing_class, prompt, add_generation_prompt=True, tools=tools or None)[
            "input_ids"
        ]
    return tokenize_like_trl(processing_class, prompt)["input_ids"]


def text_tokenizer(processing_class):
    """
    The text tokenizer of a processing class: a processor's `tokenizer`, or the tokenizer itself.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            A tokenizer, or a processor holding one.

    Returns:
        [`~transformers.PreTrainedTokenizerBase`]: the tokenizer.
    """
    return getattr(processing_class, "tokenizer", processing_class)


def padding_id(processing_class) -> int:
    """The padding id of a processing class's tokenizer ([`text_tokenizer`]): its pad token, else its EOS."""
    tokenizer = text_tokenizer(processing_class)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def end_of_sequence_ids(model, processing_class: PreTrainedTokenizerBase) -> set[int]:
    """
    The token ids that end a generation, a turn of a trajectory included: the tokenizer's EOS and the stop ids of the
    model's generation config (`eos_token_id`, one id or a list: Qwen2.5's `<|im_end|>` and `<|endoftext|>`,
    Gemma's `<eos>` and `<end_of_turn>`).

    Args:
        model ([`~transformers.PreTrainedModel`] or [`~transformers.GenerationConfig`], *optional*):
            The model (its `generation_config` is read) or a generation config; `None`: the tokenizer's EOS only.
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.

    Returns:
        `set[int]`: the ids.
    """
    tokenizer = text_tokenizer(processing_class)
    eos_ids = {tokenizer.eos_token_id} - {None}
    config = getattr(model, "generation_config", model)
    configured = getattr(config, "eos_token_id", None)
    if configured is not None:
        eos_ids |= set(configured if isinstance(configured, list) else [configured])
    return eos_ids


def stop_texts(processing_class, stop_ids) -> list[str]:
    """
    The texts of the tokens that end a turn (see [`end_of_sequence_ids`]), as the chat template writes them: where
    one of them first follows a turn's start, the turn ends (the cut of [`~trl_topr.trajectories.trajectory_ids`] and
    of the sampler alike).

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        stop_ids (`set[int]`, *optional*):
            The ids; `None`: the tokenizer's EOS.

    Returns:
        `list[str]`: the texts, longest first (so that a text that contains another is found whole).
    """
    tokenizer = text_tokenizer(processing_class)
    ids = {tokenizer.eos_token_id} - {None} if stop_ids is None else set(stop_ids)
    texts = {
        tokenizer.convert_ids_to_tokens(i) if i in tokenizer.all_special_ids else tokenizer.decode([i]) for i in ids
    }
    return sorted((t for t in texts if t), key=len, reverse=True)
