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
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, StaticCache, set_seed
from transformers.cache_utils import DynamicLayer, StaticLayer
from trl.trainer.utils import create_model_from_path

from ..distributed import forward_is_collective, full_weights, unsharded_loading
from ..precision import autocast
from ..tokens import end_of_sequence_ids, text_tokenizer
from .engine import GenerationEngine
from .settings import SamplingSettings


def _generation_inputs(
    model: PreTrainedModel,
    rows: list[list[int]],
    pad_id: int,
    copies: int,
    max_new_tokens: int,
    kept: list,
    shared_prefix: bool = True,
    static: bool = True,
    plain: bool = False,
) -> dict[str, Any]:
    """
    Inputs of `model.generate` for `copies` completions of each row of token ids, with every key/value computed once:
    each row's longest prefix kept from the turn before (see [`_TurnCache`]) or, when no row has one, the prefix all
    the rows share (few-shot examples, a system prompt, the tools' schemas), computed for one row (`shared_prefix`);
    then the rest of each row but its last token, once for all its copies (`num_return_sequences` would compute it
    for every copy). Rows are laid out `[padding][prefix][padding][rest]`, their positions counted along the
    attention mask as `generate` counts them. With `static`, where the model's layers are plain full attention, the
    key/values go in a cache allocated once with room for `max_new_tokens`: a growing cache copies itself at every
    token, most of a step's cost on long prompts. With `plain` (or a model without the default cache), the rows are
    only padded, and `generate` computes them whole: no forward here, whose number would depend on the rows.
    """
    device, name = model.device, _cache_argument(model)
    if plain or not model._supports_default_dynamic_cache():
        layout = _padded(rows, [0] * len(rows), pad_id)
        return {key: torch.tensor(value, device=device).repeat_interleave(copies, 0) for key, value in layout}
    found = [_longest_prefix(kept, row) for row in rows]
    if shared_prefix and all(entry is None for entry in found) and _common_prefix(rows):
        found = [_key_values(model, rows[0][: _common_prefix(rows)])] * len(rows)
    cached = [len(entry[0]) if entry is not None else 0 for entry in found]
    ids, mask = (torch.tensor(value, device=device) for _, value in _padded(rows, cached, pad_id))
    layers = _laid_out(found, cached)
    cache = DynamicCache(ddp_cache_data=layers, config=model.config) if layers else DynamicCache(config=model.config)
    start = max(cached)
    if ids.size(1) - 1 > start:  # the rest of each row but its last token, which `generate`'s first step computes
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model(
            input_ids=ids[:, start:-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, start:-1],
            **{name: cache},
            use_cache=True,
        )
    inputs = {"input_ids": ids.repeat_interleave(copies, 0), "attention_mask": mask.repeat_interleave(copies, 0)}
    if cache.get_seq_length() == 0:  # nothing computed ahead (rows of one token): `generate` computes it all
        return inputs
    cache.batch_repeat_interleave(copies)
    if static and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache = _preallocated(model, cache, ids.size(1) - 1 + max_new_tokens)
    return {**inputs, name: cache}


def _common_prefix(rows: list[list[int]]) -> int:
    # The length of the prefix every row starts with, short of each row's last token
    shortest = max(min(map(len, rows)) - 1, 0)
    return next((i for i in range(shortest) if any(row[i] != rows[0][i] for row in rows)), shortest)


def _longest_prefix(kept: list, row: list[int]):
    # The kept entry (tokens, layers) whose tokens are the longest proper prefix of `row`, or `None`
    prefixes = [entry for entry in kept if len(entry[0]) < len(row) and tuple(row[: len(entry[0])]) == entry[0]]
    return max(prefixes, key=lambda entry: len(entry[0]), default=None)


