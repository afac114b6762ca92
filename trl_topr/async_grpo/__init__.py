"""Asynchronous TOPR: TRL's asynchronous GRPO trainer with TOPR's loss, keeping the stale samples that TRL drops.

TRL's `AsyncGRPOTrainer` trains on a queue of samples that a rollout worker fills while the policy moves on: each
sample was drawn by the policy of some earlier version, and TRL drops those older than `max_staleness`. TOPR is made
for exactly those samples: a negative's weight is clip(pi/mu, 0, 1), so it fades as the policy leaves it behind, and a
positive's weight is 1. [`TOPRAsyncGRPOTrainer`] is TRL's trainer with TOPR's loss (from the same definition as the
other trainers: [`~trl_topr.TOPRArguments`], [`~trl_topr.topr_loss`]), and [`TOPRAsyncGRPOConfig`] keeps every sample
by default. [`SamplerRolloutWorker`] is a rollout worker in the training process, over a [`~trl_topr.Sampler`], that
centres each sample's reward with TOPR's baseline and draws from the policy a set number of versions back, so that
staleness is reproducible: for CPU runs, tests and the benchmarks. On GPUs, TRL's own worker samples with a vLLM
server.
"""

from ..trl_seam.asynchronous import AsyncGRPOConfig, AsyncGRPOTrainer, RolloutSample
from .attention import flash_attention_3_loads, tree_attention
from .config import UNBOUNDED_STALENESS, TOPRAsyncGRPOConfig
from .packed import MODEL_VERSION, per_sample, samples_of
from .trainer import TOPRAsyncGRPOTrainer
from .worker import SamplerRolloutWorker, grpo_advantages


__all__ = [
    "MODEL_VERSION",
    "UNBOUNDED_STALENESS",
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "RolloutSample",
    "SamplerRolloutWorker",
    "TOPRAsyncGRPOConfig",
    "TOPRAsyncGRPOTrainer",
    "flash_attention_3_loads",
    "grpo_advantages",
    "per_sample",
    "samples_of",
    "tree_attention",
]
