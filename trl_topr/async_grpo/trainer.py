"""`TOPRAsyncGRPOTrainer`: TRL's asynchronous GRPO trainer with TOPR's loss and advantage."""

import math
import time
from collections.abc import Callable

import torch
from accelerate.logging import get_logger
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import AttentionInterface, AutoTokenizer

from ..baseline import topr_baseline
from ..distributed import NamesTheStep
from ..loss import METRIC_SUPPORT, ratio_metrics_by, topr_loss
from ..precision import FlushesDenormals
from ..sampling import RewardFuncs
from ..trainer import TOPR_PAPER, CardOnSave, latest_complete_checkpoint
from ..trl_seam import trl_model_card
from ..trl_seam.asynchronous import (
    TREE_ATTENTION,
    AsyncGRPOTrainer,
    AsyncRolloutWorker,
    GuardedRolloutWorker,
    count_micro_batch,
    is_adapter_slots_error,
    peak_flops_guarded,
    train_metrics,
)
from .attention import flash_attention_3_loads, tree_attention
from .config import UNBOUNDED_STALENESS, TOPRAsyncGRPOConfig
from .packed import ADVANTAGES, BASELINES, PerSampleCollator, StampedQueue, samples_of, segment_positions
from .worker import SamplerRolloutWorker


logger = get_logger(__name__)


@trl_model_card("TOPR-AsyncGRPO", TOPR_PAPER, ["trl", "topr", "async-grpo"])
class TOPRAsyncGRPOTrainer(NamesTheStep, FlushesDenormals, CardOnSave, AsyncGRPOTrainer):
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
        with peak_flops_guarded(args):
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
                if args.max_staleness == UNBOUNDED_STALENESS and is_adapter_slots_error(error):
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
            self.rollout_worker.__class__ = GuardedRolloutWorker
        if self.rollout_queue is not None:  # each sample's version, past TRL's dataset, for the logs by staleness
            self.rollout_queue = StampedQueue(self.rollout_queue)

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
        base.collate_fn = PerSampleCollator(base.collate_fn)
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
        rows, positions = segment_positions(inputs["segment_id"][selected])
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
            loss = loss + self.router_aux_loss_coef * self.router_aux_loss / self.current_gradient_accumulation_steps
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
        self.forward_seconds = time.time() - start
        self.router_aux_loss = getattr(outputs, "aux_loss", None)
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
        count_micro_batch(self, inputs, self.forward_seconds)  # TRL's per-step accounting

    def _add_metrics(self, values: dict[str, float], support: Callable[[str], float]) -> None:
        # A batch's means into TRL's sink as (sum, count) pairs, extrema and counts as they are; undefined ones out
        for name, value in values.items():
            if name.startswith("count/") or math.isnan(value):
                continue
            if name.endswith(("_min", "_max", "/rows")):
                train_metrics(self)[name].append(float(value))
            elif support(name) > 0:
                train_metrics(self)[name].append((value * support(name), float(support(name))))
