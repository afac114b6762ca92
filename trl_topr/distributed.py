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
import pickle
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


_NO_WEIGHTS = (
    "{which} no weights (parameters on the `meta` device): FSDP's CPU-RAM-efficient loading loads them on the first "
    "process only, until training starts, and trl-topr samples and computes behavior log-probs before that. Set "
    "`fsdp_cpu_ram_efficient_loading: false` in the Accelerate configuration (or the environment variable "
    "FSDP_CPU_RAM_EFFICIENT_LOADING=false)."
)


def check_holds_weights(model: torch.nn.Module) -> None:
    """
    Check that every process holds the weights of `model` (none of its parameters on the `meta` device): where one
    does not, all of them raise. Every process must call it (it gathers).

    Args:
        model (`torch.nn.Module`):
            The model (unwrapped).

    Raises:
        `ValueError`:
            Naming the setting that leaves processes without weights (FSDP's CPU-RAM-efficient loading).
    """
    meta = is_meta_model(model)
    if PartialState().num_processes > 1:  # a collective: every process learns which ones hold no weights
        meta = [i for i, held in enumerate(gather_object([meta])) if held]
    if meta:
        raise ValueError(
            _NO_WEIGHTS.format(which=f"Process(es) {meta} hold" if meta is not True else "The model holds")
        )


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
            loading leaves them on every process but the first until training starts); [`check_holds_weights`]
            raises it on every process.
    """
    if is_meta_model(model):
        raise ValueError(_NO_WEIGHTS.format(which="This process holds"))
    partitioned = _partitioned(model)
    if not partitioned:
        yield model
        return
    hooked = _hooked_by_an_engine(model)
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


def forward_is_collective(model: torch.nn.Module) -> bool:
    """
    Whether a forward of `model`, as its weights are held now, calls collectives: FSDP2's sharded parameters, which
    each forward all-gathers layer by layer, DeepSpeed ZeRO-3's partitioned ones that its hooks gather, or a model a
    ZeRO-3 training engine has hooked (its hook at the start of each forward checks the processes' steps with a
    broadcast, also with the weights gathered). Every process must then run as many forwards, whatever its own data.

    Args:
        model (`torch.nn.Module`):
            The model (unwrapped), e.g. within [`full_weights`].

    Returns:
        `bool`: whether its forward is a collective.
    """
    sharded = any(isinstance(p, DTensor) for p in model.parameters()) or bool(_partitioned(model))
    return sharded or _hooked_by_an_engine(model)


def _hooked_by_an_engine(model: torch.nn.Module) -> bool:
    # DeepSpeed ZeRO-3's engine sets this on every module it hooks
    return any(hasattr(module, "ds_grads_remaining") for module in model.modules())


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
    check_holds_weights(model)
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


class ProcessesDivergedError(RuntimeError):
    """
    The processes of one run reached different steps, where each of them must run the same collectives in the same
    order: the message names each process's step. Raised on every process that sees it, at once, instead of a hang.
    """


class ProcessFailedError(RuntimeError):
    """
    Another process failed at a step every process shares: raised on the processes that did not fail, naming the one
    that did and its error, so that all of them stop there instead of waiting for it in a collective.
    """


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _stop_unless_agreed(reached: dict[int, tuple[str | None, str | None]]) -> None:
    # Each process's (step, error or None) at a point all of them share: the same verdict wherever it is read
    state = PartialState()
    if len({step for step, _ in reached.values()}) > 1:
        named = "; ".join(f"process {i} at {step!r}" for i, (step, _) in sorted(reached.items()))
        raise ProcessesDivergedError(
            f"The processes are at different steps ({named}): every process must run the same collectives in the "
            "same order. This is a bug (a decision made by each process on its own): please report it."
        )
    failed = [(i, step, error) for i, (step, error) in sorted(reached.items()) if error is not None]
    if failed:
        i, step, error = failed[0]
        raise ProcessFailedError(
            f"Process {i} of {state.num_processes} failed at {step!r} ({error}): process {state.process_index} "
            "stops with it."
        )


def agree(step: str, error: BaseException | None = None) -> None:
    """
    A point every process reaches at the same `step`: each process waits for the others there (a barrier), then all
    of them raise [`ProcessesDivergedError`] if they reached different steps, and all of them stop if any failed just
    before it (`error`: that process raises it, the others [`ProcessFailedError`]). One process: raises `error`, if
    any.

    Args:
        step (`str`):
            What every process is about to do, or has just done (e.g. `"round 2: start"`).
        error (`BaseException`, *optional*):
            What this process raised on its way here, to stop every process with it.

    Raises:
        [`ProcessesDivergedError`], [`ProcessFailedError`], or `error`.
    """
    state = PartialState()
    if state.num_processes == 1:
        if error is not None:
            raise error
        return
    reached = dict(enumerate(gather_object([(step, None if error is None else _describe(error))])))
    if error is not None and len({s for s, _ in reached.values()}) == 1:
        raise error
    try:
        _stop_unless_agreed(reached)
    except ProcessesDivergedError as diverged:
        raise diverged from error


@contextlib.contextmanager
def together(step: str):
    """
    Context for work that every process does on its own at `step` (reading or writing a file, a callback), and after
    which all of them go on together, or all of them stop: it ends with [`agree`], so an exception raised in the
    block on one process is raised on every process (as [`ProcessFailedError`] on the others) instead of leaving them
    waiting in their next collective. The block must not itself call a collective.

    Args:
        step (`str`):
            The step's name, shown in errors.

    Example:
    ```python
    >>> from trl_topr.distributed import together

    >>> with together("writing the samples"):
    ...     pass  # e.g. on the main process only: write a file that every process reads after the block

    ```
    """
    error = None
    try:
        yield
    except Exception as caught:
        error = caught
    agree(step, error)


@contextlib.contextmanager
def naming_the_step(where: Callable[[], str]):
    """
    Context in which an exception, under several processes, gains a note naming this process and the step it was at
    (`where()`, read when it is raised): where a collective times out (after the process group's timeout,
    `ddp_timeout`), the processes' errors together say where each one was.

    Args:
        where (`Callable[[], str]`):
            Gives the current step, e.g. `lambda: f"training step {trainer.state.global_step + 1}"`.
    """
    try:
        yield
    except Exception as error:
        state = PartialState()
        if state.num_processes > 1:
            error.add_note(
                f"trl-topr: process {state.process_index} of {state.num_processes} stopped at {where()!r}. A "
                "collective that timed out (after `ddp_timeout` seconds) means another process did not reach it: "
                "its own error or log says where it was."
            )
        raise


class NamesTheStep:
    """
    A trainer's mixin (ahead of the TRL trainer in its bases): an exception raised in `train` under several processes
    names the training step this process was at ([`naming_the_step`]).
    """

    def train(self, *args, **kwargs):
        def where() -> str:
            return f"training step {self.state.global_step + 1} of {self.state.max_steps}"

        with naming_the_step(where):
            return super().train(*args, **kwargs)


def map_across_processes(items: Sequence, work: Callable[[list, int], list]) -> list:
    """
    Run `work` over `items` split across the processes (`accelerate launch`), and give every process all the results,
    in the order of `items`: the one place where trl-topr splits work (generation, behavior log-probs) between
    processes.

    Each process gets an equal contiguous share, the last shares padded with copies of the last item (their results
    are dropped after gathering): under FSDP2 and ZeRO-3 every forward is a collective, so every process must run as
    many batches. (accelerate's `split_between_processes` with `apply_padding` pads each short share in place, which
    leaves the copies mid-list after gathering, and fails for a process that gets no item at all.) Where `work` raises
    on one process, every process raises (the others [`ProcessFailedError`]) once the results are gathered.

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
    results, error = [], None
    try:
        results = list(work(padded[first : first + size], first))
        if len(results) != size:
            raise ValueError(f"`work` returned {len(results)} results for {size} items.")
    except Exception as caught:
        error = caught
    gathered = gather_object([(None if error is None else _describe(error), results)])
    if error is not None:
        raise error
    _stop_unless_agreed({i: ("work split across the processes", e) for i, (e, _) in enumerate(gathered)})
    return [result for _, share in gathered for result in share][: len(items)]


