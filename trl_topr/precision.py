"""Precision chosen from the hardware: bf16 where it runs faster than float32 on the training device, float32
elsewhere.

TRL's configurations turn bf16 mixed precision on by default. That is right on recent GPUs and wrong on many CPUs,
where bf16 matmuls are emulated and run many times slower than float32. CPU flags do not settle it: on CPUs with
AVX512-BF16 and no AMX, bf16 has run faster than float32 on one and slower on another (`benchmarks/results/precision*`
and docs/benchmarks-cost.md). So on a CPU the choice is measured: a
short matmul probe ([`measure_cpu_bf16_speedup`], about a second), run once per CPU model and torch version and cached
([`cpu_bf16_speedup`]). Every place of this library that trains, samples or evaluates a model follows
[`bf16_is_faster`] when the user has not chosen a precision; `python benchmarks/precision.py` measures both precisions
at length and prints what the rule picks.

The trainers also train with denormal floats flushed to zero on a CPU ([`denormals_flushed`]): a negative whose weight
has tapered to nearly 0 fills the backward pass with them, and x86 CPUs compute on them many times slower.
"""

import contextlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch


logger = logging.getLogger(__name__)
_warned = set()
_speedups: dict[str, float] = {}  # this process's cache of the probe, by CPU
# bf16 is chosen on a CPU where its matmuls run at least this many times float32's. Where bf16 is native its matmuls
# ran about twice float32's or more, where it is emulated well below 1 (`benchmarks/results/precision*`): the margin
# keeps the probe's noise on a busy machine from choosing a precision that is no faster.
BF16_SPEEDUP_NEEDED = 1.25
SPEEDUP_CACHE_FILE = "cpu_bf16_speedup.json"


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


def _best_seconds(dtype: torch.dtype, size: int, calls: int) -> float:
    # The fastest of `calls` products of two `size` x `size` matrices, after one untimed product
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = math.inf
    for _ in range(calls):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu_bf16_speedup() -> float:
    """
    How many times faster bf16 matmuls run than float32 ones on this CPU, with torch's current kernels and threads.

    A quick look at 256 x 256 products first: emulated bf16 (tens of times slower) is told at once. Otherwise 1024 x
    1024 products of the two precisions alternate, and the fastest of each is compared, which another process's load
    disturbs least. Takes about a second.

    Returns:
        `float`: bf16 matmul throughput over float32's (above 1: bf16 is faster).
    """
    quick = _best_seconds(torch.float32, 256, 3) / _best_seconds(torch.bfloat16, 256, 3)
    if quick < 0.25:
        return quick
    fp32 = bf16 = math.inf
    for _ in range(5):
        fp32, bf16 = (
            min(fp32, _best_seconds(torch.float32, 1024, 1)),
            min(bf16, _best_seconds(torch.bfloat16, 1024, 1)),
        )
        if bf16 > 4 * fp32:  # slow beyond doubt: no need for more products
            break
    return fp32 / bf16


def cpu_name() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux, the platform's processor elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _speedup_key() -> str:
    # What decides the probe's result: the CPU, torch, and the kernels torch and oneDNN are allowed to use
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    return (
        f"{cpu_name()} | torch {torch.__version__} | {torch.backends.cpu.get_cpu_capability()} | oneDNN {isa or 'any'}"
    )


def speedup_cache_path() -> Path:
    """Where [`cpu_bf16_speedup`] keeps its measurements: `$XDG_CACHE_HOME/trl_topr` (`~/.cache/trl_topr`)."""
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "trl_topr" / SPEEDUP_CACHE_FILE


def cpu_bf16_speedup() -> float:
    """
    [`measure_cpu_bf16_speedup`] for this CPU, measured once per CPU model, torch version and kernel set, and cached
    on disk ([`speedup_cache_path`]). The processes of one machine (`accelerate launch`) take turns on the cache file,
    so one measures and all read the same value, and so choose the same precision; where the cache cannot be used,
    several processes take 1.0 (float32) rather than each measure its own.

    Returns:
        `float`: bf16 matmul throughput over float32's on this CPU.
    """
    from filelock import FileLock

    key = _speedup_key()
    if key in _speedups:
        return _speedups[key]
    path = speedup_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{path}.lock"):
            try:
                cached = json.loads(path.read_text())
            except (OSError, ValueError):  # none yet, or unreadable: measured again
                cached = {}
            if key not in cached:
                cached[key] = measure_cpu_bf16_speedup()
                partial = path.with_suffix(f".partial-{os.getpid()}")
                partial.write_text(json.dumps(cached, indent=1))
                os.replace(partial, path)
        _speedups[key] = cached[key]
    except OSError as error:  # a read-only home: measured by this process, for this process
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would measure, and may choose, on its own
            logger.warning(f"Could not use {path} ({error}): float32, as every process of this run chooses alike.")
            _speedups[key] = 1.0
        else:
            logger.warning(f"Could not use {path} ({error}): measuring bf16 against float32 in this process only.")
            _speedups[key] = measure_cpu_bf16_speedup()
    return _speedups[key]


