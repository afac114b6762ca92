"""
Where vLLM's pieces were before the generation layer: [`~trl_topr.generation.vllm_engine.TOPRVLLMGeneration`] and
[`~trl_topr.generation.vllm_engine.TOPRWorkerExtension`] are importable from here too (a vLLM server is started with
`--worker-extension-cls trl_topr.vllm.TOPRWorkerExtension`), and the deprecated `vllm_generation_from_config`.
"""

import warnings

from .generation.vllm_engine import CPU_KV_CACHE_BYTES, TOPRVLLMGeneration, TOPRWorkerExtension, VLLMEngine


__all__ = ["CPU_KV_CACHE_BYTES", "TOPRVLLMGeneration", "TOPRWorkerExtension", "vllm_generation_from_config"]


def vllm_generation_from_config(model, processing_class, args) -> TOPRVLLMGeneration | None:
    """
    Deprecated: use [`~trl_topr.generation.generation_engine`] (any engine) or
    [`~trl_topr.generation.VLLMEngine.from_config`].

    Args:
        model ([`~transformers.PreTrainedModel`]):
            The model to start the engine from.
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        args ([`TOPRConfig`]):
            The configuration.

    Returns:
        [`TOPRVLLMGeneration`] or `None` (without `use_vllm`).
    """
    warnings.warn("`vllm_generation_from_config` is deprecated: use `trl_topr.generation.generation_engine(model, "
                  "processing_class, args)`, which builds the engine `args` asks for.", FutureWarning, stacklevel=2)
    if not args.use_vllm:
        return None
    return VLLMEngine.from_config(model, processing_class, args).vllm_generation
