"""trl-topr: Tapered Off-Policy REINFORCE (arXiv:2503.14286) for Hugging Face TRL."""

__version__ = "0.1.0"

from typing import TYPE_CHECKING

from .quiet import show_messages, silence_unactionable_notices


silence_unactionable_notices()  # before PEFT imports bitsandbytes and accelerate imports DeepSpeed

from .baseline import baseline_for_positive_fraction, effective_positive_fraction
from .config import TOPRArguments, TOPRConfig
from .curation import anna_karenina, baseline_for_target, composition_report, rebalance
from .data import DataCollatorForTOPR, TOPRDataError, completion_text
from .evaluation import best_of_n, weighted_vote
from .generation import SamplingSettings, generation_engine
from .loop import LoopCallback, read_rounds, run_topr_loop
from .loop_config import TOPRLoopConfig
from .loss import topr_loss, topr_weights
from .online import TOPRGRPOConfig, TOPRGRPOTrainer
from .rewards import (
    answers_match,
    extract_final_answer,
    extract_verdict,
    gold_answer,
    gsm8k_invalid,
    gsm8k_reward,
    verifier_invalid,
    verifier_reward,
)
from .rollout import Trajectories, with_tool_template
from .sampling import Rollout, Sampler, evaluate_policy, generate_completions, sample_completions, score_completions
from .trainer import TOPRTrainer
from .verifier import verifier_prompts


# Asynchronous training builds on TRL's `trl.experimental` (TRL 1.16), which warns when it is imported: it is imported
# when one of its names is first used, not with the package.
# Type checkers and the API docs read them from here.
_ASYNC = ("SamplerRolloutWorker", "TOPRAsyncGRPOConfig", "TOPRAsyncGRPOTrainer")
if TYPE_CHECKING:
    from .async_grpo import SamplerRolloutWorker, TOPRAsyncGRPOConfig, TOPRAsyncGRPOTrainer


def __getattr__(name: str):
    if name in _ASYNC:
        from . import async_grpo

        return getattr(async_grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The public API: what a user imports, documented in docs/api.md (with `trl_topr.generation`'s, for engine authors).
# Everything else is internal and may change.
__all__ = [
    "DataCollatorForTOPR",
    "LoopCallback",
    "Rollout",
    "Sampler",
    "SamplerRolloutWorker",
    "SamplingSettings",
    "TOPRArguments",
    "TOPRAsyncGRPOConfig",
    "TOPRAsyncGRPOTrainer",
    "TOPRConfig",
    "TOPRDataError",
    "TOPRGRPOConfig",
    "TOPRGRPOTrainer",
    "TOPRLoopConfig",
    "TOPRTrainer",
    "Trajectories",
    "anna_karenina",
    "answers_match",
    "baseline_for_positive_fraction",
    "baseline_for_target",
    "best_of_n",
    "completion_text",
    "composition_report",
    "effective_positive_fraction",
    "evaluate_policy",
    "extract_final_answer",
    "extract_verdict",
    "generate_completions",
    "generation_engine",
    "gold_answer",
    "gsm8k_invalid",
    "gsm8k_reward",
    "read_rounds",
    "rebalance",
    "run_topr_loop",
    "sample_completions",
    "score_completions",
    "show_messages",
    "topr_loss",
    "topr_weights",
    "verifier_invalid",
    "verifier_prompts",
    "verifier_reward",
    "weighted_vote",
    "with_tool_template",
]