def bf16_is_faster(device: str | torch.device | None = None) -> bool:
    """
    Whether bf16 runs faster than float32 on a device, so that bf16 mixed precision is worth using there.

    - CUDA: GPUs with bf16 units (Ampere and newer); emulated bf16 does not count.
    - CPU: measured, [`cpu_bf16_speedup`] at least `BF16_SPEEDUP_NEEDED` (1.25).
    - Other accelerators: assumed, as TRL's default.

    Args:
        device (`str` or `torch.device`, *optional*):
            The device or its type. Defaults to the one a trainer would use (see [`device_type`]).

    Returns:
        `bool`: `True` where bf16 is faster.

    Example:
    ```python
    >>> from trl_topr.precision import bf16_is_faster

    >>> bf16_is_faster("cpu") in (True, False)  # measured once on this CPU, then cached
    True

    ```
    """
    kind = torch.device(device).type if device is not None else device_type()
    if kind == "cpu":
        return cpu_bf16_speedup() >= BF16_SPEEDUP_NEEDED
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return True


def precision_reason(device: str) -> str:
    """
    Why [`bf16_is_faster`] decides as it does on a device type: what a run prints with its choice.

    Args:
        device (`str`):
            The device type (`"cpu"`, `"cuda"`, ...).

    Returns:
        `str`: the reason, in words.
    """
    if device == "cpu":
        speedup, path = cpu_bf16_speedup(), speedup_cache_path()
        shown = f"~/{path.relative_to(Path.home())}" if path.is_relative_to(Path.home()) else str(path)
        kept = f"measured once, cached in {shown}" if path.exists() else "measured by this process (no cache)"
        return (
            f"bf16 matmuls ran {speedup:.2f}x float32's on this CPU ({cpu_name()}), bf16 needs "
            f"{BF16_SPEEDUP_NEEDED}x; {kept}"
        )
    if device == "cuda":
        return "the GPU has bf16 units" if bf16_is_faster("cuda") else "the GPU has no bf16 units"
    return f"bf16 assumed on {device}, as in TRL"


def resolve_bf16(bf16: bool | None, fp16: bool = False, use_cpu: bool = False) -> bool:
    """
    The `bf16` setting to train with: the user's choice when given, else bf16 where it runs faster on the training
    device (see [`bf16_is_faster`]) and fp16 is not asked for. The choice the rule makes is logged once per process
    with its reason; an explicit `bf16=True` on a CPU where bf16 is slower is respected, with a warning.

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
        chosen = not fp16 and bf16_is_faster(device)
        if not fp16 and ("chosen", device) not in _warned:
            _warned.add(("chosen", device))
            logger.info(
                f"Precision: {'bf16' if chosen else 'float32'} on {device} ({precision_reason(device)}). "
                f"Set `bf16` (`--bf16 true` / `--bf16 false`) to choose."
            )
        return chosen
    if bf16 and device == "cpu" and not bf16_is_faster("cpu") and "cpu" not in _warned:
        _warned.add("cpu")
        logger.warning(
            f"bf16=True on a CPU where bf16 is not clearly faster than float32 ({precision_reason('cpu')}). Pass "
            "`--bf16 false` (`bf16=False`), or leave `bf16` unset and trl-topr picks the faster precision."
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
    where bf16 is faster on the device), else a no-op.

    Args:
        device (`str` or `torch.device`):
            The model's device.
        bf16 (`bool`, *optional*):
            Whether to compute in bf16. Defaults to [`bf16_is_faster`] on the device.

    Returns:
        `torch.autocast`: the context manager.
    """
    kind = torch.device(device).type
    enabled = bf16_is_faster(kind) if bf16 is None else bf16
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


def flushing_denormals() -> bool:
    """Whether the calling thread flushes denormal floats to zero (a float32 of 1e-40 reads back as 0)."""
    return torch.tensor([1e-40]).item() == 0.0


@contextlib.contextmanager
def denormals_flushed(device: str | torch.device):
    """
    On a CPU, denormal floats (float32 below 2**-126, about 1.2e-38) flushed to zero within the block
    ([`torch.set_flush_denormal`]), and as they were after it.

    A negative's weight clip(pi/mu, 0, 1) tapers toward 0 as the policy moves away from it (e^-25 once its log-ratio
    reaches -25), and so do its gradients: where a batch holds no larger ones (negatives alone, positives scarce), the
    backward pass multiplies them by probabilities near 0 and can fill with denormal floats, which x86 CPUs compute on
    through microcode, many times slower. What flushing drops lies far below what an update can resolve. It applies
    to the calling thread, which runs the backward pass on a CPU, and to the threads it starts; GPUs compute on
    denormals at full speed and are left alone.

    Args:
        device (`str` or `torch.device`):
            The device training runs on.
    """
    if torch.device(device).type != "cpu" or flushing_denormals() or not torch.set_flush_denormal(True):
        yield  # not a CPU, flushing already, or a CPU that cannot
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class FlushesDenormals:
    """A trainer's mixin (ahead of the TRL trainer in its bases): `train` runs in [`denormals_flushed`]."""

    def train(self, *args, **kwargs):
        with denormals_flushed(self.args.device):
            return super().train(*args, **kwargs)
