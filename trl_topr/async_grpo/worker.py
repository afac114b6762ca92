"""A rollout worker of TRL's asynchronous trainer in the training process, over a `Sampler`: for CPU runs, tests and
the benchmarks."""

import math
import queue
import time
from collections.abc import Iterator

import numpy as np
import torch
from accelerate import PartialState
from accelerate.logging import get_logger
from datasets import Dataset
from trl.trainer.utils import create_model_from_path

from ..data import BEHAVIOR_LOGPS, COMPLETION_IDS, PROMPT_IDS, REWARD, TOOL_MASK
from ..generation import SamplingSettings
from ..sampling import Sampler
from ..trl_seam.asynchronous import GRPO_STD_EPSILON, RolloutSample


logger = get_logger(__name__)


class _Snapshots:
    # TRL's weight transfer, in the process: each sync's weights, kept on the CPU for the worker, by version
    def __init__(self, worker: "SamplerRolloutWorker"):
        self.worker, self.pending = worker, None

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.pending = {name: tensor.detach().to("cpu", copy=True) for name, tensor in iterator}

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        self.worker.snapshots.clear()


class _OnDemand:
    # The worker's rollout buffer: a queue that, when the trainer finds it empty, has the worker sample more first
    def __init__(self, worker: "SamplerRolloutWorker"):
        self.worker, self.samples = worker, queue.Queue()

    def get(self, block: bool = True, timeout: float | None = None):
        if self.samples.empty():
            for sample in self.worker.rollout():
                self.samples.put(sample)
        return self.samples.get_nowait()

    def get_nowait(self):
        return self.get(block=False)

    def put(self, sample, block: bool = True, timeout: float | None = None) -> None:
        self.samples.put(sample)

    def qsize(self) -> int:
        return self.samples.qsize()

    def empty(self) -> bool:
        return self.samples.empty()