def _key_values(model: PreTrainedModel, tokens: list[int]):
    # `tokens` and their key/values per layer (heads x tokens x head size); `None` for layers that are not plain
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([tokens], device=model.device), **{_cache_argument(model): cache}, use_cache=True)
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        return None
    return tuple(tokens), [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def _padded(rows: list[list[int]], cached: list[int], pad_id: int) -> list[tuple[str, list[list[int]]]]:
    # Token ids and attention mask of `rows` laid out `[padding][their first `cached` tokens][padding][the rest]`
    width, rest = max(cached), max(len(row) - n for row, n in zip(rows, cached))
    ids, mask = [], []
    for row, n in zip(rows, cached):
        gap_1, gap_2 = width - n, rest - (len(row) - n)
        ids.append([pad_id] * gap_1 + row[:n] + [pad_id] * gap_2 + row[n:])
        mask.append([0] * gap_1 + [1] * n + [0] * gap_2 + [1] * (len(row) - n))
    return [("input_ids", ids), ("attention_mask", mask)]


def _laid_out(found: list, cached: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Per layer, the keys and values of each row's prefix (an entry of `found`), right-aligned in `max(cached)`
    # positions; none when no row has one
    example = next((entry for entry in found if entry is not None), None)
    if example is None:
        return []
    width, layers = max(cached), []
    for index, (keys, values) in enumerate(example[1]):
        shape = (len(found), keys.size(0), width, keys.size(-1))
        all_keys, all_values = keys.new_zeros(shape), values.new_zeros(shape)
        for row, (entry, n) in enumerate(zip(found, cached)):
            if entry is not None:
                all_keys[row, :, width - n :] = entry[1][index][0]
                all_values[row, :, width - n :] = entry[1][index][1]
        layers.append((all_keys, all_values))
    return layers


def _preallocated(model: PreTrainedModel, cache: DynamicCache, length: int) -> StaticCache:
    # `cache`'s key/values in a cache of `length` positions allocated once, which `generate` fills in place
    static = StaticCache(config=model.config, max_cache_len=length)
    for layer, full in zip(static.layers, cache.layers, strict=True):
        layer.lazy_initialization(full.keys, full.values)
        layer.keys[:, :, : full.keys.size(2)] = full.keys
        layer.values[:, :, : full.values.size(2)] = full.values
        layer.cumulative_length.fill_(full.keys.size(2))
    return static


class _TurnCache:
    """
    The key/values of the sequences a call generated, kept for the next call, whose sequences may continue them: a
    tool loop's next turn is its trajectory so far, the tool's result and the template's text around it. A row of the
    next call that starts with a kept sequence gets its key/values, and only the rest of its tokens are computed
    (vLLM's prefix caching does the same on vLLM). Each call takes what the one before kept and keeps its own, so at
    most one call's key/values are held. Only caches of plain layers (full attention, no sliding window or state) are
    kept.
    """

    def __init__(self):
        self.kept: list[tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def take(self) -> list:
        kept, self.kept = self.kept, []
        return kept

    def keep(self, cache, attention_mask: torch.Tensor, prompts: list[list[int]], completions: list[list[int]]):
        # Row r holds its prompt's tokens where its attention mask is 1, then its completion; the key/values of the
        # completion's last token were never computed (it was sampled last), so a row keeps its tokens but that one
        if cache is None or not all(type(layer) in (DynamicLayer, StaticLayer) for layer in cache.layers):
            return
        width = attention_mask.size(1)
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            generated = torch.arange(width, width + len(completion) - 1, device=attention_mask.device)
            where = torch.cat([attention_mask[row].nonzero().squeeze(-1), generated])
            layers = [(layer.keys[row][:, where], layer.values[row][:, where]) for layer in cache.layers]
            self.kept.append((tuple(prompt + completion[:-1]), layers))


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
        shared_prefix (`bool`, *optional*, defaults to `True`):
            Compute the key/values of the prefix that a batch's prompts share (few-shot examples, a system prompt,
            the tools' schemas) once for the batch, rather than once per prompt.
        static_cache (`bool`, *optional*, defaults to `True`):
            Hold the key/values in a cache allocated once per batch with room for the completions (transformers'
            `StaticCache`, without compilation), where the model's layers are plain full attention; `False` grows
            the cache a token at a time (`DynamicCache`), which copies it at every step.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        processing_class: PreTrainedTokenizerBase,
        *,
        bf16: bool | None = None,
        model_init_kwargs: dict | None = None,
        turn_cache: bool = True,
        shared_prefix: bool = True,
        static_cache: bool = True,
    ):
        super().__init__(processing_class, end_of_sequence_ids(model, processing_class))
        self.model, self.training_engine, self.folder = model, None, model.name_or_path
        self.bf16, self.model_init_kwargs = bf16, dict(model_init_kwargs or {})
        self.turn_cache, self.keeping = _TurnCache() if turn_cache else None, False
        self.shared_prefix, self.static_cache = shared_prefix, static_cache

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

    @property
    def _cache_options(self) -> dict[str, bool]:
        return {"shared_prefix": self.shared_prefix, "static": self.static_cache}

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
                # a forward that is a collective (FSDP2) runs as often on every process: no key/values computed ahead,
                # whose forwards depend on each process's own prompts (`generate` keeps the processes' steps in sync)
                plain = forward_is_collective(model)
                keeping = self.keeping and not plain
                for first in range(0, len(prompts), settings.batch_size):
                    batch = prompts[first : first + settings.batch_size]
                    with autocast(model.device, self.bf16):  # the prompts' key/values too
                        inputs = _generation_inputs(
                            model,
                            batch,
                            pad_id,
                            copies,
                            settings.max_new_tokens,
                            kept,
                            plain=plain,
                            **self._cache_options,
                        )
                        outputs = model.generate(
                            **inputs,
                            do_sample=not settings.is_greedy,
                            temperature=None if settings.is_greedy else settings.temperature,
                            top_p=None if settings.is_greedy else settings.top_p,
                            top_k=None if settings.is_greedy else settings.top_k,
                            max_new_tokens=settings.max_new_tokens,
                            pad_token_id=pad_id,
                            return_dict_in_generate=True,
                            disable_compile=True,  # a compilation per batch shape costs more than it saves here
                        )
                    new = outputs.sequences[:, inputs["input_ids"].size(1) :].tolist()
                    if keeping:
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
