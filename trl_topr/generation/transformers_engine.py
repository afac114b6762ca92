"""Generation with transformers' `model.generate`: batched, left-padded, each prompt's key/values computed once and
shared by its samples, the weights whole under sharded training engines, in the inference precision."""

import contextlib
import inspect
import os
import time
from typing import Any

import torch
from accelerate import PartialState
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, set_seed
from transformers.cache_utils import DynamicLayer
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


class _TurnCache:
    """
    The key/values of the sequences a call generated, kept for the next call, whose sequences may continue them: a
    tool loop's next turn is its trajectory so far, the tool's result and the template's text around it. A row of the
    next call that starts with a kept sequence gets its key/values, and only the rest of its tokens are computed
    (vLLM's prefix caching does the same on vLLM). Each call takes what the one before kept and keeps its own, so at
    most one call's key/values are held. Only caches of plain layers (`DynamicLayer`: full attention, no sliding
    window or state) are kept.
    """

    def __init__(self):
        self.kept: list[tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def take(self) -> list:
        kept, self.kept = self.kept, []
        return kept

    def keep(self, cache, attention_mask: torch.Tensor, prompts: list[list[int]], completions: list[list[int]]):
        # Row r holds its prompt's tokens where its attention mask is 1, then its completion; the key/values of the
        # completion's last token were never computed (it was sampled last), so a row keeps its tokens but that one
        if cache is None or not all(type(layer) is DynamicLayer for layer in cache.layers):
            return
        width = attention_mask.size(1)
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            generated = torch.arange(width, width + len(completion) - 1, device=attention_mask.device)
            where = torch.cat([attention_mask[row].nonzero().squeeze(-1), generated])
            layers = [(layer.keys[row][:, where], layer.values[row][:, where]) for layer in cache.layers]
            self.kept.append((tuple(prompt + completion[:-1]), layers))

    @staticmethod
    def inputs(model, kept: list, rows: list[list[int]], pad_id: int) -> dict[str, Any] | None:
        """`model.generate`'s inputs for `rows`, with the key/values of each row's longest kept prefix; `None` when
        no row starts with a kept sequence."""
        found = []
        for row in rows:
            prefixes = [
                entry for entry in kept if len(entry[0]) < len(row) and tuple(row[: len(entry[0])]) == entry[0]
            ]
            found.append(max(prefixes, key=lambda entry: len(entry[0]), default=None))
        if all(entry is None for entry in found):
            return None
        cached = [len(entry[0]) if entry is not None else 0 for entry in found]
        width, rest = max(cached), max(len(row) - n for row, n in zip(rows, cached))
        ids, mask = [], []
        for row, n in zip(rows, cached):
            gap_1, gap_2 = width - n, rest - (len(row) - n)
            ids.append([pad_id] * gap_1 + row[:n] + [pad_id] * gap_2 + row[n:])
            mask.append([0] * gap_1 + [1] * n + [0] * gap_2 + [1] * (len(row) - n))
        example = next(entry for entry in found if entry is not None)[1]
        layers = []
        for index, (keys, values) in enumerate(example):
            shape = (len(rows), keys.size(0), width, keys.size(-1))
            all_keys, all_values = keys.new_zeros(shape), values.new_zeros(shape)
            for row, (entry, n) in enumerate(zip(found, cached)):
                if entry is not None:
                    all_keys[row, :, width - n :] = entry[1][index][0]
                    all_values[row, :, width - n :] = entry[1][index][1]
            layers.append((all_keys, all_values))
        device = model.device
        return {
            "input_ids": torch.tensor(ids, device=device),
            "attention_mask": torch.tensor(mask, device=device),
            _cache_argument(model): DynamicCache(ddp_cache_data=layers, config=model.config),
        }


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
        turn_cache (`bool`, *optional*, defaults to `True`):
            Within [`~GenerationEngine.turns`] (a tool loop's turns), keep the key/values of a call's sequences for
            the next call, so that a sequence that continues one computes only its new tokens. `False` computes every
            sequence whole.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        processing_class: PreTrainedTokenizerBase,
        *,
        bf16: bool | None = None,
        model_init_kwargs: dict | None = None,
        turn_cache: bool = True,
    ):
        super().__init__(processing_class, end_of_sequence_ids(model, processing_class))
        self.model, self.training_engine, self.folder = model, None, model.name_or_path
        self.bf16, self.model_init_kwargs = bf16, dict(model_init_kwargs or {})
        self.turn_cache, self.keeping = _TurnCache() if turn_cache else None, False

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

    @contextlib.contextmanager
    def turns(self):
        """Keep each call's key/values for the next, until the block ends (see [`GenerationEngine.turns`])."""
        self.keeping = self.turn_cache is not None
        try:
            yield
        finally:
            self.keeping = False
            if self.turn_cache is not None:
                self.turn_cache.take()

    def release_weights(self) -> None:
        """Drop the reference to the model, until the next `load_weights`, and the key/values kept for a next turn."""
        self.model, self.training_engine = None, None
        if self.turn_cache is not None:
            self.turn_cache.take()

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
        kept = self.turn_cache.take() if self.turn_cache is not None else []
        model.eval()
        try:
            with full_weights(model, self.training_engine):
                for first in range(0, len(prompts), settings.batch_size):
                    batch = prompts[first : first + settings.batch_size]
                    inputs = _TurnCache.inputs(model, kept, batch, pad_id) if kept and copies == 1 else None
                    with autocast(model.device, self.bf16):  # the prompts' shared key/values too
                        if inputs is None:
                            inputs = tokenizer.pad({"input_ids": batch}, padding_side="left", return_tensors="pt")
                            inputs = _prompt_cache_inputs(model, dict(inputs.to(model.device)), copies)
                        outputs = model.generate(
                            **inputs,
                            do_sample=not settings.is_greedy,
                            temperature=None if settings.is_greedy else settings.temperature,
                            top_p=None if settings.is_greedy else settings.top_p,
                            top_k=None if settings.is_greedy else settings.top_k,
                            max_new_tokens=settings.max_new_tokens,
                            pad_token_id=pad_id,
                            return_dict_in_generate=True,
                        )
                    new = outputs.sequences[:, inputs["input_ids"].size(1) :].tolist()
                    if self.keeping:
                        rows = [prompt for prompt in batch for _ in range(copies)]
                        ended = [self.cut(tokens) for tokens in new]
                        cache = getattr(outputs, "cache", None)  # `past_key_values` before transformers 5.24
                        cache = cache if cache is not None else getattr(outputs, "past_key_values", None)
                        self.turn_cache.keep(cache, inputs["attention_mask"], rows, ended)
                    sequences += new
                    bar.update(len(batch))
                    bar.set_postfix(tokens_per_s=f"{sum(map(len, sequences)) / (time.perf_counter() - start):.0f}")
        finally:
            model.train(was_training)
            bar.close()
        return sequences, None
