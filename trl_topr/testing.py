"""
Running on a CPU what users run on GPUs, with real transformers, TRL and accelerate code and no download: a tiny causal
LM built from a config (a small BPE tokenizer with a ChatML template), and the shipped multi-GPU Accelerate
configurations adapted to 2 CPU processes (gloo; DeepSpeed with `DS_ACCELERATOR=cpu`; FSDP2 re-applied over
accelerate's fall-back to DDP on CPU). What the tests and the benchmarks build on.
"""

import json
import os
import signal
from pathlib import Path

import torch
import yaml
from accelerate import PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "What is 2 + 3? The answer is 5.",
    "What is 7 * 8? The answer is 56.",
    "Tell me a story about a cat and a dog.",
    "The quick brown fox jumps over the lazy dog.",
    "user assistant system hello world yes no maybe correct wrong",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ? .",
] * 20


def build_tiny_model(folder: str, seed: int = 0, hidden_size: int = 32, chat_template: str = CHATML) -> str:
    """
    Save a 2-layer Llama (random weights) and a ~200-token BPE tokenizer with a chat template (ChatML by default) to
    `folder`.

    Args:
        folder (`str`):
            Where to save them.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the weights.
        hidden_size (`int`, *optional*, defaults to `32`):
            Width of the model.
        chat_template (`str`, *optional*, defaults to `CHATML`):
            The tokenizer's chat template (e.g. a tool-calling one, `trl.chat_template_utils.qwen2_5_chat_template`).

    Returns:
        `str`: `folder`, loadable with `from_pretrained`.
    """
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_tool_policy(
    folder: str, tokenizer_path: str, prompt: list[dict], completion: list[dict], tools: list, steps: int = 150
) -> str:
    """
    Save to `folder` a tiny Llama (2 layers, width 128, head size 64: also loadable by vLLM's CPU build) that has
    learned one tool-calling trajectory by heart, and its tokenizer: greedy decoding from `prompt` (rendered with
    `tools`) says `completion`'s first assistant turn, and after the tools' results, the next one. A policy that calls
    tools, to sample with tools in the loop without a download.

    Args:
        folder (`str`):
            Where to save them.
        tokenizer_path (`str`):
            The tokenizer to use, with a chat template that renders tools (e.g. [`build_tiny_model`]'s with
            `chat_template=trl.chat_template_utils.qwen2_5_chat_template`).
        prompt (`list[dict]`):
            The prompt's messages.
        completion (`list[dict]`):
            The trajectory: assistant turns (with TRL's `tool_calls`) and tool results.
        tools (`list`):
            The tools (functions), as the sampler will show them.
        steps (`int`, *optional*, defaults to `150`):
            Adam steps on the trajectory's policy tokens.

    Returns:
        `str`: `folder`.
    """
    from transformers import AutoTokenizer

    from .trajectories import trajectory_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    row = trajectory_ids(tokenizer, prompt, completion, tools)
    ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
    trained = [token if bit else -100 for token, bit in zip(row["completion_ids"], row["tool_mask"])]
    labels = torch.tensor([[-100] * len(row["prompt_ids"]) + trained])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max(2048, 2 * ids.size(1)),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        model(ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# The shipped configuration file of each engine in `recipes/accelerate/`
ACCELERATE_CONFIG_FILES = {"ddp": "multi_gpu.yaml", "fsdp2": "fsdp.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml"}


def cpu_launch_config(shipped: str | Path, folder: str | Path) -> Path:
    """
    A shipped Accelerate configuration (multi-GPU, DeepSpeed or FSDP2) adapted to 2 CPU processes: only what a CPU
    run needs changes (2 processes, no mixed precision, the CPU; for ZeRO-3 `stage3_param_persistence_threshold: 0`,
    else a tiny model keeps every parameter gathered and partitioning bugs hide).

    Args:
        shipped (`str` or `Path`):
            The shipped configuration file (e.g. `recipes/accelerate/zero3.yaml`).
        folder (`str` or `Path`):
            Where to write the adapted configuration (and DeepSpeed's JSON file).

    Returns:
        `Path`: the configuration to pass to `accelerate launch --config_file`.
    """
    folder = Path(folder)
    config = yaml.safe_load(Path(shipped).read_text())  # without a GPU, the "multi-GPU" launcher uses gloo
    config.update(num_processes=2, mixed_precision="no", use_cpu=True)
    if "deepspeed_config" in config:
        shipped = config.pop("deepspeed_config")
        zero = {"stage": shipped["zero_stage"]}
        if shipped["zero_stage"] == 3:
            zero.update(
                stage3_param_persistence_threshold=0,
                stage3_gather_16bit_weights_on_model_save=shipped["zero3_save_16bit_model"],
            )
        ds_config = {
            "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
        (folder / "ds_config.json").write_text(json.dumps(ds_config))
        config["deepspeed_config"] = {
            "deepspeed_config_file": str(folder / "ds_config.json"),
            "zero3_init_flag": shipped.get("zero3_init_flag", False),
        }
        del config["mixed_precision"]  # the DeepSpeed file's business (float32 here: no bf16 section)
    path = folder / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def reapply_fsdp_plugin() -> None:
    """
    Make FSDP2 shard on CPU processes: call it in each process of a run launched with an FSDP2 configuration, before
    the `Accelerator` is built.
    """
    # accelerate keeps the FSDP plugin only for accelerator devices: on a multi-process CPU run it silently falls back
    # to DDP. Re-apply it, so that FSDP2 really shards the model on gloo (the test asserts DTensor parameters). The
    # distributed type lives in PartialState's shared state, which every AcceleratorState() copies.
    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            PartialState._shared_state["distributed_type"] = self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def descendants(pid: int) -> list[int]:
    """
    Every process `pid` started, and theirs, in sessions of their own too (torchrun's workers are): read from
    `/proc` (Linux; elsewhere none).

    Args:
        pid (`int`):
            A process.

    Returns:
        `list[int]`: their process ids.
    """
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def kill_tree(pid: int) -> None:
    """
    Kill the process `pid` and every process it started ([`descendants`]), as a launch past its time limit must be:
    ending `accelerate launch` alone leaves its workers running.

    Args:
        pid (`int`):
            The process.
    """
    for process in [*descendants(pid), pid]:
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass
