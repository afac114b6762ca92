"""Real interruptions: a training run and the iterative loop are SIGKILLed mid-way in a subprocess, then restarted.

The trainer resumes from its latest complete checkpoint and ends with the weights and losses of an uninterrupted run;
the loop resumes after its last completed round, redoing only the interrupted one.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


TESTS = str(Path(__file__).parent)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
MAX_STEPS = 8
RUN_TIMEOUT = 120  # seconds for a whole subprocess run
WAIT_TIMEOUT = 90  # seconds to reach the point where the kill lands

TRAIN_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from conftest import make_args, standard_dataset
    from transformers import TrainerCallback
    from trl_topr import TOPRTrainer

    model_path, output_dir, losses_path, step_sleep, resume = sys.argv[1:6]


    class Record(TrainerCallback):
        # Writes each logged loss as it goes (a killed run keeps what it logged) and slows the steps down.
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                with open(losses_path, "a") as f:
                    f.write(json.dumps({{"step": state.global_step, "loss": logs["loss"]}}) + "\\n")
                    f.flush()
                    os.fsync(f.fileno())

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(float(step_sleep))


    # 8 rows in batches of 2: 4 steps an epoch, so the run crosses an epoch and resumes mid-epoch or at its end.
    args = make_args(output_dir, max_steps={max_steps}, save_strategy="steps", save_steps=2, logging_steps=1,
                     per_device_train_batch_size=2, seed=1234, disable_tqdm=True)
    trainer = TOPRTrainer(model_path, args=args, train_dataset=standard_dataset(8), callbacks=[Record()])
    trainer.train(resume_from_checkpoint=None if resume == "none" else resume)
    torch.save({{name: p.detach().clone() for name, p in trainer.model.state_dict().items()}},
               os.path.join(output_dir, "final_weights.pt"))
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump({{"global_step": trainer.state.global_step}}, f)
    """
)

LOOP_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from conftest import make_args
    from datasets import Dataset
    from trl_topr import TOPRLoopConfig
    from trl_topr.loop import run_topr_loop

    model_path, output_dir, curate_log, hang_at_call = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    calls = []


    def text(completion):
        return completion[-1]["content"] if isinstance(completion, list) else completion


    def even_length(prompts, completions, **kwargs):
        return [1.0 if len(text(c)) % 2 == 0 else -1.0 for c in completions]


    def curate(samples):
        # Logs each call (with this process's id), then hangs at the chosen call so that the parent kills it there.
        calls.append(len(samples))
        with open(curate_log, "a") as f:
            f.write(json.dumps({{"pid": os.getpid(), "call": len(calls)}}) + "\\n")
            f.flush()
            os.fsync(f.fileno())
        if len(calls) == hang_at_call:
            time.sleep(600)
        return samples


    messages = [[{{"role": "user", "content": f"What is {{i}} + 3?"}}] for i in range(4)]
    prompts = Dataset.from_dict({{"prompt": messages}})
    args = make_args(output_dir, per_device_train_batch_size=4, max_steps=-1, logging_steps=1, seed=0,
                     disable_tqdm=True)
    loop_args = TOPRLoopConfig(num_rounds=3, curation="__main__.curate", num_generations=2, max_completion_length=8)
    run_topr_loop(model_path, prompts, even_length, loop_args, args)
    """
)


REPLAY_WORKER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from conftest import make_args
    from datasets import Dataset
    import trl_topr.loop
    from trl_topr import TOPRLoopConfig

    model_path, output_dir, hang_marker = sys.argv[1], sys.argv[2], sys.argv[3]


    class HangingInRoundThree(trl_topr.loop.TOPRTrainer):
        # Round 3's second optimizer step announces itself, then hangs until the parent kills the process there
        def training_step(self, *args, **kwargs):
            if hang_marker != "none" and self.args.output_dir.endswith("round-3") and self.state.global_step == 1:
                open(hang_marker, "w").close()
                time.sleep(600)
            return super().training_step(*args, **kwargs)


    trl_topr.loop.TOPRTrainer = HangingInRoundThree


    def text(completion):
        return completion[-1]["content"] if isinstance(completion, list) else completion


    def even_length(prompts, completions, **kwargs):
        return [1.0 if len(text(c)) % 2 == 0 else -1.0 for c in completions]


    prompts = Dataset.from_dict(
        {{"prompt": [[{{"role": "user", "content": f"What is {{i}} + 3?"}}] for i in range(4)]}}
    )
    args = make_args(output_dir, per_device_train_batch_size=4, max_steps=-1, logging_steps=1, seed=0,
                     learning_rate=1e-2, disable_tqdm=True)
    loop_args = TOPRLoopConfig(num_rounds=3, replay_rounds=2, num_generations=2, max_completion_length=8)
    trl_topr.loop.run_topr_loop(model_path, prompts, even_length, loop_args, args)
    """
)


