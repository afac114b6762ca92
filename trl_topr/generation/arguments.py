"""
The options of the generation engines, as flat fields that [`~trl_topr.TOPRLoopConfig`] inherits (so the CLI and YAML
flags keep TRL's names): TRL GRPO's vLLM options, and [`engine_name`], which reads from them which engine of
[`~trl_topr.generation.ENGINES`] a configuration asks for.
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


def like_trl(config_class: type, name: str, **metadata):
    """
    A field of a TRL configuration class, as it is there: its default and its help (or `metadata` in their place), so
    that an option trl-topr takes from TRL reads as in TRL, with its name on the command line.

    Args:
        config_class (`type`):
            The TRL configuration class (e.g. [`~trl.GRPOConfig`]).
        name (`str`):
            The field's name.
        **metadata:
            Entries of the field's metadata to replace (e.g. `help`).

    Returns:
        `dataclasses.Field`: the field.
    """
    trl_field = config_class.__dataclass_fields__[name]
    return field(default=trl_field.default, metadata={**trl_field.metadata, **metadata})


@dataclass
class VLLMArguments:
    r"""
    Sampling with vLLM: TRL's GRPO options (same names, defaults and meaning), read by
    [`~trl_topr.generation.generation_engine`] for [`~trl_topr.run_topr_loop`], [`~trl_topr.Sampler.from_config`],
    `recipes/gsm8k.py` and `trl-topr sample` / `eval`.

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
    """

    use_vllm: bool = like_trl(GRPOConfig, "use_vllm")
    vllm_mode: str = like_trl(GRPOConfig, "vllm_mode")
    vllm_server_base_url: str | None = like_trl(GRPOConfig, "vllm_server_base_url")
    vllm_server_host: str = like_trl(GRPOConfig, "vllm_server_host")
    vllm_server_port: int = like_trl(GRPOConfig, "vllm_server_port")
    vllm_server_timeout: float = like_trl(GRPOConfig, "vllm_server_timeout")
    vllm_gpu_memory_utilization: float = like_trl(GRPOConfig, "vllm_gpu_memory_utilization")
    vllm_max_model_length: int | None = like_trl(GRPOConfig, "vllm_max_model_length")
    vllm_tensor_parallel_size: int = like_trl(GRPOConfig, "vllm_tensor_parallel_size")
    vllm_enable_sleep_mode: bool = like_trl(GRPOConfig, "vllm_enable_sleep_mode")
    vllm_model_impl: str = like_trl(GRPOConfig, "vllm_model_impl")
    vllm_enforce_eager: bool | None = field(
        default=None,
        metadata={
            "help": "vLLM's `enforce_eager` for a colocated engine: no compilation. Defaults to True on CPU "
            "(compiling holds up the first token for a minute or more), vLLM's default on GPUs."
        },
    )

    def check_vllm_arguments(self) -> None:
        """Raise a `ValueError` naming the field when a vLLM option has an unknown value."""
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"`vllm_mode` must be 'colocate' or 'server', got {self.vllm_mode!r}.")


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
