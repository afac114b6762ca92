"""Generation with transformers' `model.generate`: batched, left-padded, each prompt's key/values computed once and
shared by its samples, the weights whole under sharded training engines, in the inference precision."""

import inspect
import os
import time
from typing import Any

import torch
from accelerate import PartialState
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, set_seed
from trl.trainer.utils import create_model_from_path

from ..distributed import full_weights, unsharded_loading
from ..precision import autocast
from .engine import GenerationEngine, end_of_sequence_ids, text_tokenizer
from .settings import SamplingSettings


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
    model(
        input_ids=inputs["input_ids"][:, :-1],
        attention_mask=inputs["attention_mask"][:, :-1],
        **{name: cache},
        use_cache=True,
    )
    cache.batch_repeat_interleave(copies)
    return {**expanded, name: cache}


def _cache_argument(model: PreTrainedModel) -> str:
    # transformers 5.24 renamed the `past_key_values` argument of `forward` and `generate` to `cache` (the old name
    # warns until its removal); earlier versions know only the old one
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def load_whole_model(path: str, model_init_kwargs: dict | None = None) -> PreTrainedModel:
    """A model loaded whole on this process, also under ZeRO-3 (whose `zero.Init` would partition it), for
    generation outside a training engine."""
    with unsharded_loading():
        return create_model_from_path(path, **(model_init_kwargs or {}))


class TransformersEngine(GenerationEngine):
    """
    Generation with the model's own `generate` (transformers), on each process's copy of the model.

    The model's weights are read whole (gathered once under DeepSpeed ZeRO-3, with a training engine's hooks removed
    meanwhile; see [`~trl_topr.distributed.full_weights`]), in eval mode, under bf16 autocast where `bf16` says so.
    Under several processes, `settings.seed` seeds each process's share from the index of its first prompt.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            The causal LM to generate with (its generation config gives end-of-sequence tokens).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            Its tokenizer.
        bf16 (`bool`, *optional*):
            Generate under bf16 autocast. Defaults to the hardware (see [`~trl_topr.precision.bf16_is_faster`]).
        model_init_kwargs (`dict`, *optional*):
            Keyword arguments of `from_pretrained` for a folder given to `load_weights` without its model.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        processing_class: PreTrainedTokenizerBase,
        *,
        bf16: bool | None = None,
        model_init_kwargs: dict | None = None,
    ):
        super().__init__(processing_class, end_of_sequence_ids(model, processing_class))
        self.model, self.training_engine, self.folder = model, None, model.name_or_path
        self.bf16, self.model_init_kwargs = bf16, dict(model_init_kwargs or {})

    @classmethod
    def from_config(
        cls,
        model: PreTrainedModel,
        processing_class: PreTrainedTokenizerBase,
        args=None,
        *,
        bf16: bool | None = None,
        model_init_kwargs: dict | None = None,
        trust_remote_code: bool = False,
    ):
        """The engine for `model`, generating in `bf16` precision, loading folders with `model_init_kwargs`; it has
        no options of its own (`args`). See [`GenerationEngine.from_config`]."""
        return cls(model, processing_class, bf16=bf16, model_init_kwargs=model_init_kwargs)

    def load_weights(self, folder: str, model: PreTrainedModel | None = None, training_engine=None) -> None:
        """Generate with `model` (the weights of `folder` in memory) or, without it, the model loaded from `folder`,
        whole on every process, unless the engine holds that folder's model already. See
        [`GenerationEngine.load_weights`]."""
        if model is None:
            if self.model is not None and os.path.abspath(folder) == os.path.abspath(self.folder):
                return
            model = load_whole_model(folder, self.model_init_kwargs)
        self.model, self.training_engine, self.folder = model, training_engine, folder

    def release_weights(self) -> None:
        """Drop the reference to the model, until the next `load_weights`."""
        self.model, self.training_engine = None, None

    @torch.no_grad()
    def _generate_share(self, prompts, settings: SamplingSettings, progress):
        model, tokenizer = self.model, text_tokenizer(self.processing_class)
        if model is None:
            raise RuntimeError("The engine's weights were released: call `load_weights` first.")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        copies = 1 if settings.is_greedy else settings.num_samples
        show = progress and PartialState().is_main_process
        bar = tqdm(total=len(prompts), desc="Sampling", unit="prompt", disable=not show)
        if settings.seed is not None:
            set_seed(settings.seed)
        sequences, start, was_training = [], time.perf_counter(), model.training
        model.eval()
        try:
            with full_weights(model, self.training_engine):
                for first in range(0, len(prompts), settings.batch_size):
                    batch = prompts[first : first + settings.batch_size]
                    inputs = tokenizer.pad({"input_ids": batch}, padding_side="left", return_tensors="pt")
                    inputs = dict(inputs.to(model.device))
                    with autocast(model.device, self.bf16):
                        outputs = model.generate(
                            **_prompt_cache_inputs(model, inputs, copies),
                            do_sample=not settings.is_greedy,
                            temperature=None if settings.is_greedy else settings.temperature,
                            top_p=None if settings.is_greedy else settings.top_p,
                            top_k=None if settings.is_greedy else settings.top_k,
                            max_new_tokens=settings.max_new_tokens,
                            pad_token_id=pad_id,
                        )
                    sequences += outputs[:, inputs["input_ids"].size(1) :].tolist()
                    bar.update(len(batch))
                    bar.set_postfix(tokens_per_s=f"{sum(map(len, sequences)) / (time.perf_counter() - start):.0f}")
        finally:
            model.train(was_training)
            bar.close()
        return sequences, None
