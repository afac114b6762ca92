"""
The generation layer: every engine that writes completions behind one interface ([`GenerationEngine`]: generate
under [`SamplingSettings`], take weights from a saved folder, close), the engines by name ([`ENGINES`]), their
options ([`~trl_topr.generation.arguments.VLLMArguments`], inherited by [`~trl_topr.TOPRLoopConfig`]) and the factory
that builds the one a configuration asks for ([`generation_engine`]). Sampling, evaluation, the loop and the recipes
reach engines only through it.

- [`TransformersEngine`]: `model.generate`, with each prompt's key/values shared by its samples.
- [`VLLMEngine`]: vLLM colocated or as a server (`use_vllm`, TRL's `vllm_*` fields).

A new engine is one module of this package with a subclass of [`GenerationEngine`], and one entry in [`ENGINES`]
(and, if a configuration is to select it, a branch in [`~trl_topr.generation.arguments.engine_name`]).
"""

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .arguments import VLLMArguments, engine_name
from .engine import GenerationEngine, Generations
from .settings import SamplingSettings
from .transformers_engine import TransformersEngine, load_whole_model
from .vllm_engine import VLLMEngine


ENGINES: dict[str, type[GenerationEngine]] = {"transformers": TransformersEngine, "vllm": VLLMEngine}
"""The engines by name: what [`engine_name`] reads from a configuration, and the class that builds it
(`from_config`)."""


def generation_engine(
    model: "str | PreTrainedModel",
    processing_class: PreTrainedTokenizerBase,
    args=None,
    train_args=None,
    *,
    bf16: bool | None = None,
) -> GenerationEngine:
    """
    The generation engine that `args` asks for ([`~trl_topr.generation.arguments.engine_name`] picks its name in
    [`ENGINES`]): vLLM with `use_vllm` (`vllm_mode` colocate or server), else transformers, generating in the
    training precision of `train_args` (its `bf16`). This is the one place where the configurations are unpacked into
    an engine's options.

    Args:
        model (`str` or [`~transformers.PreTrainedModel`]):
            The model to generate with, or its id or folder (loaded whole on every process with
            `train_args.model_init_kwargs`).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        args ([`~trl_topr.TOPRLoopConfig`] or [`~trl_topr.generation.arguments.VLLMArguments`], *optional*):
            The engine's options; `None` for transformers.
        train_args ([`~trl_topr.TOPRConfig`], *optional*):
            The training configuration whose precision (`bf16`), `model_init_kwargs` and `trust_remote_code` the
            engine generates and loads weights with; `None` for the defaults (the precision the hardware computes
            fastest).
        bf16 (`bool`, *optional*):
            Generate in bf16 (`True`) or not (`False`), whatever `train_args` says.

    Returns:
        [`GenerationEngine`]: a [`VLLMEngine`] or a [`TransformersEngine`]; close it (or use it in a `with` block)
        to free a vLLM engine's memory.

    Example:
    ```python
    >>> from trl_topr import Sampler, TOPRLoopConfig
    >>> from trl_topr.generation import SamplingSettings, generation_engine

    >>> loop_args = TOPRLoopConfig(use_vllm=True)  # doctest: +SKIP
    >>> model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    >>> with generation_engine(model, tokenizer, loop_args) as engine:  # doctest: +SKIP
    ...     out = Sampler(processing_class=tokenizer, engine=engine).generate(["2 + 2 ="], SamplingSettings(4))

    ```
    """
    options = {
        "bf16": bf16 if bf16 is not None else getattr(train_args, "bf16", None),
        "model_init_kwargs": getattr(train_args, "model_init_kwargs", None),
        "trust_remote_code": getattr(train_args, "trust_remote_code", False),
    }
    if isinstance(model, str):
        model = load_whole_model(model, options["model_init_kwargs"])
    return ENGINES[engine_name(args)].from_config(model, processing_class, args, **options)


__all__ = [
    "ENGINES",
    "GenerationEngine",
    "Generations",
    "SamplingSettings",
    "TransformersEngine",
    "VLLMArguments",
    "VLLMEngine",
    "engine_name",
    "generation_engine",
]
