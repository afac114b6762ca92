import math
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property

import torch
from trl import SFTConfig

from .compat import CHECKPOINTING
from .loss import LOSS_NORMALIZATIONS, LOSS_TYPES, LOSS_TYPES_HELP, RATIO_LEVELS, check_loss_options
from .precision import apply_precision_defaults


def check_topr_options(args) -> None:
    """
    Check the TOPR options of a configuration ([`TOPRArguments`]): the loss's
    ([`~trl_topr.loss.check_loss_options`]) and the baseline's (at most one of `baseline`, `target_positive_fraction`
    and `group_baseline`; a finite baseline; a target in (0, 1)).

    Args:
        args ([`TOPRArguments`]):
            The configuration.

    Raises:
        `ValueError`: naming the option with a wrong value.
    """
    check_loss_options(
        args.loss_type,
        args.ratio_level,
        args.loss_normalization,
        args.positive_ratio_bounds,
        args.negative_ratio_bounds,
        args.epsilon,
    )
    options = ["baseline", "target_positive_fraction", "group_baseline"]
    chosen = [name for name in options if getattr(args, name) not in (None, False)]
    if len(chosen) > 1:
        which = "at most one of " + ", ".join(f"`{n}`" for n in options)
        raise ValueError(f"Set {which} (got {' and '.join(f'`{n}`' for n in chosen)}): each sets the baseline.")
    if args.baseline is not None and not math.isfinite(args.baseline):
        raise ValueError(f"`baseline` must be a finite number, got {args.baseline}.")
    if args.target_positive_fraction is not None and not 0.0 < args.target_positive_fraction < 1.0:
        raise ValueError(f"`target_positive_fraction` must be in (0, 1), got {args.target_positive_fraction}.")


def apply_training_defaults(args) -> None:
    """
    The defaults [`TOPRConfig`] and [`~trl_topr.online.TOPRGRPOConfig`] change from TRL's, applied in place before
    `TrainingArguments` validates `args`: the precision from the hardware
    ([`~trl_topr.precision.apply_precision_defaults`]), and activation checkpointing on (TRL's default) under its
    current name, unless either name was set.

    Args:
        args ([`TOPRArguments`]):
            The configuration, before its `__post_init__`.
    """
    apply_precision_defaults(args)
    if CHECKPOINTING == "gradient_checkpointing" and getattr(args, "activation_checkpointing", None) is not None:
        args.gradient_checkpointing = args.activation_checkpointing
    if getattr(args, "activation_checkpointing", None) is None and args.gradient_checkpointing is None:
        setattr(args, CHECKPOINTING, True)


@dataclass
class TOPRArguments:
    r"""
    TOPR's options, defined once for every configuration that trains with TOPR's loss: [`TOPRConfig`] (the offline
    trainer and the loop's rounds) and [`TOPRGRPOConfig`] (online) inherit them beside TRL's configuration, and the
    trainers, the replay's metrics and the loss read them through [`loss_options`] and [`weight_options`]. Also the
    defaults these configurations change from TRL's: bf16 from the hardware, activation checkpointing under its
    current name.

    Parameters:
        loss_type (`str`, *optional*, defaults to `"topr"`):
            Weighting of positive (`R - c >= 0`) and negative (`R - c < 0`) completions, all computed by the same
            code ([`topr_loss`]). It replaces TRL's own `loss_type` (SFT's nll/dft, GRPO's grpo/dapo/...), which
            does not apply to TOPR. Possible values:

            - `"topr"`: weight 1 for positives, clip(pi/mu, 0, 1) for negatives (the paper's method).
            - `"reinforce"`: weight 1 for both (naive off-policy REINFORCE).
            - `"is"`: untruncated importance ratio pi/mu for both.
            - `"tis"`: truncated ratio clip(pi/mu, 0, 1) for both.
            - `"positives_only"`: SFT on the positives, negatives dropped.
            - `"ppo_clip"`: PPO's clipped surrogate with trust region `[1 - epsilon, 1 + epsilon]`.
        positive_ratio_bounds (`list[float]`, *optional*):
            Custom window `[a+, b+]` of the importance ratio for positives: their weight is clip(pi/mu, a+, b+).
            Defaults to the `loss_type` preset (`[1, 1]` for `"topr"`).
        negative_ratio_bounds (`list[float]`, *optional*):
            Custom window `[a-, b-]` for negatives. Defaults to the `loss_type` preset (`[0, 1]` for `"topr"`).
        epsilon (`float`, *optional*, defaults to `0.2`):
            Trust region of `loss_type="ppo_clip"` (GRPO's clipping epsilon, where a GRPO configuration has one).
        ratio_level (`str`, *optional*, defaults to `"sequence"`):
            Level of the importance ratio: `"sequence"` (exp of the summed log-ratio over the completion, the paper),
            `"token"` (one ratio per token; needs per-token behavior log-probs) or `"sequence_mean"` (exp of the
            length-normalized log-ratio). It replaces GRPO's `importance_sampling_level`.
        loss_normalization (`str`, *optional*, defaults to `"sequence_length"`):
            `"sequence_length"` (each sequence's weighted log-likelihood divided by its length, averaged over the
            batch, the paper), `"token_mean"` (divided by the batch's number of completion tokens; online, the whole
            generation batch's, as GRPO's `"dapo"`) or `"sum"` (summed over each sequence's tokens, averaged over the
            batch).
        baseline (`float`, *optional*):
            Baseline `c` subtracted from the rewards. Defaults to `0.0` (the paper's setting); [`run_topr_loop`]
            trains rounds that set neither this nor `target_positive_fraction` with its own default
            ([`TOPRLoopConfig`]'s `default_target_positive_fraction`, 0.8). Mutually exclusive with
            `target_positive_fraction`.
        target_positive_fraction (`float`, *optional*):
            Target effective positive fraction p_eff in (0, 1): the baseline is derived from the rewards (offline the
            training set's, online each generation batch's) so that the positives carry this share of the total
            weight; 0 where the rewards are all equal ([`~trl_topr.topr_baseline`]). The paper found 0.1-0.2 best with
            its baseline sweep; the loop's benchmark 0.8 (docs/benchmarks.md). Mutually exclusive with `baseline`.
        group_baseline (`bool`, *optional*, defaults to `False`):
            The baseline of each completion is the mean reward of its prompt's `num_generations` completions, sampled
            together: GRPO's baseline, without its scaling. For the trainers that sample groups (online and
            asynchronous); the offline trainer refuses it. Mutually exclusive with `baseline` and
            `target_positive_fraction`.
        bf16 (`bool`, *optional*):
            bf16 mixed precision. Defaults to the hardware ([`~trl_topr.precision.bf16_is_faster`]) instead of TRL's
            `True`: on where bf16 runs faster than float32 on the training device (GPUs from Ampere on; CPUs where a
            short matmul probe, run once and cached, finds it at least 1.25x faster), off elsewhere, where emulated
            bf16 can run many times slower. An explicit value is always used. Without an accelerator, `use_cpu` is set.
        activation_checkpointing (`bool`, *optional*, defaults to `True`):
            transformers' activation checkpointing, TRL's default; `gradient_checkpointing`, its deprecated alias, is
            accepted too (and, before transformers 5.20, `activation_checkpointing` as its new name).
    """

    loss_type: str = field(
        default="topr",
        metadata={
            "help": f"Weighting of positives / negatives: {LOSS_TYPES_HELP}. Replaces TRL's own `loss_type` "
            "(SFT's nll/dft, GRPO's grpo/dapo/...).",
            "choices": list(LOSS_TYPES),
        },
    )
    positive_ratio_bounds: list[float] | None = field(
        default=None,
        metadata={
            "help": "Custom window [a+, b+] of the importance ratio for positives. Defaults to the `loss_type` "
            "preset ([1, 1] for 'topr').",
            "nargs": 2,
        },
    )
    negative_ratio_bounds: list[float] | None = field(
        default=None,
        metadata={
            "help": "Custom window [a-, b-] of the importance ratio for negatives. Defaults to the `loss_type` "
            "preset ([0, 1] for 'topr').",
            "nargs": 2,
        },
    )
    epsilon: float = field(default=0.2, metadata={"help": "Trust region of `loss_type='ppo_clip'`."})
    ratio_level: str = field(
        default="sequence",
        metadata={
            "help": "Level of the importance ratio: 'sequence' (the paper), 'token' or 'sequence_mean' "
            "(length-normalized log-ratio).",
            "choices": list(RATIO_LEVELS),
        },
    )
    loss_normalization: str = field(
        default="sequence_length",
        metadata={
            "help": "'sequence_length' (divide each sequence by its length, the paper), 'token_mean' or 'sum'.",
            "choices": list(LOSS_NORMALIZATIONS),
        },
    )
    baseline: float | None = field(
        default=None,
        metadata={
            "help": "Baseline c subtracted from the rewards. Defaults to 0.0 (the paper's); the loop trains rounds "
            "that set neither this nor `target_positive_fraction` with its `default_target_positive_fraction` (0.8). "
            "Exclusive with `target_positive_fraction`."
        },
    )
    target_positive_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Target effective positive fraction in (0, 1): the baseline is derived from the rewards (the "
            "training set's, or online each generation batch's). Exclusive with `baseline`."
        },
    )
    group_baseline: bool = field(
        default=False,
        metadata={
            "help": "Centre each reward on the mean reward of its prompt's completions (online and asynchronous "
            "trainers). Exclusive with `baseline` and `target_positive_fraction`."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision. Defaults to the hardware: on where bf16 runs faster than float32 on the "
            "training device (GPUs from Ampere on; CPUs where a short matmul probe, run once and cached, finds it "
            "faster), off elsewhere, where it is far slower."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers), which defaults to True."},
    )
    if CHECKPOINTING == "gradient_checkpointing":  # before transformers 5.20: the new name, accepted as the alias
        activation_checkpointing: bool | None = field(
            default=None, metadata={"help": "Activation checkpointing (transformers' `gradient_checkpointing`)."}
        )

    def __post_init__(self):
        apply_training_defaults(self)  # before TRL's configuration validates the arguments
        super().__post_init__()
        check_topr_options(self)

    @cached_property
    def _setup_devices(self) -> torch.device:
        # transformers' device set-up, with the process group's timeout (`ddp_timeout`) on the CPU too: transformers
        # gives it to the process group on accelerators only, and a collective that a process never reaches would wait
        # 30 minutes on gloo
        device = super()._setup_devices
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(timedelta(seconds=self.ddp_timeout))
        return device

    def __getstate__(self):
        # `Trainer` pickles its arguments to `training_args.bin` next to every saved model and checkpoint, which are
        # uploaded to the Hub: the pickle never carries the Hub token.
        state = self.__dict__.copy()
        state["hub_token"] = None
        return state

    def baseline_options(self, group_size: int | None = None) -> dict:
        """
        The options of [`~trl_topr.topr_advantages`]: what sets the baseline, as every trainer passes it.

        Args:
            group_size (`int`, *optional*):
                The completions sampled together for a prompt (`num_generations`), for `group_baseline`.
        """
        if self.group_baseline:
            return {"group_size": group_size}
        return {"baseline": self.baseline, "target_positive_fraction": self.target_positive_fraction}

    def loss_options(self) -> dict:
        """The options of [`topr_loss`] (all but the baseline): what every trainer passes it."""
        return {
            "ratio_level": self.ratio_level,
            "loss_normalization": self.loss_normalization,
            **self.weight_options(),
        }

    def weight_options(self) -> dict:
        """The options of [`topr_weights`] and [`~trl_topr.loss.clamped_ratios`]: the ratio windows of each sign."""
        return {
            "loss_type": self.loss_type,
            "positive_ratio_bounds": self.positive_ratio_bounds,
            "negative_ratio_bounds": self.negative_ratio_bounds,
            "epsilon": self.epsilon,
        }


