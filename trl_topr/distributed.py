"""Whole weights under sharded training engines (DeepSpeed ZeRO-3, FSDP2), for inference and for hashing.

Training engines shard the parameters, and a forward outside the engine's own (sampling, evaluation, the behavior
log-prob precompute) needs them whole. One rule for all of them:

- DeepSpeed ZeRO-3: the parameters are gathered for the duration ([`deepspeed.zero.GatheredParameters`]); when an
  engine holds the model, its fetch hooks are removed meanwhile, as TRL's `unwrap_model_for_generation` does. Every
  process then holds the whole model, and a forward calls no collective.
- FSDP2: nothing to gather; the forward all-gathers layer by layer, so the processes must run the same number of
  forwards (callers split work evenly, and `generate` synchronizes the processes' steps).
- DDP, one process: nothing to do.

A trainer that is done lets go of its model, optimizer and training engine with [`release_trainer`] (what the engines
keep outside the trainer would otherwise outlive it), and [`give_back_freed_memory`] then returns what the process
freed to the system.
"""

import contextlib
import ctypes
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
from torch.distributed.tensor import DTensor


def _partitioned(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    # ZeRO-3 parameters not gathered right now (`ds_status` is set by `deepspeed.zero.Init` and the engine)
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return []
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in model.parameters() if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def is_meta_model(model: torch.nn.Module) -> bool:
    """
    Whether any of the model's parameters is on the meta device (under FSDP's CPU-RAM-efficient loading, every process
    but the first holds its weights there until the engine shards them).

    Args:
        model ([`~torch.nn.Module`]):
            The model.

    Returns:
        `bool`: whether it holds a parameter without data.
    """
    return any(p.device.type == "meta" for p in model.parameters())


@contextlib.contextmanager
def full_weights(model: torch.nn.Module, engine=None):
    """
    Context in which every process holds the whole weights of `model` for inference outside the training engine's
    forward (see the module's docstring).

    Args:
        model (`torch.nn.Module`):
            The model (unwrapped: the module itself, not a DeepSpeed engine or DDP wrapper).
        engine (`deepspeed.DeepSpeedEngine`, *optional*):
            The DeepSpeed engine that wraps `model` once training has started (a trainer's `deepspeed`): its ZeRO-3
            hooks are removed while the weights are gathered. Without it, a model that an engine holds is left to its
            hooks, which gather layer by layer.

    Yields:
        `torch.nn.Module`: `model`.

    Raises:
        `ValueError`:
            When this process holds no weights at all (parameters on the `meta` device, as FSDP's CPU-RAM-efficient
            loading leaves them on every process but the first until training starts).
    """
    if is_meta_model(model):
        raise ValueError(
            "This process holds no weights (its parameters are on the `meta` device): FSDP's CPU-RAM-efficient "
            "loading loads them on the first process only, until training starts, and trl-topr samples and computes "
            "behavior log-probs before that. Set `fsdp_cpu_ram_efficient_loading: false` in the Accelerate "
            "configuration (or the environment variable FSDP_CPU_RAM_EFFICIENT_LOADING=false)."
        )
    partitioned = _partitioned(model)
    if not partitioned:
        yield model
        return
    hooked = any(hasattr(module, "ds_grads_remaining") for module in model.modules())  # registered by an engine
    if hooked and engine is None:
        yield model  # the engine's hooks gather each layer's weights in its forward
        return
    import deepspeed
    from trl.models.utils import add_hooks, remove_hooks

    with deepspeed.zero.GatheredParameters(partitioned):
        if hooked:
            remove_hooks(engine)
        try:
            yield model
        finally:
            if hooked:
                add_hooks(engine)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """
    A hash of the whole weights of `model` (parameters and buffers, with their names and dtypes), the same under one
    process, DDP, DeepSpeed ZeRO-3 and FSDP2: partitioned ZeRO-3 parameters are gathered one at a time and FSDP2's
    sharded `DTensor`s read whole. Every process must call it (it gathers).

    Args:
        model (`torch.nn.Module`):
            The model (unwrapped).

    Returns:
        `str`: the hex digest.
    """
    partitioned = {id(p) for p in _partitioned(model)}
    digest = hashlib.sha256()
    tensors = sorted([*model.named_parameters(), *model.named_buffers()], key=lambda item: item[0])
    for name, tensor in tensors:
        if id(tensor) in partitioned:
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor]):
                data = tensor.detach().cpu().clone()
        elif isinstance(tensor, DTensor):
            data = tensor.full_tensor().detach().cpu()
        else:  # a copy: `.numpy()` pins a tensor's storage, which FSDP2 resizes to free unsharded parameters
            data = tensor.detach().to("cpu", copy=True)
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.float().numpy().tobytes() if data.dtype.itemsize < 4 else data.numpy().tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def unsharded_loading():
    """
    Context in which `from_pretrained` loads a whole model on this process alone, also under DeepSpeed ZeRO-3, whose
    `deepspeed.zero.Init` would otherwise partition it at load time, a collective of every process (e.g. merging a
    LoRA adapter on the main process).
    """
    from transformers.integrations.deepspeed import (
        _hf_deepspeed_config_weak_ref,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    config = _hf_deepspeed_config_weak_ref() if _hf_deepspeed_config_weak_ref is not None else None
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            set_hf_deepspeed_config(config)


def check_saves_whole_weights(trainer) -> None:
    """
    Check that `trainer.save_model` writes whole weights that `from_pretrained` loads, as the iterative loop needs
    each round: under DeepSpeed ZeRO-3 with `stage3_gather_16bit_weights_on_model_save`, under FSDP with a full state
    dict. Otherwise they save shards that only the engine can read.

    Args:
        trainer ([`~transformers.Trainer`]):
            A trainer, before training.

    Raises:
        `ValueError`:
            Naming the setting to change.
    """
    state = trainer.accelerator.state
    if trainer.is_deepspeed_enabled:
        zero = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        if zero.get("stage") == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save", False):
            raise ValueError(
                "Under DeepSpeed ZeRO-3, each round's model is saved and loaded again for the next round, which needs "
                "`stage3_gather_16bit_weights_on_model_save: true` in the DeepSpeed configuration "
                "(`zero3_save_16bit_model: true` in an Accelerate configuration)."
            )
    if trainer.is_fsdp_enabled and "FULL_STATE_DICT" not in str(state.fsdp_plugin.state_dict_type):
        raise ValueError(
            "Under FSDP, each round's model is saved and loaded again for the next round, which needs "
            "`fsdp_state_dict_type: FULL_STATE_DICT` in the Accelerate configuration (found "
            f"{state.fsdp_plugin.state_dict_type})."
        )


def map_across_processes(items: Sequence, work: Callable[[list, int], list]) -> list:
    """
    Run `work` over `items` split across the processes (`accelerate launch`), and give every process all the results,
    in the order of `items`: the one place where trl-topr splits work (generation, behavior log-probs) between
    processes.

    Each process gets an equal contiguous share, the last shares padded with copies of the last item (their results
    are dropped after gathering): under FSDP2 and ZeRO-3 every forward is a collective, so every process must run as
    many batches. (accelerate's `split_between_processes` with `apply_padding` pads each short share in place, which
    leaves the copies mid-list after gathering, and fails for a process that gets no item at all.)

    Args:
        items (`Sequence`):
            The work items (e.g. prompts, or tokenized rows).
        work (`Callable[[list, int], list]`):
            Called on every process as `work(share, first)`, with its share and the index of the share's first item in
            `items`; returns one result per item of the share.

    Returns:
        `list`: one result per item, the same list on every process.

    Example:
    ```python
    >>> from trl_topr.distributed import map_across_processes

    >>> map_across_processes([1, 2, 3], lambda share, first: [x * 10 for x in share])
    [10, 20, 30]

    ```
    """
    state = PartialState()
    items = list(items)
    if state.num_processes == 1:
        return list(work(items, 0))
    padded = items + items[-1:] * (-len(items) % state.num_processes)
    size = len(padded) // state.num_processes
    first = state.process_index * size
    results = list(work(padded[first : first + size], first))
    if len(results) != size:
        raise ValueError(f"`work` returned {len(results)} results for {size} items.")
    return gather_object(results)[: len(items)]


def on_main_process(work: Callable[[], Any]) -> Any:
    """
    Run `work` once, on the main process, and give every process its result: for what must happen once whatever the
    number of processes (a tool call, an environment's step), so that every process goes on from the same outcome.

    Args:
        work (`Callable[[], Any]`):
            Called with no argument on the main process only; its result must be picklable.

    Returns:
        `Any`: the result, the same on every process.

    Example:
    ```python
    >>> from trl_topr.distributed import on_main_process

    >>> on_main_process(lambda: [1, 2])
    [1, 2]

    ```
    """
    state, results = PartialState(), [None]
    if state.is_main_process:
        results = [work()]
    if state.num_processes > 1:
        broadcast_object_list(results, from_process=0)
    return results[0]


def release_trainer(trainer) -> None:
    """
    Let a trainer that is done free its model, optimizer and training engine with itself: drop what accelerate, and
    DeepSpeed ZeRO-3 in its module-level registries, keep of them.

    - [`~accelerate.Accelerator.free_memory`] drops accelerate's references and destroys a DeepSpeed engine, which
      removes its hooks from the parameters (held by torch, where `gc` cannot see the reference cycles they close).
    - DeepSpeed ZeRO-3 never empties two registries that reach the whole engine (model, optimizer states) through the
      model: the stack of modules in forward (`FWD_MODULE_STACK`), which every engine's model joins at its start, and
      the cache of the parameters to release per module and step (a `functools.lru_cache` on a method of
      `PartitionedParameterCoordinator`, keyed by the modules). With activation checkpointing, submodules stay on the
      stack too: torch's checkpoint stops recomputing a layer once it has what backward needs, so their end-of-forward
      hooks, which pop them, never run. Without this, every trainer of a process stays in memory (every round of
      [`~trl_topr.run_topr_loop`]). The model and its submodules leave the stack, and the cache, which only saves
      recomputing a set per module, is emptied (for every engine: call this between trainings).

    Args:
        trainer ([`~transformers.Trainer`]):
            A trainer that will not be used again.
    """
    engine = getattr(trainer, "deepspeed", None) if trainer.is_deepspeed_enabled else None
    trainer.accelerator.free_memory()
    if engine is None:
        return
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack, modules = getattr(parameter_offload, "FWD_MODULE_STACK", []), set(engine.module.modules())
    stack[:] = [module for module in stack if module not in modules]
    coordinator = getattr(partitioned_param_coordinator, "PartitionedParameterCoordinator", object)
    for method in vars(coordinator).values():  # cached methods, some inside DeepSpeed's NVTX wrapper (a closure)
        for function in (method, *(cell.cell_contents for cell in getattr(method, "__closure__", None) or ())):
            if hasattr(function, "cache_clear"):
                function.cache_clear()


def give_back_freed_memory() -> int:
    """
    Return the memory this process has freed to the system: glibc keeps freed memory as a reserve for later
    allocations, and between a loop's rounds (a model, its optimizer states and a round's activations freed) that
    reserve can reach the size of a round's peak and grows from round to round. glibc's `malloc_trim(0)` gives back
    every free page of its heaps; elsewhere (another C library, macOS, Windows) this does nothing.

    Returns:
        `int`: 1 if memory was given back, 0 otherwise (glibc's own answer; 0 also where glibc is not there).
    """
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the symbols the process has loaded: libc's on Linux
    except (OSError, TypeError):  # Windows loads no library by `None`
        return 0
    return int(trim(0)) if trim is not None else 0
