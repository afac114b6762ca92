"""Precision chosen from the hardware: bf16 where the device computes it natively, float32 elsewhere.

TRL's configurations turn bf16 mixed precision on by default. That is right on recent GPUs and on CPUs with AMX, and
wrong on the many CPUs without native bf16 units, where bf16 matmuls are emulated and run many times slower than
float32. Between the two, CPUs with AVX512-BF16 but no AMX differ: `python benchmarks/precision.py` times both
precisions on a machine and prints what the rule picks there (docs/benchmarks.md gives the machines measured). Every
place of this library that trains, samples or evaluates a model follows [`has_native_bf16`] when the user has not
chosen a precision.
"""

import logging

import torch


logger = logging.getLogger(__name__)
_warned = set()


def device_type(use_cpu: bool = False) -> str:
    """
    The type of the device a trainer runs on: `"cpu"` with `use_cpu` or without an accelerator, else the accelerator's
    (`"cuda"`, `"xpu"`, ...).

    Args:
        use_cpu (`bool`, *optional*, defaults to `False`):
            The `use_cpu` training argument.

    Returns:
        `str`: the device type.
    """
    if use_cpu or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type


def has_native_bf16(device: str | torch.device | None = None) -> bool:
    """
    Whether a device computes bf16 natively, so that bf16 runs faster than float32 there.

    - CUDA: GPUs with bf16 units (Ampere and newer); emulated bf16 does not count.
    - CPU: AMX tiles. AVX512-BF16 alone does not count: how fast bf16 runs with it differs between CPUs
      (`python benchmarks/precision.py` measures it on a machine).
    - Other accelerators: assumed, as TRL's default.

    Args:
        device (`str` or `torch.device`, *optional*):
            The device or its type. Defaults to the one a trainer would use (see [`device_type`]).

    Returns:
        `bool`: `True` where bf16 is native.

    Example:
    ```python
    >>> from trl_topr.precision import has_native_bf16

    >>> has_native_bf16("cpu") in (True, False)  # AMX CPUs: True; AVX2, AVX512, AVX512-BF16: False
    True

    ```
    """
    kind = torch.device(device).type if device is not None else device_type()
    if kind == "cpu":
        return torch.cpu._is_amx_tile_supported()
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return True


def resolve_bf16(bf16: bool | None, fp16: bool = False, use_cpu: bool = False) -> bool:
    """
    The `bf16` setting to train with: the user's choice when given, else bf16 where the training device has it
    natively (see [`has_native_bf16`]) and fp16 is not asked for. An explicit `bf16=True` on a CPU without native bf16
    is respected, with a warning.

    Args:
        bf16 (`bool`, *optional*):
            The user's choice; `None` when not set.
        fp16 (`bool`, *optional*, defaults to `False`):
            Whether fp16 mixed precision is asked for.
        use_cpu (`bool`, *optional*, defaults to `False`):
            Whether training runs on the CPU although an accelerator is present.

    Returns:
        `bool`: whether to train in bf16 mixed precision.
    """
    device = device_type(use_cpu)
    if bf16 is None:
        return not fp16 and has_native_bf16(device)
    if bf16 and device == "cpu" and not has_native_bf16("cpu") and "cpu" not in _warned:
        _warned.add("cpu")
        logger.warning(
            "bf16=True on a CPU without AMX: bf16 can run slower than float32 there (emulated, or AVX512-BF16 "
            "alone; `python benchmarks/precision.py` measures both on this machine). Pass `--bf16 false` "
            "(`bf16=False`), or leave `bf16` unset and trl-topr picks its precision for this machine."
        )
    return bf16


def apply_precision_defaults(args) -> None:
    """
    Set the precision of a TRL training configuration from the hardware, in place, before `TrainingArguments`
    validates it: `bf16` as [`resolve_bf16`] decides and, on a machine without an accelerator, `use_cpu=True` (which
    transformers requires for bf16 on a CPU, and which changes nothing else there).

    Args:
        args ([`~trl.SFTConfig`] or [`~trl.GRPOConfig`]):
            A configuration whose `__post_init__` has not run yet (`bf16` may still be `None`).
    """
    if not torch.accelerator.is_available():
        args.use_cpu = True
    args.bf16 = resolve_bf16(args.bf16, args.fp16, args.use_cpu)


def autocast(device: str | torch.device, bf16: bool | None = None):
    """
    The autocast context that inference (sampling, evaluation) runs under: bf16 where `bf16` says so (by default
    where the device has native bf16), else a no-op.

    Args:
        device (`str` or `torch.device`):
            The model's device.
        bf16 (`bool`, *optional*):
            Whether to compute in bf16. Defaults to [`has_native_bf16`] of the device.

    Returns:
        `torch.autocast`: the context manager.
    """
    kind = torch.device(device).type
    enabled = has_native_bf16(kind) if bf16 is None else bf16
    return torch.autocast(device_type=kind, dtype=torch.bfloat16, enabled=enabled)


def training_autocast(args, device: str | torch.device):
    """
    The mixed precision context that a trainer built with `args` computes its forward in (what its
    `accelerator.autocast()` gives): bf16 or fp16 autocast under `args.bf16` / `args.fp16`, else a no-op. The
    behavior log-probs of fresh samples are computed in it, so that training on them starts at a ratio of 1.

    Args:
        args ([`~transformers.TrainingArguments`]):
            The training configuration.
        device (`str` or `torch.device`):
            The model's device.

    Returns:
        `torch.autocast`: the context manager.
    """
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype, enabled=bool(args.bf16 or args.fp16))
