"""Online TOPR: [`~trl.GRPOTrainer`] with its loss replaced by [`topr_loss`]. Swap `GRPOTrainer` / `GRPOConfig` for
`TOPRGRPOTrainer` / `TOPRGRPOConfig` and a TRL GRPO script trains with TOPR."""

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch
from trl import GRPOConfig
from trl.trainer.utils import get_config_model_id

from .baseline import topr_advantages
from .config import TOPRArguments
from .distributed import NamesTheStep
from .generation.vllm_engine import TOPRVLLMGeneration
from .loss import topr_loss
from .precision import FlushesDenormals
from .trainer import TOPR_PAPER, CardOnSave, record_metrics, with_logged_metrics
from .trl_seam import GRPOTrainerHooks, grpo_builds_vllm_with, trl_model_card


# Options of GRPO's own loss, which TOPR's loss replaces, with the value that leaves them off.
GRPO_LOSS_OPTIONS = {
    "beta": 0.0,
    "delta": None,
    "epsilon_high": None,
    "importance_sampling_level": "token",
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
}
MULTIMODAL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class TOPRGRPOConfig(TOPRArguments, GRPOConfig):
    r"""
    Configuration class for the [`TOPRGRPOTrainer`].

    Extends TRL's [`~trl.GRPOConfig`] (generation, rewards, batching, vLLM) with TOPR's options ([`TOPRArguments`],
    as [`TOPRConfig`]: `loss_type`, the ratio windows and level, `loss_normalization`, `baseline` or
    `target_positive_fraction`) and `group_baseline`. `loss_type` replaces GRPO's (grpo/dapo/...) instead of adding a
    second name: GRPO reads it only in the loss, which [`TOPRGRPOTrainer`] replaces, and scripts keep passing
    `--loss_type`; `epsilon` is GRPO's clipping epsilon, reused as the trust region of `"ppo_clip"`. R is GRPO's
    combined reward (weighted sum of the reward functions), not its normalized advantage, so `scale_rewards` only
    shapes GRPO's logs; the sign test and the weight use R - c, c set by at most one of `baseline`,
    `target_positive_fraction` (from each generation batch, all processes) and `group_baseline`
    ([`~trl_topr.topr_advantages`]). GRPO's own loss
    options (`beta`, `delta`, `epsilon_high`, `importance_sampling_level`, `top_entropy_quantile`,
    `off_policy_mask_threshold`, `entropy_coef`, `use_adaptive_entropy`) must stay off: TOPR has no KL term, no
    reference model, and its own ratio options.

    `bf16` and `activation_checkpointing` default as in [`TOPRConfig`]: bf16 where it runs faster than float32 on the
    hardware.
    """

    def __post_init__(self):
        super().__post_init__()  # TOPR's defaults and checks around GRPOConfig's
        for name, off in GRPO_LOSS_OPTIONS.items():
            if getattr(self, name) != off:
                raise ValueError(f"`{name}` is an option of GRPO's loss, which TOPR replaces: leave it at {off!r}.")


