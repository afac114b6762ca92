from dataclasses import dataclass, field

from .generation.arguments import VLLMArguments
from .generation.settings import SamplingSettings


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
    `vllm_enable_sleep_mode`, `vllm_model_impl`, `vllm_enforce_eager`, and `behavior_logps_source` (where mu comes
    from) and `max_tool_calling_iterations` (the tools' limit).

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

    def __post_init__(self):
        self.check_vllm_arguments()
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
