"""
The generation layer: every engine that writes completions behind one interface ([`GenerationEngine`]: generate
under [`SamplingSettings`], take weights from a saved folder, close), and the factory that builds the one a
[`~trl_topr.TOPRConfig`] asks for. Sampling, evaluation, the loop and the recipes reach engines only through it.

- [`TransformersEngine`]: `model.generate`, with each prompt's key/values shared by its samples.
- [`VLLMEngine`]: vLLM colocated or as a server (`use_vllm`, TRL's `vllm_*` fields).

A new engine is a subclass of [`GenerationEngine`] in a module of this package, built by [`generation_engine`].
"""

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .engine import GenerationEngine, Generations, end_of_sequence_ids, prompt_ids
from .settings import SamplingSettings
from .transformers_engine import TransformersEngine, load_whole_model
from .vllm_engine import VLLMEngine


def generation_engine(
    model: "str | PreTrainedModel", processing_class: PreTrainedTokenizerBase, args
) -> GenerationEngine:
    """
    The generation engine that `args` asks for: vLLM with `use_vllm` (`vllm_mode` colocate or server), else
    transformers, generating in the training precision (`args.bf16`).

    Args:
        model (`str` or [`~transformers.PreTrainedModel`]):
            The model to generate with, or its id or folder (loaded whole on every process with
            `args.model_init_kwargs`).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        args ([`~trl_topr.TOPRConfig`]):
            The configuration.

    Returns:
        [`GenerationEngine`]: a [`VLLMEngine`] or a [`TransformersEngine`]; close it (or use it in a `with` block)
        to free a vLLM engine's memory.

    Example:
    ```python
    >>> from trl_topr import TOPRConfig
    >>> from trl_topr.generation import SamplingSettings, generation_engine, prompt_ids

    >>> args = TOPRConfig("out", use_vllm=False)  # doctest: +SKIP
    >>> with generation_engine("HuggingFaceTB/SmolLM2-135M-Instruct", tokenizer, args) as engine:  # doctest: +SKIP
    ...     out = engine.generate([prompt_ids(tokenizer, "2 + 2 =")], SamplingSettings(num_samples=4, seed=0))

    ```
    """
    if isinstance(model, str):
        model = load_whole_model(model, args.model_init_kwargs)
    if args.use_vllm:
        return VLLMEngine.from_config(model, processing_class, args)
    return TransformersEngine(model, processing_class, bf16=args.bf16, model_init_kwargs=args.model_init_kwargs)


__all__ = [
    "GenerationEngine",
    "Generations",
    "SamplingSettings",
    "TransformersEngine",
    "VLLMEngine",
    "end_of_sequence_ids",
    "generation_engine",
    "prompt_ids",
]
