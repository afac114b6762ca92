"""
The one place that reaches into TRL's internals: its private names, the module paths of its experimental trainers,
formulas it does not export, and the one swap TRL leaves no other way to make. Each is here with the reason, and
`tests/test_trl_seam.py` checks each against the installed TRL, failing with a message that names what changed.
`trl_seam.asynchronous` holds what concerns TRL's asynchronous trainer, imported only where that trainer is used (TRL
1.16 warns when its experimental package is imported).
"""

import contextlib

from trl.trainer import grpo_trainer


@contextlib.contextmanager
def grpo_builds_vllm_with(generation_class: type):
    """
    Within the block, `GRPOTrainer` builds `generation_class` where it builds TRL's `VLLMGeneration`: it constructs
    its vLLM sampler inline in `__init__`, from the name its module imported, with no argument to pass another.

    Args:
        generation_class (`type`):
            A subclass of TRL's `VLLMGeneration`, with its constructor's signature.
    """
    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = generation_class
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original
