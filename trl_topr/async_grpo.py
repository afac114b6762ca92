"""Asynchronous TOPR: TRL's asynchronous GRPO trainer with TOPR's loss, keeping the stale samples that TRL drops.

TRL's `AsyncGRPOTrainer` trains on a queue of samples that a rollout worker fills while the policy moves on: each
sample was drawn by the policy of some earlier version, and TRL drops those older than `max_staleness`. TOPR is made
for exactly those samples: a negative's weight is clip(pi/mu, 0, 1), so it fades as the policy leaves it behind, and a
positive's weight is 1. [`TOPRAsyncGRPOTrainer`] is TRL's trainer with TOPR's loss (from the same definition as the
other trainers: [`~trl_topr.TOPRArguments`], [`~trl_topr.topr_loss`]), and [`TOPRAsyncGRPOConfig`] keeps every sample
by default. [`SamplerRolloutWorker`] is a rollout worker in the training process, over a [`~trl_topr.Sampler`], that
centres each sample's reward with TOPR's baseline and draws from the policy a set number of versions back, so that
staleness is reproducible: for CPU runs, tests and the benchmarks. On GPUs, TRL's own worker samples with a vLLM
server.
"""

import contextlib
import importlib
import math
import queue
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.logging import get_logger
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import AttentionInterface, AutoTokenizer
from trl.trainer.utils import create_model_from_path

from .baseline import topr_baseline
from .config import TOPRArguments
from .data import BEHAVIOR_LOGPS, COMPLETION_IDS, PROMPT_IDS, REWARD, TOOL_MASK
from .distributed import NamesTheStep
from .generation import SamplingSettings
from .loss import METRIC_SUPPORT, ratio_metrics_by, topr_loss
from .sampling import RewardFuncs, Sampler
from .trainer import CardOnSave, TOPRTrainer, latest_complete_checkpoint


try:  # TRL 1.18 and later: stable
    from trl import AsyncGRPOConfig, AsyncGRPOTrainer
except ImportError:  # TRL 1.16: experimental
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

# TRL's modules of the asynchronous trainer, wherever the installed TRL keeps them
_PACKAGE = AsyncGRPOTrainer.__module__.rsplit(".", 1)[0]
_WORKER_MODULE = importlib.import_module(f"{_PACKAGE}.async_rollout_worker")
RolloutSample, AsyncRolloutWorker = _WORKER_MODULE.RolloutSample, _WORKER_MODULE.AsyncRolloutWorker
TREE_ATTENTION = importlib.import_module(f"{_PACKAGE}.packing").TREE_ATTENTION

logger = get_logger(__name__)

# `max_staleness=None` keeps every sample; TRL compares an integer, so it is stored as this one
UNBOUNDED_STALENESS = 2**31 - 1
# TRL's default `max_staleness`, with which it sizes the number of generations in flight
TRL_MAX_STALENESS = AsyncGRPOConfig.__dataclass_fields__["max_staleness"].default
# The batch's key of each packed sample's (policy version that drew it, reward, reward less its group's mean), a
# (samples, 3) tensor per process, padded with NaN
SAMPLES = "topr_samples"
ADVANTAGES, BASELINES = "topr_advantages", "topr_baselines"  # each sample's R - c and c (`get_batch_samples`)