def on_main_process(work: Callable[[], Any], step: str | None = None) -> Any:
    """
    Run `work` once, on the main process, and give every process its result: for what must happen once whatever the
    number of processes (a tool call, an environment's step, writing a file), so that every process goes on from the
    same outcome. The other processes wait for it; where `work` raises, it raises on the main process and
    [`ProcessFailedError`] on the others, instead of leaving them waiting.

    Args:
        work (`Callable[[], Any]`):
            Called with no argument on the main process only; its result must be picklable.
        step (`str`, *optional*):
            The step's name, shown in errors; where given, every process must be at the same step, or all but the
            main one raise [`ProcessesDivergedError`].

    Returns:
        `Any`: the result, the same on every process.

    Example:
    ```python
    >>> from trl_topr.distributed import on_main_process

    >>> on_main_process(lambda: [1, 2])
    [1, 2]

    ```
    """
    state = PartialState()
    if state.num_processes == 1:
        return work()
    outcome, result = [None], None
    if state.is_main_process:
        try:
            result = work()
            outcome = [(step, None, pickle.dumps(result))]  # pickled here: a failure to is the work's, and shared
        except Exception as error:
            broadcast_object_list([(step, _describe(error), None)], from_process=0)
            raise
    broadcast_object_list(outcome, from_process=0)
    main_step, error, data = outcome[0]
    if state.is_main_process:
        return result
    _stop_unless_agreed({0: (main_step, error), state.process_index: (step, None)})
    return pickle.loads(data)


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