def write_worker(tmp_path, name, template):
    script = tmp_path / name
    script.write_text(template.format(tests=TESTS, max_steps=MAX_STEPS))
    return script


def start(script, *argv, log):
    # Output goes to a file: an unread pipe could fill up and block the child.
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, str(script), *map(str, argv)], stdout=out, stderr=subprocess.STDOUT, env=ENV
        )


def tail(log, n=3000):
    return Path(log).read_text()[-n:] if Path(log).exists() else "(no log)"


def finish(proc, log):
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the run did not finish in {RUN_TIMEOUT} s:\n{tail(log)}") from None
    assert proc.returncode == 0, tail(log)


def kill_when(condition, proc, log, what):
    """Poll `condition` until it holds, then SIGKILL `proc`; fail if it exits first or the wait times out."""
    deadline = time.monotonic() + WAIT_TIMEOUT
    try:
        while not condition():
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}:\n{tail(log)}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{tail(log)}"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_jsonl(path):
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def checkpoint_state(folder):
    """The trainer state of a checkpoint written to its end (trainer_state.json is written last), else None."""
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if state.get("global_step") == int(folder.name.split("-")[1]) else None


def checkpoints(output_dir):
    return sorted((p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir()), key=lambda p: int(p.name[11:]))


def test_training_killed_mid_run_resumes_from_its_latest_complete_checkpoint(tiny_model_path, tmp_path):
    script = write_worker(tmp_path, "train_worker.py", TRAIN_WORKER)
    killed_dir, reference_dir = tmp_path / "killed", tmp_path / "reference"
    # The uninterrupted reference runs alongside the run that gets killed (same seed and arguments, no sleep).
    reference = start(
        script,
        tiny_model_path,
        reference_dir,
        tmp_path / "reference_losses.jsonl",
        0,
        "none",
        log=tmp_path / "reference.log",
    )
    killed = start(
        script, tiny_model_path, killed_dir, tmp_path / "killed_losses.jsonl", 0.5, "none", log=tmp_path / "killed.log"
    )
    try:
        kill_when(lambda: (killed_dir / "checkpoint-4").is_dir(), killed, tmp_path / "killed.log", "checkpoint-4")
        finish(reference, tmp_path / "reference.log")
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    assert not (killed_dir / "result.json").exists()  # killed before the end of training

    # The kill may land while checkpoint-4 is being written: resume from the latest checkpoint written to its end.
    complete = [p for p in checkpoints(killed_dir) if checkpoint_state(p) is not None]
    assert complete, [p.name for p in checkpoints(killed_dir)]
    latest = complete[-1]
    resumed_from = int(latest.name.split("-")[1])
    assert resumed_from in (2, 4, 6), latest.name
    killed_losses = read_jsonl(tmp_path / "killed_losses.jsonl")
    assert [e["step"] for e in killed_losses] == list(range(1, len(killed_losses) + 1))
    assert resumed_from <= len(killed_losses) < MAX_STEPS  # the checkpoint's steps were logged; the run did not end

    resumed = start(
        script, tiny_model_path, killed_dir, tmp_path / "resumed_losses.jsonl", 0, latest, log=tmp_path / "resumed.log"
    )
    finish(resumed, tmp_path / "resumed.log")

    assert json.loads((killed_dir / "result.json").read_text())["global_step"] == MAX_STEPS
    assert json.loads((reference_dir / "result.json").read_text())["global_step"] == MAX_STEPS
    expected = {e["step"]: e["loss"] for e in read_jsonl(tmp_path / "reference_losses.jsonl")}
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))
    # Resumed, not restarted: it logs only the steps after the checkpoint, with the uninterrupted run's losses.
    resumed_losses = read_jsonl(tmp_path / "resumed_losses.jsonl")
    assert [e["step"] for e in resumed_losses] == list(range(resumed_from + 1, MAX_STEPS + 1))
    for entry in killed_losses + resumed_losses:
        assert abs(entry["loss"] - expected[entry["step"]]) <= 1e-6, (entry, expected[entry["step"]])

    want = torch.load(reference_dir / "final_weights.pt", weights_only=True)
    got = torch.load(killed_dir / "final_weights.pt", weights_only=True)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)

    # No partial checkpoint is left behind: the resumed run rewrote any the kill cut short.
    assert [p.name for p in checkpoints(killed_dir)] == [f"checkpoint-{s}" for s in range(2, MAX_STEPS + 1, 2)]
    for folder in checkpoints(killed_dir):
        assert checkpoint_state(folder) is not None, folder.name
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(os.listdir(folder))