@dataclass
class TOPRAsyncGRPOConfig(TOPRArguments, AsyncGRPOConfig):
    r"""
    Configuration class for the [`TOPRAsyncGRPOTrainer`].

    Extends TRL's `AsyncGRPOConfig` (generation, the rollout queue, weight syncs, the vLLM server) with TOPR's options
    ([`TOPRArguments`]: `loss_type`, the ratio windows and level, `loss_normalization`, `baseline` or
    `target_positive_fraction`), which the loss and [`SamplerRolloutWorker`] read. `epsilon` is only the trust region
    of `loss_type="ppo_clip"`.

    Parameters:
        max_staleness (`int`, *optional*):
            Drop samples drawn more than this many policy versions (weight syncs) ago, as TRL does (its default: 4).
            `None` (the default) keeps every sample: TOPR's taper bounds what a stale negative weighs, and a stale
            positive is still a good answer. Stored as a very large integer, which TRL compares.
        use_worker_advantages (`bool`, *optional*, defaults to `False`):
            Train each sample's `advantage` as the rollout worker filled it (TRL's worker: GRPO's group-normalised
            (R - mean) / std) instead of TOPR's R - c, which the trainer otherwise computes from each sample's reward
            over an optimizer step's samples ([`~trl_topr.topr_advantages`] with `baseline`,
            `target_positive_fraction` or `group_baseline`), whatever the worker.
        in_process_rollouts (`bool`, *optional*, defaults to `False`):
            Sample in the training process with a [`SamplerRolloutWorker`] (transformers' `generate`), instead of
            TRL's worker on a vLLM server (`vllm_server_base_url`): for CPU runs and tests, one process.
        rollout_lag (`int`, *optional*, defaults to `0`):
            [`SamplerRolloutWorker`]: sample from the policy this many versions back (the earliest version while
            there are fewer), so that every sample has this staleness when it is trained.
        rollout_prompts (`int`, *optional*):
            [`SamplerRolloutWorker`]: prompts sampled together (each `num_generations` times); defaults to one
            optimizer step's worth of samples.
    """

    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Drop samples more than this many policy versions old, as TRL does (its default 4). None (the "
            "default): keep every sample, TOPR's taper bounds their weight."
        },
    )
    use_worker_advantages: bool = field(
        default=False,
        metadata={"help": "Train the worker's own advantages (TRL's: GRPO's) instead of TOPR's R - c."},
    )
    in_process_rollouts: bool = field(
        default=False,
        metadata={"help": "Sample in the training process (transformers), not with TRL's worker on a vLLM server."},
    )
    rollout_lag: int = field(
        default=0, metadata={"help": "In-process rollouts: sample from the policy this many versions back."}
    )
    rollout_prompts: int | None = field(
        default=None,
        metadata={"help": "In-process rollouts: prompts sampled together (default: one optimizer step's worth)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.use_worker_advantages and (
            self.baseline is not None or self.target_positive_fraction is not None or self.group_baseline
        ):
            raise ValueError(
                "`use_worker_advantages` trains the worker's advantages as they are: TOPR's baseline options "
                "(`baseline`, `target_positive_fraction`, `group_baseline`) would not be used. Set one or the other."
            )
        if self.rollout_lag < 0:
            raise ValueError(f"`rollout_lag` must be >= 0, got {self.rollout_lag}.")
        if self.max_staleness is None or self.max_staleness >= UNBOUNDED_STALENESS:
            self.max_staleness = UNBOUNDED_STALENESS
            if self.max_inflight_tasks < 0:  # TRL sizes them with `max_staleness`: with TRL's default instead
                samples_per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
                self.max_inflight_tasks = TRL_MAX_STALENESS * samples_per_step * self.world_size
        elif self.max_staleness < 0:
            raise ValueError(f"`max_staleness` must be >= 0 or None, got {self.max_staleness}.")
        if self.in_process_rollouts and self.token_budget is None:
            self.token_budget = 0  # batches of a fixed count of samples: no server to ask for a context length


def tree_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """
    TRL's packed "tree" attention without FlashAttention-3: each segment's queries attend, causally and aligned to
    the end, to the keys of its path from the root (`tree_kv_index`), with PyTorch's scaled dot-product attention, one
    segment at a time. What [`TOPRAsyncGRPOTrainer`] registers under TRL's name where FlashAttention-3 cannot be
    loaded (on CPU; on a GPU without the kernels Hub). Same arguments and result as TRL's.

    Returns:
        `tuple[torch.Tensor, None]`: the attention output, of shape `(1, N, heads, head_dim)`.
    """
    if softcap:
        raise ValueError("The tree attention without FlashAttention-3 does not soft-cap attention logits.")
    q, k, v = query[0], key[0], value[0]  # (heads, N, head_dim)
    if k.shape[0] != q.shape[0]:  # grouped-query attention
        k, v = k.repeat_interleave(q.shape[0] // k.shape[0], 0), v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    outputs, starts_q, starts_k = [], tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(starts_q) - 1):
        queries, path = q[:, starts_q[s] : starts_q[s + 1]], tree_kv_index[starts_k[s] : starts_k[s + 1]]
        keys, values = k.index_select(1, path), v.index_select(1, path)
        rows = torch.arange(queries.shape[1], device=q.device)[:, None] + keys.shape[1] - queries.shape[1]
        columns = torch.arange(keys.shape[1], device=q.device)[None, :]
        mask = columns <= rows
        if sliding_window:
            mask &= columns > rows - sliding_window
        outputs.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling))
    return torch.cat(outputs, 1).transpose(0, 1).unsqueeze(0).contiguous(), None


