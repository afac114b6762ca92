"""Shared fixtures: a tiny Llama built from a config with a small BPE tokenizer, saved once per session."""

import os
import weakref


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from huggingface_hub import CommitInfo, HfApi, RepoUrl  # noqa: E402
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects  # noqa: E402

from trl_topr import TOPRConfig, TOPRTrainer  # noqa: E402
from trl_topr.compat import CHECKPOINTING  # noqa: E402
from trl_topr.testing import CHATML, CORPUS, build_tiny_model  # noqa: E402, F401  (the tests import them from here)


def end_processes() -> None:
    """
    End a worker run on several processes (`accelerate launch`): wait until every process is done (the main one may
    still be saving), collect garbage (a trainer left in a reference cycle would keep its DDP model, whose reducer
    holds the process group, alive), then destroy the group. Call it after the worker's trainers have gone out of
    scope: a gloo group that outlives `destroy_process_group` is torn down during interpreter shutdown, where its
    threads can abort the process ("terminate called without an active exception").
    """
    import gc

    from accelerate import PartialState

    state = PartialState()
    state.wait_for_everyone()
    gc.collect()
    state.destroy_process_group()


def recording_trainer(trained: list) -> type:
    """
    A [`TOPRTrainer`] that appends `(name, weak reference)` pairs to `trained` after `train`: the trainer, its model,
    the model it trained (a DDP wrapper or DeepSpeed engine, or the model itself) and its optimizers (accelerate's
    wrapper and the one inside). Put in place of `trl_topr.loop.TOPRTrainer`, it shows what the loop's rounds leave
    alive ([`alive`]).
    """

    class RecordingTrainer(TOPRTrainer):
        def train(self, *args, **kwargs):
            output = super().train(*args, **kwargs)
            optimizer = self.optimizer
            for name, held in (
                ("trainer", self),
                ("model", self.model),
                ("trained model", self.model_wrapped),
                ("optimizer", optimizer),
                ("inner optimizer", getattr(optimizer, "optimizer", None)),
            ):
                if held is not None:
                    trained.append((name, weakref.ref(held)))
            return output

    return RecordingTrainer


def alive(trained: list) -> list[str]:
    """The names of the objects recorded by [`recording_trainer`] that are still alive."""
    return [name for name, reference in trained if reference() is not None]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


TOOL_PROMPT = [{"role": "user", "content": "What is 7 * 8?"}]
TOOL_TRAJECTORY = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 7, "b": 8}}}],
    },
    {"role": "tool", "name": "multiply", "content": "56"},
    {"role": "assistant", "content": "The answer is 56."},
]


@pytest.fixture(scope="session")
def tool_policy(tmp_path_factory) -> str:
    """A tiny policy with a tool-calling template (Qwen2.5's, as TRL ships it) that calls `multiply(7, 8)` when asked
    7 * 8 (`TOOL_PROMPT`), then answers from the result (`TOOL_TRAJECTORY`)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from trl_topr.testing import build_tool_policy

    tokenizer = build_tiny_model(str(tmp_path_factory.mktemp("tool-tokenizer")), chat_template=qwen2_5_chat_template)
    folder = str(tmp_path_factory.mktemp("tool-policy"))
    return build_tool_policy(folder, tokenizer, TOOL_PROMPT, TOOL_TRAJECTORY, [multiply])


# Tests of a path that also runs on CUDA: "cuda" runs where a GPU exists (`pytest -m gpu`), "cpu" everywhere.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    ),
]


def make_args(output_dir, **kwargs) -> TOPRConfig:
    """A fast CPU configuration for tests; keyword arguments override it."""
    defaults = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        **{CHECKPOINTING: False},  # activation checkpointing (gradient checkpointing before transformers 5.20)
        learning_rate=1e-3,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,  # no progress bars, the loop's sampling bars included
    )
    defaults.update(kwargs)
    return TOPRConfig(**defaults)


def standard_dataset(n: int = 8, **extra) -> Dataset:
    """`n` rows of arithmetic prompts with right (+1) and wrong (-1) completions."""
    rows = {
        "prompt": [f"What is {i} + 3?" for i in range(n)],
        "completion": [f" The answer is {i + 3 if i % 2 == 0 else i + 4}." for i in range(n)],
        "reward": [1.0 if i % 2 == 0 else -1.0 for i in range(n)],
    }
    rows.update(extra)
    return Dataset.from_dict(rows)


def conversational_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(n)],
            "completion": [
                [{"role": "assistant", "content": f"The answer is {i + 3 if i % 2 == 0 else i + 4}."}]
                for i in range(n)
            ],
            "reward": [1.0 if i % 2 == 0 else -1.0 for i in range(n)],
        }
    )


@pytest.fixture
def hub(monkeypatch):
    """Records what `HfApi` would send: the repos created and, for each upload, the files it would upload."""
    calls = {"repos": [], "commits": []}

    def create_repo(self, repo_id, **kwargs):
        calls["repos"].append(repo_id)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, allow_patterns=None, **kwargs):
        # The selection `upload_folder` makes, with its own filter and default ignore patterns.
        paths = [str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file()]
        ignore = list(ignore_patterns or []) + DEFAULT_IGNORE_PATTERNS
        selected = filter_repo_objects(paths, allow_patterns=allow_patterns, ignore_patterns=ignore)
        files = {path: (Path(folder_path) / path).read_bytes() for path in selected}
        calls["commits"].append({"repo_id": repo_id, "files": files})
        url = f"https://huggingface.co/{repo_id}/commit/0"
        return CommitInfo(commit_url=url, commit_message="", commit_description="", oid="0" * 40)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls
