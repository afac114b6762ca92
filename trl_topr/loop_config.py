import dataclasses
from dataclasses import dataclass, field

from trl import GRPOConfig

from .config import TOPRConfig
from .generation.arguments import VLLMArguments, like_trl
from .generation.settings import SamplingSettings
from .logprobs import BEHAVIOR_LOGPS_SOURCES, check_behavior_logps_source


@dataclass
class TOPRLoopConfig(VLLMArguments):
    r"""
    Configuration class of [`run_topr_loop`]: everything the loop owns, beside the [`TOPRConfig`] each round trains
    with. Its sampling fields keep the names of TRL's [`~trl.GRPOConfig`] (`num_generations`,
    `max_completion_length`, `use_vllm`, ...), so a GRPO configuration file reads the same here; every field is a
    command-line flag of the recipes and of `trl-topr sample` / `eval`, and a key of their YAML files.

    The generation engine's options are inherited from [`~trl_topr.generation.arguments.VLLMArguments`], as in TRL's
    [`~trl.GRPOConfig`]: `use_vllm`, `vllm_mode`, `vllm_server_base_url`, `vllm_server_host`, `vllm_server_port`,
    `vllm_server_timeout`, `vllm_gpu_memory_utilization`, `vllm_max_model_length`, `vllm_tensor_parallel_size`,
    `vllm_enable_sleep_mode`, `vllm_model_impl`, `vllm_enforce_eager`.

    Parameters:
        num_rounds (`int`, *optional*, defaults to `1`):
            Total number of rounds, those already completed in `output_dir` included (0: evaluate the initial model
            only).
        replay_rounds (`int`, *optional*, defaults to `0`):
            Off-policy replay: each round also trains on the rows of this many rounds before it, with the behavior
            log-probs recorded when they were sampled. 0: each round trains on its own samples (the paper's rounds).
        prompts_per_round (`int`, *optional*):
            Sample this many prompts a round, the next ones of the training prompts in order (starting again from the
            top past their end): the rounds go through the prompts as epochs do. `None`: every prompt, every round.
        curation (`str`, *optional*):
            A transformation of each round's samples before training: the name of a function of
            `trl_topr.curation` (`"anna_karenina"`: per prompt, the first correct completion and every incorrect
            one) or a dotted path (`my_module.my_curation`, a function `Dataset -> Dataset`). `None`: no curation.
        num_generations (`int`, *optional*, defaults to `4`):
            Completions sampled per prompt each round (the paper: 16 for GSM8K).
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; 0 decodes greedily.
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling threshold (1 disables it).
        top_k (`int`, *optional*, defaults to `0`):
            Top-k sampling, 0 to disable it (the paper: 500).
        max_completion_length (`int`, *optional*, defaults to `256`):
            Maximum length of a completion, in tokens (a trajectory with tools: all its turns and results).
        sampling_batch_size (`int`, *optional*, defaults to `16`):
            Prompts per `generate` call of transformers (vLLM schedules its own batches), and rows per forward of the
            behavior log-probs.
        reward_weights (`list[float]`, *optional*):
            Weights of the reward functions in the `reward` column (1 each by default); a weight of 0 keeps a
            function as a column only.
        num_generations_eval (`int`, *optional*):
            Samples per held-out prompt in the evaluation (the k of maj@k and of the sampled pass@1). Defaults to
            `num_generations`.
        behavior_logps_source (`str`, *optional*, defaults to `"trainer"`):
            Where the behavior log-probs mu of sampled completions come from. `"trainer"`: recomputed by the
            trainer's forward, exactly consistent with pi (one forward pass); the sampler's own log-probs, when it
            returns any, are compared with them (logged as `behavior_logps_mismatch_*`). `"sampler"`: vLLM's raw
            log-probs (free, the distribution actually sampled, but computed by other kernels, in the engine's
            precision; needs `use_vllm`). See `docs/sampling.md`.
        max_tool_calling_iterations (`int`, *optional*):
            TRL GRPO's option, for sampling with `tools`: the most tool-calling turns of a trajectory. `None`: no
            limit; a trajectory ends when the policy answers without calling a tool, or when its length reaches
            `max_completion_length`.
        default_target_positive_fraction (`float`, *optional*, defaults to `0.8`):
            The target positive fraction TOPR's rounds train with where the training configuration sets no baseline
            (neither `baseline` nor `target_positive_fraction`): what the iterative benchmark found above the paper's
            baseline 0 on-policy at its fast scale (docs/benchmarks.md, "What to set"). `None` trains them with
            [`TOPRConfig`]'s own default, baseline 0. [`training_args`] applies it, and the rounds record what they
            trained with.

    Example:
    ```python
    >>> from trl_topr import TOPRLoopConfig

    >>> loop_args = TOPRLoopConfig(num_rounds=3, num_generations=8, max_completion_length=128)
    >>> loop_args.sampling(seed=1)
    SamplingSettings(num_samples=8, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=128, batch_size=16, seed=1)
    >>> loop_args.eval_sampling(seed=0).num_samples  # num_generations_eval defaults to num_generations
    8

    ```
    """

    num_rounds: int = field(
        default=1,
        metadata={"help": "Rounds of sample / train / evaluate, completed ones included (0: evaluate only)."},
    )
    replay_rounds: int = field(
        default=0,
        metadata={
            "help": "Off-policy replay: each round also trains on the rows of this many earlier rounds, with the "
            "behavior log-probs recorded when they were sampled (0: the paper's on-policy rounds)."
        },
    )
    prompts_per_round: int | None = field(
        default=None,
        metadata={
            "help": "Prompts sampled a round, the next ones in order (None: every prompt, every round).",
        },
    )
    curation: str | None = field(
        default=None,
        metadata={
            "help": "Curation of each round's samples: a function of trl_topr.curation ('anna_karenina') or a "
            "dotted path `module.function` (None: no curation)."
        },
    )
    num_generations: int = field(default=4, metadata={"help": "Completions sampled per prompt each round."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; 0 decodes greedily."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (1 disables it)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling, 0 to disable it (the paper: 500)."})
    max_completion_length: int = field(default=256, metadata={"help": "Maximum completion length, in tokens."})
    sampling_batch_size: int = field(
        default=16, metadata={"help": "Prompts per transformers generate call, rows per behavior log-prob forward."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the reward functions in the `reward` column (1 each)."}
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Samples per held-out prompt (k of maj@k and sampled pass@1); defaults to num_generations."},
    )

    behavior_logps_source: str = field(
        default="trainer",
        metadata={
            "help": "Behavior log-probs of sampled completions: 'trainer' (recomputed by the trainer's forward, "
            "consistent with pi) or 'sampler' (vLLM's raw log-probs, free).",
            "choices": BEHAVIOR_LOGPS_SOURCES,
        },
    )
    max_tool_calling_iterations: int | None = like_trl(GRPOConfig, "max_tool_calling_iterations")
    default_target_positive_fraction: float | None = field(
        default=0.8,
        metadata={
            "help": "Target positive fraction of TOPR's rounds where the training configuration sets no baseline "
            "(None: TOPRConfig's default, baseline 0)."
        },
    )

    def __post_init__(self):
        self.check_vllm_arguments()
        check_behavior_logps_source(self.behavior_logps_source, self.use_vllm)
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(f"`max_tool_calling_iterations` must be >= 0, got {self.max_tool_calling_iterations}.")
        target = self.default_target_positive_fraction
        if target is not None and not 0.0 < target < 1.0:
            raise ValueError(f"`default_target_positive_fraction` must be in (0, 1) or None, got {target}.")
        for name in ("num_rounds", "replay_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
        if self.prompts_per_round is not None and (
            not isinstance(self.prompts_per_round, int)
            or isinstance(self.prompts_per_round, bool)
            or self.prompts_per_round < 1
        ):
            raise ValueError(f"`prompts_per_round` must be an integer >= 1 or None, got {self.prompts_per_round!r}.")
        self.sampling()  # SamplingSettings checks the sampling fields, naming the wrong one
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"`num_generations_eval` must be >= 1, got {self.num_generations_eval}.")

    def sampling(self, seed: int | None = None) -> SamplingSettings:
        """
        How each round samples, as the generation engines take it.

        Args:
            seed (`int`, *optional*):
                Seed of the sampling (the loop gives round r the training seed + r).

        Returns:
            [`~trl_topr.generation.SamplingSettings`]: `num_generations` completions per prompt, and the other
            sampling fields.
        """
        return SamplingSettings(
            num_samples=self.num_generations,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_completion_length,
            batch_size=self.sampling_batch_size,
            seed=seed,
        )

    def eval_sampling(self, seed: int | None = None) -> SamplingSettings:
        """
        How the evaluation samples: as the rounds sample, `num_generations_eval` completions per held-out prompt.

        Args:
            seed (`int`, *optional*):
                Seed of the sampling (the loop gives it the training seed, the same every round).

        Returns:
            [`~trl_topr.generation.SamplingSettings`]: the evaluation's settings.
        """
        return self.sampling(seed).replace(num_samples=self.num_generations_eval or self.num_generations)

    def training_args(self, train_args: TOPRConfig) -> TOPRConfig:
        """
        The training configuration the rounds train with: `train_args`, with `target_positive_fraction` set to
        `default_target_positive_fraction` where it trains TOPR's loss (`loss_type="topr"`) and sets no baseline.
        [`run_topr_loop`] trains with it, and records it; a recipe that publishes what trained reads it here.

        Args:
            train_args ([`TOPRConfig`]):
                The training configuration.

        Returns:
            [`TOPRConfig`]: `train_args` itself where nothing changes, else a copy.

        Example:
        ```python
        >>> from trl_topr import TOPRConfig, TOPRLoopConfig

        >>> TOPRLoopConfig().training_args(TOPRConfig("out", use_cpu=True)).target_positive_fraction
        0.8
        >>> TOPRLoopConfig().training_args(TOPRConfig("out", use_cpu=True, baseline=0.0)).target_positive_fraction

        ```
        """
        unset = train_args.baseline is None and train_args.target_positive_fraction is None
        if train_args.loss_type != "topr" or not unset or self.default_target_positive_fraction is None:
            return train_args
        return dataclasses.replace(train_args, target_positive_fraction=self.default_target_positive_fraction)
