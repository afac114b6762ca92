"""Shared fixtures: a tiny Llama built from a config with a small BPE tokenizer, saved once per session."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from functools import cache


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
from trl_topr.testing import (  # noqa: E402, F401  (the tests import them from here)
    CHATML,
    CORPUS,
    build_tiny_model,
    kill_tree,
)


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


LAUNCH_TIMEOUT = (
    600  # seconds: a launch that runs longer is stopped, and its test fails with each process's last lines
)


def pytest_configure(config):
    """
    Give the run a torch extensions folder of its own (`TORCH_EXTENSIONS_DIR`, inherited by every launch). DeepSpeed
    builds its CPU communication op (`deepspeed_shm_comm`) with torch's JIT extension loader when a process group
    starts, under a lock file that makes every other build wait for as long as it exists: a build stopped midway (a
    launch past its timeout, an interrupted run) leaves it behind, and every DeepSpeed launch after it, in that run or
    any later one sharing the folder, waits forever. Only the pytest process configures: the workers that import
    this module inherit the folder.
    """
    folder = tempfile.mkdtemp(prefix="torch-extensions-")
    os.environ["TORCH_EXTENSIONS_DIR"] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


@cache
def build_deepspeed_ops() -> None:
    """
    Build DeepSpeed's CPU communication op once per run, in a process of its own that no timeout stops, before the
    first DeepSpeed launch: a launch then loads it, and a launch stopped past its timeout cannot leave a build's lock.
    """
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"  # what each process calls on its start
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"DeepSpeed's CPU communication op did not build:\n{result.stderr[-3000:]}", pytrace=False)


def free_port() -> int:
    """A free TCP port on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """
    `script` with `arguments` under `accelerate launch` on `num_processes` CPU processes (gloo), started in the
    background: with `config_file` (an Accelerate configuration for CPU, see `trl_topr.testing.cpu_launch_config`),
    or else accelerate's torch.distributed launcher (`--multi_gpu`, gloo without a GPU). It runs in a process group of
    its own, on a port of its own, each process's output kept apart (torchrun's `--tee`); [`finish`] waits for it.
    """

    def __init__(self, script, *arguments, config_file=None, num_processes: int = 2, env=None, cwd=None):
        if config_file is not None and "deepspeed_config" in Path(config_file).read_text():
            build_deepspeed_ops()
        self.logs = Path(tempfile.mkdtemp(prefix="launch-"))
        command = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
        if config_file is not None:
            command += ["--config_file", str(config_file)]
        else:
            command += ["--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1"]
            command += ["--mixed_precision", "no", "--dynamo_backend", "no"]
        self.command = command + ["--tee", "3", "--log_dir", str(self.logs), str(script), *map(str, arguments)]
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
        with open(self.logs / "launcher.log", "w") as out:  # a file, not a pipe that could fill up and block them
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**environment, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        self.start = time.monotonic()

    def finish(self, timeout: float = LAUNCH_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
        """
        Wait for the launch, at most `timeout` seconds from its start: past it, the whole group is stopped; then, or
        where it failed and `check`, the test fails with each process's last lines.

        Returns:
            `subprocess.CompletedProcess`: its exit status and output (stdout and stderr of every process).
        """
        try:
            self.process.wait(timeout=max(timeout - (time.monotonic() - self.start), 0))
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"The launch ran past {timeout:.0f} s and was stopped.\n{last_lines(self.logs)}", pytrace=False
            )
        finally:
            if self.process.poll() is None:
                kill_tree(self.process.pid)  # the launcher and its workers (in sessions of their own)
                self.process.wait()
        seconds, output = time.monotonic() - self.start, (self.logs / "launcher.log").read_text(errors="replace")
        if check and self.process.returncode != 0:
            pytest.fail(
                f"The launch failed (exit status {self.process.returncode}) after {seconds:.0f} s.\n"
                f"{last_lines(self.logs)}",
                pytrace=False,
            )
        shutil.rmtree(self.logs, ignore_errors=True)
        return subprocess.CompletedProcess(self.command, self.process.returncode, output, "")


def launch(script, *arguments, timeout: float = LAUNCH_TIMEOUT, check: bool = True, **options):
    """
    [`Launch`] `script` with `arguments` (and its `options`) and [`Launch.finish`] it within `timeout` seconds.

    Returns:
        `subprocess.CompletedProcess`: its exit status and output (stdout and stderr of every process).
    """
    return Launch(script, *arguments, **options).finish(timeout, check)


def last_lines(logs: Path, n: int = 30) -> str:
    """The last `n` lines each process of a launch wrote (stdout and stderr), then the launcher's."""
    parts = []
    for stream in sorted(logs.glob("*/attempt_*/*/std*.log")):
        lines = stream.read_text(errors="replace").splitlines()
        parts.append(f"--- process {stream.parent.name}, {stream.stem}: last {min(n, len(lines))} lines ---")
        parts += lines[-n:]
    lines = (logs / "launcher.log").read_text(errors="replace").splitlines()
    parts.append(f"--- the launcher: last {min(n, len(lines))} lines ---")
    return "\n".join(parts + lines[-n:])


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