def flash_attention_3_loads(device: torch.device) -> bool:
    """
    Whether TRL's tree attention can load FlashAttention-3 (CUDA, from the kernels Hub) on `device`.

    Args:
        device (`torch.device`):
            The training device.

    Returns:
        `bool`: `False` off CUDA, and where the kernel cannot be loaded (logged with the reason).
    """
    if device.type != "cuda":
        return False
    try:
        from kernels import get_kernel

        get_kernel("kernels-community/flash-attn3", version=1)
        return True
    except Exception as error:  # no kernels package, no network, no cached kernel, an unsupported GPU
        logger.info(f"FlashAttention-3 could not be loaded ({type(error).__name__}: {error}): tree attention in SDPA.")
        return False


@contextlib.contextmanager
def _peak_flops_guarded(args):
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


class TOPRAsyncGRPOTrainer(NamesTheStep, CardOnSave, AsyncGRPOTrainer):
    r"""
    Asynchronous Tapered Off-Policy REINFORCE: TRL's `AsyncGRPOTrainer` with TOPR's loss, from [Tapered Off-Policy
    REINFORCE: Stable and efficient reinforcement learning for LLMs](https://huggingface.co/papers/2503.14286).

    A rollout worker fills a queue with scored samples while the policy trains; each sample carries the per-token
    log-probs of the policy that drew it (mu) and its advantage, which for TOPR is the centred reward R - c. The loss
    is [`~trl_topr.topr_loss`] on each packed sample as one sequence: the ratio pi/mu at the sequence level (the
    options of [`TOPRArguments`]), weight 1 for positives and clip(pi/mu, 0, 1) for negatives, each sequence's
    log-likelihood divided by its length. Samples far past TRL's `max_staleness` are kept by default, and the
    importance weights are logged by staleness (`staleness_<k>/...`: effective sample size, clamped fraction, mean
    weight of positives and of negatives, ...).

    The worker is TRL's (a vLLM server), an injected one, or with `args.in_process_rollouts` a
    [`SamplerRolloutWorker`] in this process. Whatever the worker, each sample is trained with TOPR's R - c, from the
    reward it carries, over the samples of its optimizer step ([`~TOPRAsyncGRPOTrainer.get_batch_samples`]:
    `baseline`, `target_positive_fraction` or `group_baseline`); `args.use_worker_advantages` trains the worker's own
    `advantage` instead (TRL's: GRPO's group-normalised one).
    Where FlashAttention-3 cannot be loaded, the packed attention runs in PyTorch ([`tree_attention`]).

    Args:
        model (`str`):
            Id or path of the model to train (TRL's asynchronous trainer loads it itself).
        reward_funcs (`Callable`, `list[Callable]` or `dict[str, Callable]`, *optional*):
            Reward functions with TRL GRPO's signature.
        args ([`TOPRAsyncGRPOConfig`], *optional*):
            Configuration; a default one if `None`. A plain `AsyncGRPOConfig` is refused.
        train_dataset ([`~datasets.Dataset`], *optional*):
            Prompts.
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer; loaded from `model` if `None`.
        rollout_worker (`RolloutWorkerProtocol`, *optional*):
            A worker of your own; by default TRL's, or a [`SamplerRolloutWorker`] with `args.in_process_rollouts`.
        weight_transfer (`WeightTransferProtocol`, *optional*):
            How the worker gets each version's weights; by default TRL's, or the [`SamplerRolloutWorker`]'s.
        **kwargs (`Any`):
            TRL's other arguments (`callbacks`, `optimizers`, `peft_config`, `tools`, `environment_factory`).
    """

    _tag_names = ["trl", "topr", "async-grpo"]
    _name = "TOPR-AsyncGRPO"
    _paper = TOPRTrainer._paper

    def __init__(
        self,
        model: str,
        reward_funcs: RewardFuncs | None = None,
        args: TOPRAsyncGRPOConfig | None = None,
        train_dataset: Dataset | None = None,
        processing_class=None,
        *,
        rollout_worker=None,
        weight_transfer=None,
        **kwargs,
    ):
        if args is None:
            args = TOPRAsyncGRPOConfig(f"{model.split('/')[-1]}-TOPR-AsyncGRPO")
        elif not isinstance(args, TOPRAsyncGRPOConfig):
            raise TypeError(f"`args` must be a TOPRAsyncGRPOConfig, got {type(args).__name__}: swap it for it.")
        if rollout_worker is None and args.in_process_rollouts:
            processing_class = processing_class or AutoTokenizer.from_pretrained(model)
            rollout_worker = SamplerRolloutWorker.from_config(
                model,
                processing_class,
                train_dataset,
                reward_funcs,
                args,
                kwargs.get("tools"),
                kwargs.get("environment_factory"),
            )
        if isinstance(rollout_worker, SamplerRolloutWorker) and weight_transfer is None:
            weight_transfer = rollout_worker.weight_transfer
        with _peak_flops_guarded(args):
            try:
                super().__init__(
                    model,
                    reward_funcs,
                    args,
                    train_dataset,
                    processing_class,
                    rollout_worker=rollout_worker,
                    weight_transfer=weight_transfer,
                    **kwargs,
                )
            except ValueError as error:  # TRL's adapter sync over HTTP sizes the server's adapters by the bound
                if args.max_staleness == UNBOUNDED_STALENESS and "max_staleness" in str(error):
                    raise ValueError(
                        "A PEFT adapter synced to a vLLM server over HTTP: TRL keeps loaded on the server the adapter "
                        "of every version a sample may still come from (`max_staleness` + 2 of them, at most the "
                        "server's `--max-loras`), so not every sample can be kept. Set `max_staleness` to at most "
                        "`--max-loras` - 2 (older samples are then dropped), or restart the server without "
                        "`--enable-lora` (the merged weights are sent instead)."
                    ) from error
                raise
        self.tree_attention = "flash_attention_3"  # what packs the samples: TRL's kernel, or PyTorch's SDPA
        loads = flash_attention_3_loads(self.accelerator.device)
        if self.accelerator.num_processes > 1:  # one attention for every process
            loads = all(gather_object([loads]))
        if not loads:  # registered after TRL registers its own
            AttentionInterface.register(TREE_ATTENTION, tree_attention)
            self.tree_attention = "sdpa"
        if type(self.rollout_worker) is AsyncRolloutWorker:  # TRL's, stopped whatever the state of its process
            self.rollout_worker.__class__ = _GuardedRolloutWorker
        if self.rollout_queue is not None:  # each sample's version, past TRL's dataset, for the logs by staleness
            self.rollout_queue = _Stamped(self.rollout_queue)

    def train(self, *args, **kwargs):
        """
        TRL's `train`, where an error raised while the vLLM server does not answer (it stopped, or cannot be reached)
        is raised as one that names the server and the last complete checkpoint to resume from. See
        [`~transformers.Trainer.train`].
        """
        try:
            return super().train(*args, **kwargs)
        except Exception as error:
            self._raise_if_the_server_is_gone(error)
            raise

    def _raise_if_the_server_is_gone(self, error: Exception) -> None:
        # With TRL's worker, on the main process (which talks to the server): an error while the server does not
        # answer its health check is the server's
        if self.args.in_process_rollouts or self.vllm_client is None:
            return
        import requests  # what TRL's client talks to the server with

        url = self.args.vllm_server_base_url
        try:
            requests.get(f"{url}/health", timeout=10).raise_for_status()
            return  # it answers: the error is another one
        except requests.RequestException as unhealthy:
            probe = f"{type(unhealthy).__name__}: {unhealthy}"
        last = latest_complete_checkpoint(self.args.output_dir)
        resume = (
            f"The last complete checkpoint is {last}: start the server again and resume from it "
            "(`trainer.train(resume_from_checkpoint=...)`)."
            if last
            else "No checkpoint was saved yet (`save_strategy`, `save_steps`)."
        )
        raise RuntimeError(
            f"The vLLM server at {url} does not answer (its /health: {probe}): training stopped at step "
            f"{self.state.global_step} with {type(error).__name__}: {error}. {resume}"
        ) from error

    def get_train_dataloader(self):
        # TRL's loader, its batches with each sample's version and reward where the loss sees them
        loader = super().get_train_dataloader()
        base = getattr(loader, "base_dataloader", loader)  # accelerate's dispatcher iterates the loader it wraps
        base.collate_fn = _PerSample(base.collate_fn)
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """
        The micro-batches of one optimizer step, each sample with TOPR's advantage R - c over the step's samples (of
        every process): c from `baseline`, `target_positive_fraction` (the step's samples' composition, as the offline
        trainer's is its dataset's) or `group_baseline` (the prompt's samples, from what TRL's worker records), from
        the reward each sample carries, whatever the worker ([`~trl_topr.topr_advantages`]). An optimizer step is
        what one update trains on, and every process sees the same samples of it. Also what the loss is a mean over:
        the step's samples, or their trained tokens (`loss_normalization="token_mean"`), so that no sample's weight
        depends on the micro-batch, token budget or process it lands in.
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        mine = [samples_of(batch) for batch in batches]
        local = torch.cat(mine).cpu()
        every = gather_object([local.tolist()]) if self.accelerator.num_processes > 1 else [local.tolist()]
        step = torch.tensor([row for rank in every for row in rank], dtype=torch.float64).reshape(-1, 3)
        if self.args.group_baseline:
            c = (step[:, 1] - step[:, 2]).nanmean().item() if len(step) else 0.0  # the mean of the groups' means
        else:
            c = topr_baseline(
                step[:, 1], baseline=self.args.baseline, target_positive_fraction=self.args.target_positive_fraction
            )
        for batch, samples in zip(batches, mine, strict=True):
            rewards, centred = samples[:, 1], samples[:, 2] if self.args.group_baseline else samples[:, 1] - c
            batch[ADVANTAGES] = torch.nan_to_num(centred).to(device)  # 0 for a sample no reward function scored
            batch[BASELINES] = (rewards - centred).to(device)  # each sample's c, for the logs
        if self.args.loss_normalization == "token_mean":
            return batches, sum(float(batch["global_n_tokens"][0]) for batch in batches)
        return batches, float(len(step))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        selected = inputs["token_index"] >= 0
        log_probs, entropy = self._forward(model, inputs, inputs["token_index"][selected])
        rows, positions = _segment_positions(inputs["segment_id"][selected])
        shape = (int(rows.max()) + 1, int(positions.max()) + 1) if rows.numel() else (0, 0)

        def laid_out(values: torch.Tensor) -> torch.Tensor:  # the packed tokens as (samples, tokens), zero-padded
            return values.new_zeros(shape).index_put((rows, positions), values)

        per_token, behavior = laid_out(log_probs), laid_out(inputs["old_log_probs"][selected].to(log_probs.dtype))
        mask = laid_out(torch.ones_like(log_probs)).bool()
        if self.args.use_worker_advantages or ADVANTAGES not in inputs:  # the worker's, as it filled them
            advantages = log_probs.new_zeros(shape[0]).index_put(
                (rows,), inputs["advantages"][selected].to(log_probs.dtype)
            )
        else:  # TOPR's R - c, over the optimizer step (`get_batch_samples`)
            advantages = inputs[ADVANTAGES].to(log_probs.dtype)
        # a mean over the step's samples (or trained tokens) of every process, which DDP averages: no sample's weight
        # depends on the micro-batch or process it lands in (TRL scales for accumulation in the loss)
        if num_items_in_batch is not None:
            count = torch.as_tensor(num_items_in_batch, dtype=log_probs.dtype) / self.accelerator.num_processes
        else:  # a call outside the training loop: this micro-batch's own mean, one of the step's
            count = None
        loss, metrics = topr_loss(
            per_token, mask, advantages, behavior, baseline=0.0, num_items_in_batch=count, **self.args.loss_options()
        )
        if count is None:
            loss = loss / self.current_gradient_accumulation_steps
        if BASELINES in inputs and len(inputs[BASELINES]):
            metrics["baseline"] = inputs[BASELINES].float().nanmean()  # what the loss's R - c was centred on
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * self._aux_loss / self.current_gradient_accumulation_steps
        log_ratio = torch.where(mask, per_token.detach() - behavior, 0.0).sum(-1)
        self._record(metrics, entropy, log_ratio, advantages, inputs)
        return loss

    def _forward(self, model, inputs, token_index: torch.Tensor):
        # TRL's forward of a packed batch: each trained token's log-prob under the policy, and its entropy
        kept = inputs["attention_mask"].bool()
        keys = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
        tree = {key: inputs[key][inputs[key] >= 0] for key in keys}
        tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        start = time.time()
        outputs = model(
            input_ids=inputs["input_ids"][kept].unsqueeze(0),
            position_ids=inputs["position_ids"][kept].unsqueeze(0),
            shift_labels=inputs["shift_labels"][kept].unsqueeze(0),
            fused_lm_head=True,
            **({"output_router_logits": True} if self.aux_loss_enabled else {}),
            **tree,
        )
        self._last_forward_time_s = time.time() - start
        self._aux_loss = getattr(outputs, "aux_loss", None)
        return outputs.log_probs.flatten()[token_index], outputs.entropy.flatten()[token_index]

    def _record(self, metrics: dict, entropy, log_ratio, advantages, inputs) -> None:
        # TOPR's metrics, each an exact mean over every process (TRL's sink reduces a (sum, count) pair as a rate), the
        # weights by staleness, and TRL's per-step accounting
        # the reward is the worker's (TRL logs each sample's), what the loss sees as R is R - c
        local = {name: value.item() for name, value in metrics.items() if name not in ("reward", "completion_length")}
        local |= {"entropy": entropy.float().mean().item(), "count/tokens": float(entropy.numel())}
        # each sample's version, and the version being trained: TRL's own count of the policy's versions, which only
        # the main process keeps (it syncs the weights), also after a resume (the checkpoint's, then its cold sync)
        samples = samples_of(inputs)
        if len(samples) != len(log_ratio):
            raise RuntimeError(
                f"The batch holds {len(log_ratio)} packed samples and {len(samples)} recorded versions: TRL's packing "
                "no longer keeps its samples in the order the collator receives them."
            )
        rows = list(zip(samples[:, 0].long().tolist(), log_ratio.tolist(), advantages.tolist()))
        mine = (local, rows, self.model_version)
        every = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        for values, _, _ in every:
            self._add_metrics(values, lambda name, v=values: v[METRIC_SUPPORT.get(name, "count/sequences")])
        current = every[0][2]  # the main process's
        samples = [(current - version, *row) for _, rank_rows, _ in every for version, *row in rank_rows]
        if samples:
            groups, ratios, centred = (torch.tensor(column) for column in zip(*samples, strict=True))
            by = ratio_metrics_by(groups, ratios, centred, "staleness", **self.args.weight_options())
            by = {name: value for name, value in by.items() if "/" in name}  # the overall ones are the loss's
            self._add_metrics(by, lambda name: by[f"{name.split('/')[0]}/rows"])
        forwarded, mean_length = float(inputs["global_n_forward_tokens"][0]), float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += forwarded
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_length * forwarded
        self._step_samples += forwarded / mean_length
        self._step_forward_s += self._last_forward_time_s

    def _add_metrics(self, values: dict[str, float], support: Callable[[str], float]) -> None:
        # A batch's means into TRL's sink as (sum, count) pairs, extrema and counts as they are; undefined ones out
        for name, value in values.items():
            if name.startswith("count/") or math.isnan(value):
                continue
            if name.endswith(("_min", "_max", "/rows")):
                self._metrics["train"][name].append(float(value))
            elif support(name) > 0:
                self._metrics["train"][name].append((value * support(name), float(support(name))))


class _GuardedRolloutWorker(AsyncRolloutWorker):
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


def _segment_positions(segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # For each trained token of a packed row, its sample (renumbered 0, 1, ... over the samples present) and its
    # position among that sample's trained tokens, in order
    _, rows = torch.unique(segment, return_inverse=True)
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.empty_like(rows)
    positions[order] = torch.arange(rows.numel(), device=rows.device) - starts[rows[order]]
    return rows, positions


class _PerSample:
    # TRL's collator, with each packed sample's (version that drew it, reward, reward less its group's mean) as a
    # (num_processes, samples, 3) tensor, padded with NaN: the version stamped among its metrics as the trainer reads
    # it from the queue, the reward and the group's spread as TRL's worker records them among its metrics
    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, examples):
        batch = self.collate(examples)
        (rows,) = examples
        values = [[per_sample(sample) for sample in row.samples] for row in rows]
        width = max(len(row) for row in values)
        nan = (math.nan,) * 3
        batch[SAMPLES] = torch.tensor([row + [nan] * (width - len(row)) for row in values], dtype=torch.float64)
        return batch


def samples_of(batch: dict) -> torch.Tensor:
    # This process's samples of a batch, (samples, 3): the dispatched row of `SAMPLES`, its padding dropped
    values = batch[SAMPLES].reshape(-1, 3)
    return values[~torch.isnan(values[:, 0])]


def per_sample(sample: dict) -> tuple[float, float, float]:
    """
    What TOPR reads of a sample of TRL's asynchronous trainer (as its dataset yields it): the policy version that drew
    it, its reward, and its reward less the mean reward of its group (the prompt's samples). TRL's worker records the
    reward and the group's standard deviation among the sample's metrics and gives it GRPO's advantage
    (R - mean) / (std + 1e-8), from which R - mean is recovered.

    Args:
        sample (`dict`):
            A sample as TRL's rollout dataset yields it (`advantage`, `metrics`).

    Returns:
        `tuple[float, float, float]`: version, reward, reward less its group's mean (NaN where unscored).
    """
    metrics = sample["metrics"]
    if "reward" not in metrics:
        raise ValueError(
            "A rollout sample carries no `reward` among its `metrics`, from which TOPR's R - c is computed: give "
            "each sample its reward there, as TRL's worker does, or set `use_worker_advantages=True` to train the "
            "worker's `advantage` as it is."
        )
    centred = sample["advantage"] * (metrics.get("reward_std", math.nan) + GRPO_STD_EPSILON)
    return float(metrics[MODEL_VERSION]), float(metrics["reward"]), float(centred)


GRPO_STD_EPSILON = 1e-8  # TRL's worker: advantage = (R - mean) / (std + 1e-8)


MODEL_VERSION = "sample/model_version"  # a sample's metric: the policy version that drew it (logged as a mean too)


class _Stamped:
    # The rollout queue as the trainer reads it: each sample with its `model_version` among its metrics, which TRL's
    # dataset passes on to the collator (the version itself it does not)
    def __init__(self, samples):
        self.samples = samples

    def get(self, *args, **kwargs):
        sample = self.samples.get(*args, **kwargs)
        sample.metrics = {**sample.metrics, MODEL_VERSION: float(sample.model_version)}
        return sample

    def __getattr__(self, name: str):
        return getattr(self.samples, name)


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