class SamplerRolloutWorker:
    """
    A rollout worker of TRL's asynchronous trainer (TRL's `RolloutWorkerProtocol`) in the training process, over a
    [`~trl_topr.Sampler`]: when the trainer finds the queue empty, it samples the next prompts (never one twice, in
    order) with the policy `lag` versions back (the earliest version while there are fewer), scores them, records
    their behavior log-probs (mu) per token, and fills each sample as TRL's worker does: its reward and its group's
    standard deviation among its metrics, GRPO's (R - mean) / std as its advantage (the trainer trains TOPR's R - c
    from the reward, unless told to train the worker's advantage). Each version's
    weights come through its own weight transfer (`weight_transfer`), which [`TOPRAsyncGRPOTrainer`] uses. One process
    only: it samples where the trainer takes its batches, synchronously, so staleness is set by `lag` alone.

    Args:
        sampler ([`~trl_topr.Sampler`]):
            A sampler with its own copy of the policy (`sampler.model`) and the reward functions; each version's
            weights are loaded into that copy.
        dataset ([`~datasets.Dataset`]):
            The prompts, in the order they are sampled.
        sampling ([`~trl_topr.SamplingSettings`]):
            How to sample (`num_samples` per prompt); the seed of rollout i is `sampling.seed + i`.
        prompts_per_rollout (`int`):
            Prompts sampled together.
        lag (`int`, *optional*, defaults to `0`):
            Versions back.
    """

    def __init__(
        self,
        sampler: Sampler,
        dataset: Dataset,
        sampling: SamplingSettings,
        prompts_per_rollout: int,
        *,
        lag: int = 0,
    ):
        if PartialState().num_processes > 1:
            raise ValueError("A `SamplerRolloutWorker` samples in one process: under several, use TRL's worker.")
        if sampler.model is None or sampler.reward_funcs is None:
            raise ValueError("A `SamplerRolloutWorker` needs a sampler with its own model and reward functions.")
        self.sampler, self.dataset, self.sampling, self.lag = sampler, dataset, sampling, lag
        self.prompts_per_rollout = prompts_per_rollout
        self.rollout_buffer, self.metrics_queue = _OnDemand(self), queue.Queue()
        self.weight_transfer = _Snapshots(self)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.version, self.loaded, self.rollouts, self.next_prompt, self.next_group = 0, None, 0, 0, 0

    @classmethod
    def from_config(
        cls, model: str, processing_class, dataset, reward_funcs, args, tools=None, environment_factory=None
    ):
        """
        The worker a [`TOPRAsyncGRPOConfig`] describes, with its own copy of `model` (loaded as the trainer loads it,
        with the attention of its configuration) and a [`~trl_topr.Sampler`] over it.

        Args:
            model (`str`):
                The policy's id or path.
            processing_class ([`~transformers.PreTrainedTokenizerBase`]):
                The tokenizer.
            dataset ([`~datasets.Dataset`]):
                The prompts.
            reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`):
                The reward functions.
            args ([`TOPRAsyncGRPOConfig`]):
                The configuration: sampling (`num_generations`, `temperature`, `top_p`, `top_k`,
                `max_completion_length`, `seed`), `rollout_lag` and `rollout_prompts`.
            tools (`list[Callable]`, *optional*):
                Tools the policy may call.
            environment_factory (`Callable` or `dict[str, Callable]`, *optional*):
                TRL GRPO's environments.

        Returns:
            [`SamplerRolloutWorker`]: the worker.
        """
        init = dict(args.model_init_kwargs or {}) | {"dtype": args.dtype, "trust_remote_code": args.trust_remote_code}
        policy = create_model_from_path(model, **init)
        sampler = Sampler(
            policy,
            processing_class,
            reward_funcs,
            args=args,
            tools=tools,
            max_tool_calling_iterations=args.max_tool_calling_iterations,
            environment_factory=environment_factory,
            progress=False,
        )
        sampling = SamplingSettings(
            num_samples=args.num_generations,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_completion_length,
            batch_size=args.per_device_eval_batch_size,
            seed=args.seed,
        )
        step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        prompts = args.rollout_prompts or max(1, step // args.num_generations)
        return cls(
            sampler,
            dataset,
            sampling,
            prompts,
            lag=args.rollout_lag,
        )

    def start(self) -> None:
        """TRL's protocol: nothing to start, the worker samples when the trainer asks."""

    def stop(self) -> None:
        """TRL's protocol: nothing to stop."""

    def check_health(self, stale_after_s: float) -> None:
        """TRL's protocol: the worker runs in the trainer's own thread."""

    def update_model_version(self, model_version: int) -> None:
        """
        TRL's protocol: the policy is now at `model_version`; the weights just sent are that version's. Versions more
        than `lag` back are dropped.

        Args:
            model_version (`int`):
                The new version.
        """
        self.version = model_version
        if self.weight_transfer.pending is not None:
            self.snapshots[model_version], self.weight_transfer.pending = self.weight_transfer.pending, None
        for old in [v for v in self.snapshots if v < model_version - self.lag]:
            if len(self.snapshots) > 1:
                del self.snapshots[old]

    def rollout(self) -> list:
        """
        Sample the next prompts with the policy `lag` versions back, and return them as TRL's `RolloutSample`s.

        Returns:
            `list[RolloutSample]`: `num_samples` per prompt, in order.
        """
        version = self._load(self.version - self.lag)
        prompts = self._next_prompts()
        start = time.perf_counter()
        samples = self.sampler.sample(prompts, self.sampling.replace(seed=(self.sampling.seed or 0) + self.rollouts))
        self.rollouts += 1
        per_prompt = len(samples) // len(prompts)  # with environments too: one row per trajectory, prompt-major
        advantages, spreads = grpo_advantages(samples[REWARD], per_prompt)
        self.metrics_queue.put({"rollout/seconds": time.perf_counter() - start, "rollout/version": float(version)})
        out = [
            self._rollout_sample(row, advantage, spread, version, self.next_group + i // per_prompt)
            for i, (row, advantage, spread) in enumerate(zip(samples, advantages, spreads, strict=True))
        ]
        self.next_group += len(prompts)
        return out

    def _load(self, wanted: int) -> int:
        # The snapshot of version `wanted`, or the earliest one kept, in the sampler's model; its version
        version = max((v for v in self.snapshots if v <= wanted), default=min(self.snapshots, default=0))
        if version != self.loaded and version in self.snapshots:
            self.sampler.model.load_state_dict(self.snapshots[version], strict=False)
            self.loaded = version
        return version

    def _next_prompts(self) -> Dataset:
        # The next prompts in order; past the end, the first again (with a warning: a prompt is then sampled twice)
        indices = [(self.next_prompt + i) % len(self.dataset) for i in range(self.prompts_per_rollout)]
        if self.next_prompt + self.prompts_per_rollout > len(self.dataset) and self.next_prompt < len(self.dataset):
            logger.warning("The rollout worker went through every prompt: it starts again from the first.")
        self.next_prompt += self.prompts_per_rollout
        return self.dataset.select(indices)

    def _rollout_sample(self, row: dict, advantage: float, spread: float, version: int, group: int):
        # TRL's sample: the prompt and completion ids in one row, 1 on the policy's completion tokens, mu at the
        # positions of the tokens it scores
        prompt, completion = row[PROMPT_IDS], row[COMPLETION_IDS]
        mask = row.get(TOOL_MASK) or [1] * len(completion)
        old = np.zeros(len(prompt) + len(completion), dtype=np.float32)
        policy_positions = [len(prompt) + i for i, m in enumerate(mask) if m]
        old[policy_positions] = row[BEHAVIOR_LOGPS][: len(policy_positions)]
        return RolloutSample(
            prompt=[],
            completion=[],
            input_ids=np.asarray(prompt + completion, dtype=np.int64),
            completion_mask=np.asarray([0] * len(prompt) + list(mask), dtype=np.int64),
            old_log_probs=old,
            advantage=float(advantage),
            model_version=version,
            group_id=group,
            metrics={"reward": float(row[REWARD]), "reward_std": spread},
            enqueued_at=time.time(),
        )


def grpo_advantages(rewards: list[float], per_prompt: int) -> tuple[list[float], list[float]]:
    """
    What TRL's worker gives each sample: GRPO's advantage (R - mean) / (std + 1e-8) over its prompt's `per_prompt`
    samples, and that standard deviation (NaN rewards left out; their advantage 0).

    Args:
        rewards (`list[float]`):
            The rewards, `per_prompt` a prompt, in order.
        per_prompt (`int`):
            Samples a prompt.

    Returns:
        `tuple[list[float], list[float]]`: the advantages and each sample's group standard deviation.
    """
    advantages, spreads = [], []
    for start in range(0, len(rewards), per_prompt):
        group = np.asarray(rewards[start : start + per_prompt], dtype=float)
        scored = group[~np.isnan(group)]
        mean, std = (scored.mean(), scored.std()) if len(scored) else (math.nan, math.nan)
        advantages += np.where(np.isnan(group), 0.0, (group - mean) / (std + GRPO_STD_EPSILON)).tolist()
        spreads += [float(std)] * len(group)
    return advantages, spreads
