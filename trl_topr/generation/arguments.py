"""
The options of the generation layer, as flat fields that [`~trl_topr.TOPRConfig`] inherits (so the CLI and YAML
flags keep TRL's names): TRL GRPO's vLLM options, the source of the behavior log-probs, and [`engine_name`], which
reads from them which engine of [`~trl_topr.generation.ENGINES`] a configuration asks for.
"""

from dataclasses import dataclass, field

from trl import GRPOConfig


VLLM_FIELDS = (
    "use_vllm",
    "vllm_mode",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_gpu_memory_utilization",
    "vllm_max_model_length",
    "vllm_tensor_parallel_size",
    "vllm_enable_sleep_mode",
    "vllm_model_impl",
)
BEHAVIOR_LOGPS_SOURCES = ("trainer", "sampler")


def _like_grpo(name: str):
    # GRPOConfig's field `name`: its default and its help, so that the vLLM options read as in TRL's GRPO
    grpo_field = GRPOConfig.__dataclass_fields__[name]
    return field(default=grpo_field.default, metadata=dict(grpo_field.metadata))


@dataclass
class VLLMArguments:
    r"""
    Sampling with vLLM: TRL's GRPO options (same names, defaults and meaning), read by [`~trl_topr.run_topr_loop`],
    [`~trl_topr.sample_completions`], `recipes/gsm8k.py` and `trl-topr sample`, and the choice of the behavior
    log-probs.

    Parameters:
        use_vllm (`bool`, *optional*, defaults to `False`):
            Sample with vLLM instead of transformers' `generate` (`pip install trl-topr[vllm]`).
        vllm_mode (`str`, *optional*, defaults to `"colocate"`):
            `"colocate"`: an engine in each training process. `"server"`: a running vLLM server (see
            `docs/sampling.md` for the command), reloaded from each round's saved folder.
        vllm_server_base_url (`str`, *optional*):
            Base URL of the server; overrides `vllm_server_host` and `vllm_server_port`.
        vllm_server_host (`str`, *optional*, defaults to `"0.0.0.0"`):
            Host of the server.
        vllm_server_port (`int`, *optional*, defaults to `8000`):
            Port of the server.
        vllm_server_timeout (`float`, *optional*, defaults to `240.0`):
            Seconds to wait for the server to be up.
        vllm_gpu_memory_utilization (`float`, *optional*, defaults to `0.3`):
            GPU memory share of a colocated engine (weights, activations, KV cache).
        vllm_max_model_length (`int`, *optional*):
            Context length of a colocated engine (prompt and completion); defaults to the model's.
        vllm_tensor_parallel_size (`int`, *optional*, defaults to `1`):
            Tensor parallelism of a colocated engine.
        vllm_enable_sleep_mode (`bool`, *optional*, defaults to `False`):
            Let a colocated engine release its memory while the model trains.
        vllm_model_impl (`str`, *optional*, defaults to `"vllm"`):
            vLLM's model implementation: `"vllm"` or `"transformers"`.
        vllm_enforce_eager (`bool`, *optional*):
            vLLM's `enforce_eager` for a colocated engine (a server takes `--enforce-eager`): run the model without
            compiling it. Defaults to `True` on CPU, where vLLM's compilation holds up the first token for about a
            minute, and to vLLM's own default (compiled) on GPUs.
        behavior_logps_source (`str`, *optional*, defaults to `"trainer"`):
            Where the behavior log-probs mu of sampled completions come from. `"trainer"`: recomputed by the
            trainer's forward, exactly consistent with pi (one forward pass); the sampler's own log-probs, when it
            returns any, are compared with them (logged as `behavior_logps_mismatch_*`). `"sampler"`: vLLM's raw
            log-probs (free, the distribution actually sampled, but computed by other kernels, in the engine's
            precision). See `docs/sampling.md`.
        max_tool_calling_iterations (`int`, *optional*):
            TRL GRPO's option, for sampling with `tools` ([`~trl_topr.sample_completions`], the loop): the most
            tool-calling turns of a trajectory. `None`: no limit; a trajectory ends when the policy answers without
            calling a tool, or when its length reaches `max_new_tokens`.
    """

    use_vllm: bool = _like_grpo("use_vllm")
    vllm_mode: str = _like_grpo("vllm_mode")
    vllm_server_base_url: str | None = _like_grpo("vllm_server_base_url")
    vllm_server_host: str = _like_grpo("vllm_server_host")
    vllm_server_port: int = _like_grpo("vllm_server_port")
    vllm_server_timeout: float = _like_grpo("vllm_server_timeout")
    vllm_gpu_memory_utilization: float = _like_grpo("vllm_gpu_memory_utilization")
    vllm_max_model_length: int | None = _like_grpo("vllm_max_model_length")
    vllm_tensor_parallel_size: int = _like_grpo("vllm_tensor_parallel_size")
    vllm_enable_sleep_mode: bool = _like_grpo("vllm_enable_sleep_mode")
    vllm_model_impl: str = _like_grpo("vllm_model_impl")
    vllm_enforce_eager: bool | None = field(
        default=None,
        metadata={
            "help": "vLLM's `enforce_eager` for a colocated engine: no compilation. Defaults to True on CPU "
            "(compiling holds up the first token for a minute or more), vLLM's default on GPUs."
        },
    )
    behavior_logps_source: str = field(
        default="trainer",
        metadata={
            "help": "Behavior log-probs of sampled completions: 'trainer' (recomputed by the trainer's forward, "
            "consistent with pi) or 'sampler' (vLLM's raw log-probs, free).",
            "choices": BEHAVIOR_LOGPS_SOURCES,
        },
    )

    max_tool_calling_iterations: int | None = _like_grpo("max_tool_calling_iterations")

    def check_vllm_arguments(self) -> None:
        """Raise a `ValueError` naming the field when a vLLM option has an unknown value."""
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"`vllm_mode` must be 'colocate' or 'server', got {self.vllm_mode!r}.")
        if self.behavior_logps_source not in BEHAVIOR_LOGPS_SOURCES:
            raise ValueError(
                f"`behavior_logps_source` must be one of {BEHAVIOR_LOGPS_SOURCES}, got {self.behavior_logps_source!r}."
            )
        if self.behavior_logps_source == "sampler" and not self.use_vllm:
            raise ValueError("`behavior_logps_source='sampler'` takes vLLM's log-probs: set `use_vllm=True` too.")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(f"`max_tool_calling_iterations` must be >= 0, got {self.max_tool_calling_iterations}.")


def engine_name(args) -> str:
    """
    The name of the generation engine a configuration asks for, a key of [`~trl_topr.generation.ENGINES`]:
    `"vllm"` with `use_vllm`, else `"transformers"`.

    Args:
        args ([`VLLMArguments`], *optional*):
            The configuration (any object with a `use_vllm` attribute); `None` asks for transformers.

    Returns:
        `str`: the engine's name.
    """
    return "vllm" if getattr(args, "use_vllm", False) else "transformers"
