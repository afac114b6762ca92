"""
The asynchronous trainer on TRL's own rollout worker and a vLLM server (vLLM's CPU build), the PEFT adapter synced over
HTTP: training, and what happens when the server dies mid-run, when the worker stops producing, and when a run resumes
from a checkpoint. One server is shared by the module's tests (a start costs about two minutes here) and started again
where a test stopped it. These tests run in vLLM's own environment, as `tests/test_vllm.py`.
"""

import json
import multiprocessing
import os
import re
import signal
import sys
import time
import urllib.request

import pytest
from conftest import kill_tree
from peft import LoraConfig
from safetensors.torch import load_file
from test_vllm import SERVER_OPTIONS, arithmetic, free_port, smollm2, start_server, vllm_installed  # noqa: F401
from transformers import AutoTokenizer, TrainerCallback


pytestmark = pytest.mark.vllm
LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
STALENESS = re.compile(r"^staleness_(-?\d+)/rows$")


def shortness(completions, **kwargs):
    """Rewards that differ within a prompt's samples (minus each completion's length): GRPO's advantages not all 0.
    At module level: TRL's worker sends its reward functions to a process of its own."""
    return [-float(len(c[-1]["content"])) for c in completions]


class Server:
    """A vLLM server for TRL's worker (LoRA served and loaded at run time, TRL's log-probs), started when needed."""

    def __init__(self, model_path: str, folder):
        self.model_path, self.folder, self.process, self.starts = model_path, folder, None, 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def answers(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.url}/health", timeout=5)
            return True
        except OSError:
            return False

    def ensure(self) -> "Server":
        """The server up, holding none of an earlier run's adapters: a new run publishes its versions from v1 again,
        which a server that holds them refuses (TRL's adapter names count versions)."""
        if self.process is not None and self.process.poll() is None and self.answers():
            for model in json.load(urllib.request.urlopen(f"{self.url}/v1/models"))["data"]:
                if model.get("parent"):  # an adapter
                    request = urllib.request.Request(
                        f"{self.url}/v1/unload_lora_adapter",
                        data=json.dumps({"lora_name": model["id"]}).encode(),
                        headers={"Content-Type": "application/json"},
                    )
                    urllib.request.urlopen(request, timeout=30)
        else:
            self.stop()
            command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path]
            command += ["--port", str(self.port), *SERVER_OPTIONS, "--enable-lora", "--max-lora-rank", "8"]
            command += ["--max-loras", "4", "--logprobs-mode", "processed_logprobs"]  # TRL's
            self.starts += 1
            log = self.folder / f"server-{self.starts}.log"
            self.process = start_server(command, self.port, log, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
        return self

    def kill(self) -> None:
        # the server and its engine's process, as a crash or a preemption ends them (SIGKILL to the server alone
        # leaves its engine running, and computing, for the rest of the session)
        kill_tree(self.process.pid)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    path, _ = smollm2
    server = Server(path, tmp_path_factory.mktemp("server"))
    yield server
    server.stop()


def trainer_for(smollm2, server, output_dir, prompts: int = 16, callbacks=(), **options):
    from trl_topr import TOPRAsyncGRPOConfig, TOPRAsyncGRPOTrainer, with_tool_template

    path, _ = smollm2
    tokenizer = with_tool_template(AutoTokenizer.from_pretrained(path))  # a ChatML template TRL's worker parses
    options = {
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "vllm_server_base_url": server.url,
        "max_staleness": 2,  # the server holds max_staleness + 2 adapters (its --max-loras)
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 16,
        # TRL packs a step's samples into rows of `token_budget` tokens, by default the server's max_model_len (1024):
        # dozens of this task's 64-token samples a step, 90 s a step here. 256 packs two prompts' groups a row.
        "token_budget": 256,
        "gradient_checkpointing": False,
        "save_strategy": "no",
        "logging_steps": 1,
        "learning_rate": 1e-3,
        **options,
    }
    args = TOPRAsyncGRPOConfig(str(output_dir), **options)
    return TOPRAsyncGRPOTrainer(
        path, shortness, args, arithmetic(prompts), tokenizer, peft_config=LORA, callbacks=list(callbacks)
    )


def staleness_seen(entries: list[dict]) -> set[int]:
    """The staleness values TOPR's metrics were logged under (`staleness_<k>/rows`) in these log entries."""
    return {int(match[1]) for entry in entries for key in entry if (match := STALENESS.match(key))}


class Kills(TrainerCallback):
    """Kills the server at the end of a step, as a crash or a preemption would."""

    def __init__(self, server: "Server", step: int):
        self.server, self.step, self.killed_at = server, step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.kill()
            self.killed_at = time.monotonic()


def test_trls_worker_trains_through_the_server_and_a_run_whose_server_dies_resumes_from_its_last_checkpoint(
    smollm2, server, tmp_path
):
    # TRL's own rollout worker on a vLLM server (vLLM's CPU build serves LoRA), the PEFT adapter published to it over
    # HTTP after each step: the samples come back with vLLM's log-probs and the loss is TOPR's, on TOPR's R - c
    # (target positive fraction 0.8 over each step's rewards). The server is killed
    # after step 2: the next weight sync (or the worker's next request) cannot reach it, and the run stops within
    # seconds with an error naming the server and the checkpoint to resume from. That checkpoint is whole (step 1:
    # step 2's save comes after the sync that failed), and a run resumed from it, the server started again, goes on
    # from its step and its model version, and logs each sample's staleness from TRL's count of versions.
    server.ensure()
    with pytest.raises(ValueError, match="max_staleness"):  # every sample kept: as many adapters as versions
        trainer_for(smollm2, server, tmp_path / "unbounded", max_staleness=None)
    output_dir = tmp_path / "out"
    killer = Kills(server, step=2)
    options = dict(max_steps=6, save_strategy="steps", save_steps=1, target_positive_fraction=0.8)
    trainer = trainer_for(smollm2, server, output_dir, callbacks=[killer], **options)
    assert trainer._lora_sync  # the adapter alone goes to the server, over HTTP
    with pytest.raises(RuntimeError, match=re.escape(f"The vLLM server at {server.url} does not answer")) as error:
        trainer.train()
    # step 1 logged (step 2's log comes after the weight sync that found the server gone)
    (step,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert step["grad_norm"] > 0 and "negative_weight_mean" in step and staleness_seen([step])
    # TOPR's R - c from the rewards TRL's worker recorded: c puts 0.8 of the step's weight on its positives
    assert step["effective_positive_fraction"] == pytest.approx(0.8, abs=1e-3) and "baseline" in step
    assert time.monotonic() - killer.killed_at < 60  # bounded: no wait on a dead server
    checkpoint = output_dir / "checkpoint-1"
    assert f"The last complete checkpoint is {checkpoint}" in str(error.value)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 1
    assert load_file(str(checkpoint / "adapter_model.safetensors"))  # the adapter reads back
    saved_version = json.loads((checkpoint / "rollout_state.json").read_text())["model_version"]
    assert saved_version == 2  # the initial sync and step 1's
    del trainer

    server.ensure()  # started again: it holds none of the earlier adapters
    resumed = trainer_for(smollm2, server, output_dir, **{**options, "max_steps": 3})
    resumed.train(resume_from_checkpoint=str(checkpoint))
    steps = [entry for entry in resumed.state.log_history if "loss" in entry]
    assert [e["step"] for e in steps] == [1, 2, 3]  # step 1 from the checkpoint's log, then 2 and 3
    # TRL's count goes on from the checkpoint's: a sync as training starts again, then one per step, each version's
    # adapter published to the server
    assert resumed.model_version == saved_version + 1 + 2
    served = {model["id"] for model in json.load(urllib.request.urlopen(f"{server.url}/v1/models"))["data"]}
    assert f"trl-policy-v{resumed.model_version}" in served
    # every sample of the resumed steps was drawn at a version from after the resume: its staleness at most TRL's
    # bound, never negative (a count of versions started again from the step number would say -1)
    seen = staleness_seen(steps[1:])
    assert seen and min(seen) >= 0 and max(seen) <= 2


def rollout_worker() -> multiprocessing.Process:
    """TRL's rollout worker: the process it spawned."""
    (worker,) = [p for p in multiprocessing.active_children() if p.name == "grpo-rollout-worker-child"]
    return worker


class Signals(TrainerCallback):
    """Sends TRL's rollout worker a signal after the first step: SIGSTOP (it hangs: it neither produces nor beats its
    heartbeat) or SIGKILL (it dies, as the out-of-memory killer would end it)."""

    def __init__(self, signal_number: int):
        self.signal_number, self.sent_at, self.pid = signal_number, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.pid = rollout_worker().pid
            os.kill(self.pid, self.signal_number)
            self.sent_at = time.monotonic()


@pytest.mark.parametrize(
    "signal_number, reported",
    [(signal.SIGSTOP, "heartbeat stale: .* child is hung"), (signal.SIGKILL, "process exited \\(killed by signal 9")],
    ids=["hung", "killed"],
)
def test_a_worker_that_stops_producing_is_reported_and_the_trainer_stops(
    smollm2, server, tmp_path, signal_number, reported
):
    # Hung: what was queued is trained, then TRL's health check reports the stale heartbeat. Killed: the trainer says
    # so at its next wait for samples. Either way training stops, and so does the worker (TRL's own stop would wait
    # forever on a worker that cannot answer it), rather than a silent stall.
    server.ensure()
    sender = Signals(signal_number)
    trainer = trainer_for(
        smollm2, server, tmp_path / "out", callbacks=[sender], max_steps=20, heartbeat_stale_after_s=10
    )
    with pytest.raises(RuntimeError, match=reported):
        trainer.train()
    assert time.monotonic() - sender.sent_at < 120 and trainer.state.global_step < 20
    assert not [p for p in multiprocessing.active_children() if p.name == "grpo-rollout-worker-child"]