def digests(folder):
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(Path(folder).iterdir())
        if p.is_file()
    }


def test_loop_killed_in_round_two_redoes_only_that_round(tiny_model_path, tmp_path):
    script = write_worker(tmp_path, "loop_worker.py", LOOP_WORKER)
    output_dir, curate_log = tmp_path / "loop", tmp_path / "curate.jsonl"
    metrics = output_dir / "metrics.jsonl"

    # First run: hangs in round 2's curation (its second call), after round 1's metrics line and round-2/ exist.
    first = start(script, tiny_model_path, output_dir, curate_log, 2, log=tmp_path / "first.log")

    def in_round_two():
        return (
            [r["round"] for r in read_jsonl(metrics)] == [0, 1]
            and (output_dir / "round-2").is_dir()
            and [c["call"] for c in read_jsonl(curate_log)] == [1, 2]
        )

    kill_when(in_round_two, first, tmp_path / "first.log", "round 2")
    lines_before = metrics.read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines_before] == [0, 1]  # killed before round 2 completed
    round_1 = digests(output_dir / "round-1")
    assert "model.safetensors" in round_1
    partial_samples = (output_dir / "round-2" / "samples.jsonl").read_text()  # the killed attempt's samples
    (output_dir / "round-2" / "stale-marker").write_text("left by the killed attempt")

    # Restart the same command, without the hang, to completion.
    second = start(script, tiny_model_path, output_dir, curate_log, 0, log=tmp_path / "second.log")
    finish(second, tmp_path / "second.log")

    lines_after = metrics.read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines_after] == [0, 1, 2, 3]  # each round once, in order
    assert lines_after[:2] == lines_before  # rounds 0 and 1 are not redone
    assert digests(output_dir / "round-1") == round_1  # round 1's model and samples untouched (content and mtime)
    calls = read_jsonl(curate_log)
    assert [c["pid"] for c in calls] == [first.pid] * 2 + [second.pid] * 2  # the restart curated rounds 2 and 3 only

    assert not (output_dir / "round-2" / "stale-marker").exists()  # round 2 was redone from its start
    # Sampling is seeded per round from round 1's model: the redone round draws what the killed attempt drew.
    assert (output_dir / "round-2" / "samples.jsonl").read_text() == partial_samples
    for r in (2, 3):
        folder = output_dir / f"round-{r}"
        files = set(os.listdir(folder))
        assert {"model.safetensors", "config.json", "tokenizer.json", "samples.jsonl", "README.md"} <= files, files
        assert len((folder / "samples.jsonl").read_text().splitlines()) == 8  # 4 prompts x 2 samples
        AutoModelForCausalLM.from_pretrained(folder)  # loads: written to its end
    assert not (output_dir / "round-4").exists()


def test_loop_killed_while_training_a_replayed_round_resumes_to_the_same_model(tiny_model_path, tmp_path):
    # Round 3 replays rounds 1 and 2 (24 rows, 6 steps): killed at its second step, then restarted, the loop redoes
    # round 3 from its start and ends with the model and metrics of a run that was never interrupted.
    from safetensors.torch import load_file

    script = write_worker(tmp_path, "replay_worker.py", REPLAY_WORKER)
    whole, marker = tmp_path / "uninterrupted", tmp_path / "hanging"
    finish(start(script, tiny_model_path, whole, "none", log=tmp_path / "whole.log"), tmp_path / "whole.log")

    killed = tmp_path / "killed"
    first = start(script, tiny_model_path, killed, marker, log=tmp_path / "first.log")
    kill_when(marker.exists, first, tmp_path / "first.log", "round 3's second step")
    assert [r["round"] for r in read_jsonl(killed / "metrics.jsonl")] == [0, 1, 2]
    assert (killed / "round-3" / "train.jsonl").exists() and not (killed / "round-3" / "model.safetensors").exists()
    finish(start(script, tiny_model_path, killed, "none", log=tmp_path / "second.log"), tmp_path / "second.log")

    assert read_jsonl(killed / "metrics.jsonl") == read_jsonl(whole / "metrics.jsonl")
    rounds = read_jsonl(whole / "metrics.jsonl")
    assert rounds[3]["num_train_rows"] == 24 and rounds[3]["age_2/rows"] == 8  # the round replayed rounds 1 and 2
    resumed, uninterrupted = (
        load_file(killed / "round-3" / "model.safetensors"),
        load_file(whole / "round-3" / "model.safetensors"),
    )
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
    before = load_file(whole / "round-2" / "model.safetensors")
    assert any(not torch.equal(before[name], uninterrupted[name]) for name in before)  # round 3 trained
