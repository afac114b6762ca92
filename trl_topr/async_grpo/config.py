"""The asynchronous trainer's configuration: TRL's `AsyncGRPOConfig` with TOPR's options."""

from dataclasses import dataclass, field

from ..config import TOPRArguments
from ..trl_seam.asynchronous import TRL_MAX_STALENESS, AsyncGRPOConfig, trl_inflight_tasks


# `max_staleness=None` keeps every sample; TRL compares an integer, so it is stored as this one
UNBOUNDED_STALENESS = 2**31 - 1


@dataclass
class TOPRAsyncGRPOConfig(TOPRArguments, AsyncGRPOConfig):
    r"""
    Configuration class for the [`TOPRAsyncGRPOTrainer`].

    Extends TRL's `AsyncGRPOConfig` (generation, the rollout queue, weight syncs, the vLLM server) with TOPR's options
    ([`TOPRArguments`]: `loss_type`, the ratio windows and level, `loss_normalization`, `baseline` or
    `target_positive_fraction`), which the loss and [`SamplerRolloutWorker`] read. `epsilon` is only the trust region
    of `loss_type="ppo_clip"`.

    Parameters:
        max_staleness (`int`, *optional*):
            Drop samples drawn more than this many policy versions (weight syncs) ago, as TRL does (its default: 4).
            `None` (the default) keeps every sample: TOPR's taper bounds what a stale negative weighs, and a stale
            positive is still a good answer. Stored as a very large integer, which TRL compares.
        use_worker_advantages (`bool`, *optional*, defaults to `False`):
            Train each sample's `advantage` as the rollout worker filled it (TRL's worker: GRPO's group-normalised
            (R - mean) / std) instead of TOPR's R - c, which the trainer otherwise computes from each sample's reward
            over an optimizer step's samples ([`~trl_topr.topr_advantages`] with `baseline`,
            `target_positive_fraction` or `group_baseline`), whatever the worker.
        in_process_rollouts (`bool`, *optional*, defaults to `False`):
            Sample in the training process with a [`SamplerRolloutWorker`] (transformers' `generate`), instead of
            TRL's worker on a vLLM server (`vllm_server_base_url`): for CPU runs and tests, one process.
        rollout_lag (`int`, *optional*, defaults to `0`):
            [`SamplerRolloutWorker`]: sample from the policy this many versions back (the earliest version while
            there are fewer), so that every sample has this staleness when it is trained.
        rollout_prompts (`int`, *optional*):
            [`SamplerRolloutWorker`]: prompts sampled together (each `num_generations` times); defaults to one
            optimizer step's worth of samples.
    """

    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Drop samples more than this many policy versions old, as TRL does (its default 4). None (the "
            "default): keep every sample, TOPR's taper bounds their weight."
        },
    )
    use_worker_advantages: bool = field(
        default=False,
        metadata={"help": "Train the worker's own advantages (TRL's: GRPO's) instead of TOPR's R - c."},
    )
    in_process_rollouts: bool = field(
        default=False,
        metadata={"help": "Sample in the training process (transformers), not with TRL's worker on a vLLM server."},
    )
    rollout_lag: int = field(
        default=0, metadata={"help": "In-process rollouts: sample from the policy this many versions back."}
    )
    rollout_prompts: int | None = field(
        default=None,
        metadata={"help": "In-process rollouts: prompts sampled together (default: one optimizer step's worth)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.use_worker_advantages and (
            self.baseline is not None or self.target_positive_fraction is not None or self.group_baseline
        ):
            raise ValueError(
                "`use_worker_advantages` trains the worker's advantages as they are: TOPR's baseline options "
                "(`baseline`, `target_positive_fraction`, `group_baseline`) would not be used. Set one or the other."
            )
        if self.rollout_lag < 0:
            raise ValueError(f"`rollout_lag` must be >= 0, got {self.rollout_lag}.")
        if self.max_staleness is None or self.max_staleness >= UNBOUNDED_STALENESS:
            self.max_staleness = UNBOUNDED_STALENESS
            if self.max_inflight_tasks < 0:  # TRL sizes them with `max_staleness`: with TRL's default instead
                self.max_inflight_tasks = trl_inflight_tasks(self, TRL_MAX_STALENESS)
        elif self.max_staleness < 0:
            raise ValueError(f"`max_staleness` must be >= 0 or None, got {self.max_staleness}.")
        if self.in_process_rollouts and self.token_budget is None:
            self.token_budget = 0  # batches of a fixed count of samples: no server to ask for a context length
