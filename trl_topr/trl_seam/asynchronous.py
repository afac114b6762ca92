"""What the seam takes from TRL's asynchronous trainer (experimental in TRL 1.16: imported only where it is used)."""

import contextlib
import sys
import time

import torch

# TRL 1.16 keeps its asynchronous trainer in `trl.experimental.async_grpo` (the only TRL pyproject.toml allows)
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, RolloutSample  # noqa: F401

# the name TRL registers its tree attention under
from trl.experimental.async_grpo.packing import TREE_ATTENTION  # noqa: F401


# TRL's default `max_staleness`, with which it sizes the number of generations in flight
TRL_MAX_STALENESS = AsyncGRPOConfig.__dataclass_fields__["max_staleness"].default
GRPO_STD_EPSILON = 1e-8  # TRL's worker: a sample's advantage is (R - mean) / (std + 1e-8) over its prompt's samples


@contextlib.contextmanager
def peak_flops_guarded(args):
    # TRL 1.16's trainer asks `torch.cuda.get_device_name` for the peak FLOPs of the training device while it is built,
    # which raises off CUDA. Off CUDA, and there only, its probe answers "unknown" (MFU is then not logged) for the
    # construction alone; TRL's own function is put back after. (TRL's main guards the probe itself.)
    module = sys.modules[AsyncGRPOTrainer.__module__]
    if args.use_cpu or not torch.cuda.is_available():
        original = module.get_peak_flops_per_device
        module.get_peak_flops_per_device = lambda accelerator, dtype: None
        try:
            yield
        finally:
            module.get_peak_flops_per_device = original
    else:
        yield


class GuardedRolloutWorker(AsyncRolloutWorker):
    # TRL's rollout worker (its process), that tells when its process has died and stops also when it died or hangs.
    # TRL's `stop` sets a multiprocessing Event on which the process's stop-watcher thread waits, and `Event.set` waits
    # for every waiter to wake: a process that was killed (out of memory, say) or hangs never does, and the trainer
    # would wait forever as it stops (TRL 1.16). Such a process is killed, and the event its waiter held replaced,
    # before TRL's `stop`. The trainer gives its worker this class once TRL has built it (a subclass: TRL's checks of
    # `isinstance(worker, AsyncRolloutWorker)`, for checkpoints and resuming, still hold).
    HUNG_AFTER_S = 10.0  # a running worker beats its heartbeat every 0.1 s

    def check_health(self, stale_after_s: float) -> None:
        process = self._process
        if process is not None and process._popen is not None and not process.is_alive():
            code = process.exitcode
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise RuntimeError(f"The rollout worker's process exited ({how}): it produces no more samples.")
        super().check_health(stale_after_s)

    def stop(self) -> None:
        process = self._process
        if process is not None and process._popen is not None:
            hung = time.time() - self._heartbeat_value.value > self.HUNG_AFTER_S
            if not process.is_alive() or hung:
                process.kill()
                process.join(5)
                self._stop_event_mp = self._mp_ctx.Event()
        super().stop()


def train_metrics(trainer) -> dict:
    """
    TRL's asynchronous trainer's sink of training metrics (`_metrics["train"]`: name -> values, a `(sum, count)` pair
    reduced as a rate), which it logs and clears at each logging step.

    Args:
        trainer: A `TOPRAsyncGRPOTrainer`.
    """
    return trainer._metrics["train"]


def count_micro_batch(trainer, inputs: dict, forward_seconds: float) -> None:
    """
    Add a trained micro-batch to TRL's per-step accounting (tokens forwarded and trained, samples, forward time), as
    TRL's own `compute_loss` does: what its throughput and MFU metrics are computed from at the step's end.

    Args:
        trainer: A `TOPRAsyncGRPOTrainer`.
        inputs (`dict`): The micro-batch, as TRL's collator made it.
        forward_seconds (`float`): The seconds its forward took.
    """
    forwarded, mean_length = float(inputs["global_n_forward_tokens"][0]), float(inputs["mean_seq_len"][0])
    trainer._step_forward_tokens += forwarded
    trainer._step_trained_tokens += float(inputs["global_n_tokens"][0])
    trainer._step_seq_len_weighted += mean_length * forwarded
    trainer._step_samples += forwarded / mean_length
    trainer._step_forward_s += forward_seconds


def trl_inflight_tasks(args, max_staleness: int) -> int:
    """
    The generation tasks TRL's trainer keeps in flight when `max_inflight_tasks` is left to it (-1), for a given
    `max_staleness`: `max(max_staleness, 1)` optimizer steps of samples, of every process. With every sample kept (a
    bound TRL would multiply to billions) the configuration sizes them with TRL's default bound instead.

    Args:
        args: The configuration (`per_device_train_batch_size`, `gradient_accumulation_steps`, `world_size`).
        max_staleness (`int`): The bound to size them with.
    """
    samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    return max(max_staleness, 1) * samples_per_step


def is_adapter_slots_error(error: Exception) -> bool:
    """
    Whether `error` is TRL's refusal to sync a PEFT adapter to a vLLM server over HTTP because the server cannot hold
    the adapter of every version a sample may still come from (`max_staleness` + 2 at most `--max-loras`): TRL raises
    it as a plain `ValueError`, told apart by its text.

    Args:
        error (`Exception`): An error raised while TRL's trainer was built.
    """
    return isinstance(error, ValueError) and "max_staleness" in str(error) and "--max-loras" in str(error)