@trl_model_card("TOPR-GRPO", TOPR_PAPER, ["trl", "topr", "grpo"])
class TOPRGRPOTrainer(NamesTheStep, FlushesDenormals, CardOnSave, GRPOTrainerHooks):
    r"""
    Online Tapered Off-Policy REINFORCE: [`~trl.GRPOTrainer`] with the TOPR loss, from [Tapered Off-Policy REINFORCE:
    Stable and efficient reinforcement learning for LLMs](https://huggingface.co/papers/2503.14286).

    Generates and scores completions of a prompt-only dataset exactly as GRPO does; only the loss differs:
    [`topr_loss`] on R - c, with mu the sampling policy: vLLM's log-probs when given, else GRPO's `old_per_token_logps`
    (when `steps_per_generation` or `num_iterations` make steps off-policy), else the current log-probs, detached
    (on-policy, where TOPR equals REINFORCE). Logs TOPR's metrics (`negative_weight_mean`, ...) next to GRPO's.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from trl_topr.online import TOPRGRPOTrainer

    >>> def reward_digit(completions, **kwargs):
    ...     return [1.0 if any(c.isdigit() for c in text) else -1.0 for text in completions]
    >>> dataset = Dataset.from_dict({"prompt": ["2 + 2 =", "3 + 5 ="]})
    >>> trainer = TOPRGRPOTrainer(
    ...     "HuggingFaceTB/SmolLM2-135M-Instruct", reward_digit, train_dataset=dataset
    ... )  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP

    ```

    Args:
        model (`str` or [`~transformers.PreTrainedModel`] or [`~peft.PeftModel`]):
            Model to train, as for [`~trl.GRPOTrainer`].
        reward_funcs (`Callable`, `str` or a list of them):
            Reward functions or reward models, as for [`~trl.GRPOTrainer`].
        args ([`TOPRGRPOConfig`], *optional*):
            Configuration; a default one if `None`. A plain [`~trl.GRPOConfig`] is refused (its `loss_type` is GRPO's).
        *more_args (`Any`):
            Further positional arguments of [`~trl.GRPOTrainer`] (`train_dataset`, `eval_dataset`, ...).
        **kwargs (`Any`):
            Further keyword arguments of [`~trl.GRPOTrainer`] (`train_dataset`, `peft_config`, `callbacks`, ...).
    """

    def __init__(self, model, reward_funcs=None, args: TOPRGRPOConfig | None = None, *more_args, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = TOPRGRPOConfig(f"{model_name.split('/')[-1]}-TOPR-GRPO")
        elif not isinstance(args, TOPRGRPOConfig):
            raise TypeError(f"`args` must be a TOPRGRPOConfig, got {type(args).__name__}: swap GRPOConfig for it.")
        # GRPO builds TRL's vLLM sampler inline; ours is TRL's class with vLLM's CPU build fixed (see
        # `trl_topr.generation.vllm_engine`)
        with grpo_builds_vllm_with(TOPRVLLMGeneration) if args.use_vllm else contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, *more_args, **kwargs)
        self._topr_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def scored_batch(self, output: dict, rewards_per_func, inputs) -> dict:
        """
        GRPO's scored generation batch, with each completion's reward R (GRPO's weighted sum of the reward functions;
        NaN where none scored it) and TOPR's baseline c ([`~trl_topr.topr_advantages`] over the generation batch, of
        every process), which the loss weights as R - c.
        """
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable: R - c is set to 0 in the loss
        # TOPR's R - c over the generation batch (every process's completions)
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        _, baselines = topr_advantages(rewards, **self.args.baseline_options(num_generations))
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        output["rewards"], output["baselines"] = rewards[local], baselines[local]
        return output

    def policy_loss(self, model, inputs):
        """TOPR's loss of a micro-batch ([`~trl_topr.topr_loss`] on R - c), in place of GRPO's."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        per_token_logps, entropies, aux_loss = self.per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{name: inputs.get(name) for name in MULTIMODAL_INPUTS},
        )
        # mu: GRPO leaves `old_per_token_logps` out when every step is on-policy; vLLM's log-probs are the sampler's.
        behavior_logps = inputs.get("old_per_token_logps", per_token_logps.detach())
        if (sampling := inputs.get("sampling_per_token_logps")) is not None:  # NaN: tokens vLLM could not score
            behavior_logps = torch.where(torch.isnan(sampling), behavior_logps, sampling)
        advantages = torch.nan_to_num(inputs["rewards"] - inputs["baselines"])  # R - c, 0 for unscorable completions
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # no HF scaling, as GRPO
        num_items = None
        if self.args.loss_normalization == "token_mean":
            # As GRPO's "dapo": the tokens of the whole generation batch (every process), rescaled to one accumulation
            # window, so that the update does not depend on how the batch is split into micro-batches and processes.
            num_items = inputs["num_items_in_batch"] / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss, metrics = topr_loss(
            per_token_logps, mask, advantages, behavior_logps, num_items_in_batch=num_items, **self.args.loss_options()
        )
        if num_items is None:
            loss = loss / accumulation
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        del metrics["reward"], metrics["completion_length"]  # GRPO logs them ("reward", "completions/mean_length")
        metrics["baseline"] = inputs["baselines"].float().nanmean()
        metrics["entropy"] = torch.where(mask.bool(), entropies.detach(), 0.0).sum() / mask.sum().clamp(min=1)
        record_metrics(self.accelerator, self._topr_metrics[mode], metrics)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TOPR's metrics next to GRPO's own
        super().log(with_logged_metrics(logs, self._topr_metrics, self.model.training), start_time)