@dataclass
class TOPRConfig(TOPRArguments, SFTConfig):
    r"""
    Configuration class for the [`TOPRTrainer`]: what training reads, in the trainer and in each round of
    [`run_topr_loop`] (whose own options, sampling included, are [`TOPRLoopConfig`]'s).

    Extends TRL's [`~trl.SFTConfig`], whose data preprocessing (tokenization of prompt/completion pairs, chat
    templates, `max_length` truncation) and model options (`model_init_kwargs`, PEFT, quantization) are used as they
    are, with TOPR's options ([`TOPRArguments`]: `loss_type`, the ratio windows and level, `loss_normalization`,
    `baseline` or `target_positive_fraction`). Only the parameters of the data are listed here; for the others see
    [`TOPRArguments`], [`~trl.SFTConfig`] and [`~transformers.TrainingArguments`].

    Parameters:
        prompt_column (`str`, *optional*, defaults to `"prompt"`):
            Column of the prompts (text, or a list of messages for conversational data).
        completion_column (`str`, *optional*, defaults to `"completion"`):
            Column of the completions, in the same format as the prompts.
        reward_column (`str`, *optional*, defaults to `"reward"`):
            Column of the scalar rewards.
        label_column (`str`, *optional*, defaults to `"label"`):
            Boolean column read as reward +1 (`True`) / -1 (`False`) when `reward_column` is absent, as in
            KTO-style unpaired preference datasets.
        behavior_logps_column (`str`, *optional*, defaults to `"behavior_logps"`):
            Column of the behavior policy's log-probabilities: one float per row (summed over the completion tokens)
            or a list with one float per completion token. When the column is absent, they are computed once before
            training with the initial policy.
        precompute_behavior_batch_size (`int`, *optional*):
            Batch size of the behavior log-prob precompute. Defaults to `per_device_eval_batch_size`.

    > [!NOTE]
    > These parameters have default values different from [`~trl.SFTConfig`]:
    > - `learning_rate`: Defaults to `1e-6` instead of `2e-5`, as TRL's other policy-gradient trainers (the paper
    >   used 5e-7 for Llama 3 8B with Adafactor).
    > - `num_train_epochs`: Defaults to `1` instead of `3`: the paper trains one epoch on each generated dataset, and
    >   [`run_topr_loop`] trains `num_train_epochs` on each round's data.
    > - `loss_type`: Defaults to `"topr"` ([`TOPRArguments`]).
    > - `bf16`: Defaults to the hardware instead of always `True`, and `activation_checkpointing` to `True` under its
    >   current name ([`TOPRArguments`]).

    > [!NOTE]
    > `padding_free=True` ([`~trl.SFTConfig`]'s option) lays each batch's rows end to end without padding; the loss,
    > the ratio and the metrics stay per completion. The trainer checks at construction that the model keeps the rows
    > apart ([`~trl_topr.logprobs.check_sequences_kept_apart`]). `packing=True` is refused: it would change the
    > number of completions in each batch and drop each row's reward and behavior log-probs.
    """

    learning_rate: float = field(
        default=1e-6,
        metadata={"help": "The initial learning rate for AdamW."},
    )
    num_train_epochs: float = field(
        default=1.0,
        metadata={"help": "Epochs on the training data (in `run_topr_loop`: on each round's data). The paper's 1."},
    )

    # Parameters that control the data
    prompt_column: str = field(default="prompt", metadata={"help": "Column of the prompts."})
    completion_column: str = field(default="completion", metadata={"help": "Column of the completions."})
    reward_column: str = field(default="reward", metadata={"help": "Column of the scalar rewards."})
    label_column: str = field(
        default="label",
        metadata={"help": "Boolean column read as reward +1/-1 when `reward_column` is absent."},
    )
    behavior_logps_column: str = field(
        default="behavior_logps",
        metadata={
            "help": "Column of the behavior log-probs (a float per row, or a list with a float per completion token). "
            "Computed with the initial policy when absent."
        },
    )
    precompute_behavior_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size of the behavior log-prob precompute. Defaults to `per_device_eval_batch_size`."},
    )

    def __post_init__(self):
        super().__post_init__()  # TOPR's defaults and checks around SFTConfig's
        if self.group_baseline:
            raise ValueError(
                "`group_baseline` centres each completion on the others of its prompt sampled with it, which the "
                "online and asynchronous trainers do; offline rows are not grouped: set `baseline` or "
                "`target_positive_fraction`."
            )
        # TOPR's loss is a sum over each completion, and its mean is over the batch's completions: a batch holds
        # `per_device_train_batch_size` whole rows. `padding_free` keeps that (it only lays the rows end to end);
        # packing does not.
        if self.packing:
            raise ValueError(
                "`packing` is not supported by TOPR: it fills each batch with a token budget of rows (a different "
                "number of completions in every batch) and TRL's packer carries token columns only, not the reward "
                "and behavior log-probs of each row. Set `padding_free=True` instead: each batch of "
                "`per_device_train_batch_size` rows is laid end to end, with no padding."
            )
        if self.completion_only_loss is False:
            raise ValueError("`completion_only_loss=False` is not supported: TOPR weighs completion tokens only.")
