"""`accelerate launch --num_processes 2` on CPU: the behavior precompute and training run across processes."""

import json
import textwrap
import time
from pathlib import Path

import pytest
from conftest import launch, make_args, standard_dataset
from datasets import Dataset

from trl_topr import TOPRTrainer


pytestmark = pytest.mark.multiprocess  # each test launches 2 processes (`accelerate launch`, gloo)


def launch_two_processes(script: Path, *arguments: str, timeout: int = 600) -> None:
    """Run `script` with `arguments` on 2 CPU processes (gloo), within `timeout` seconds."""
    launch(script, *arguments, timeout=timeout)


WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import end_processes, make_args
    from datasets import Dataset
    from trl_topr import TOPRTrainer

    def main(model_path, data_path, output_dir):
        trainer = TOPRTrainer(model_path, args=make_args(output_dir, max_steps=2, per_device_train_batch_size=2),
                              train_dataset=Dataset.from_json(data_path))
        trainer.train()
        rank = PartialState().process_index
        with open(f"{{output_dir}}/rank{{rank}}.json", "w") as f:
            json.dump({{"behavior": list(trainer.train_dataset["behavior_logps"]),
                       "world": PartialState().num_processes,
                       "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}}, f)

    main(*sys.argv[1:4])
    end_processes()
    """
)


def varied_lengths_dataset() -> Dataset:
    # Completions of different lengths, so the processes' batches differ in length during the precompute.
    dataset = standard_dataset(10)
    completions = [c + " The answer is 3." * (i % 4) for i, c in enumerate(dataset["completion"])]
    return dataset.remove_columns("completion").add_column("completion", completions)


def test_two_processes_agree_with_one_on_the_behavior_logps(tiny_model_path, tmp_path):
    data_path = tmp_path / "data.jsonl"
    varied_lengths_dataset().to_json(str(data_path))
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    launch_two_processes(script, tiny_model_path, str(data_path), str(output_dir))

    ranks = [json.loads((output_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    single = TOPRTrainer(
        tiny_model_path, args=make_args(tmp_path / "single"), train_dataset=Dataset.from_json(str(data_path))
    )
    expected = single.train_dataset["behavior_logps"]
    for rank in ranks:
        assert rank["world"] == 2
        assert len(rank["behavior"]) == len(expected)
        for got, want in zip(rank["behavior"], expected):
            assert len(got) == len(want)
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert rank["losses"] == ranks[0]["losses"]  # metrics are gathered: every rank logs the same


LOOP_WORKER = textwrap.dedent(
    """
    import hashlib, json, re, sys
    sys.path.insert(0, {tests!r})
    import torch
    from accelerate import PartialState
    from conftest import end_processes, make_args
    from datasets import Dataset
    from trl_topr import LoopCallback, TOPRLoopConfig, TOPRTrainer, run_topr_loop

    def digest(model):  # weights as this process holds them after training
        h = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            h.update(name.encode()); h.update(tensor.detach().float().cpu().numpy().tobytes())
        return h.hexdigest()

    save_model = TOPRTrainer.save_model
    def recording_save_model(self, output_dir=None, _internal_call=False):
        with open(f"{{output_dir}}/weights-rank{{PartialState().process_index}}.txt", "w") as f:
            f.write(digest(self.model))
        return save_model(self, output_dir, _internal_call)
    TOPRTrainer.save_model = recording_save_model

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if a in c[-1]["content"] else -1.0 for c, a in zip(completions, answer)]

    def judged(prompts, completions, answer, **kwargs):  # a judge that scores differently on each call (process)
        return [r + 0.25 * PartialState().process_index for r in correct(prompts, completions, answer)]

    class Records(LoopCallback):  # what each process holds of each round
        seen = []
        def on_round_end(self, metrics):
            self.seen.append(metrics)

    prompts = Dataset.from_dict({{"prompt": [[{{"role": "user", "content": f"What is {{i}} + 3?"}}] for i in range(6)],
                                 "answer": [str(i + 3) for i in range(6)]}})
    last_number = lambda text: (re.findall(r"\\d+", text) or [None])[-1]
    rounds = run_topr_loop(sys.argv[1], prompts, judged, TOPRLoopConfig(num_generations=2, max_completion_length=6),
                           make_args(sys.argv[2], max_steps=-1, per_device_train_batch_size=2),
                           eval_prompts=prompts.select(range(3)), correct_func=correct, answer_func=last_number,
                           callbacks=[Records()])
    with open(f"{{sys.argv[2]}}/rounds-rank{{PartialState().process_index}}.json", "w") as f:
        json.dump({{"rounds": rounds, "seen": Records.seen}}, f)
    end_processes()
    """
)


def test_loop_under_two_processes_trains_the_same_weights_everywhere(tiny_model_path, tmp_path):
    script = tmp_path / "loop_worker.py"
    script.write_text(LOOP_WORKER.format(tests=str(Path(__file__).parent)))
    output_dir = tmp_path / "loop"
    launch_two_processes(script, tiny_model_path, str(output_dir))
    round_dir = output_dir / "round-1"
    digests = [(round_dir / f"weights-rank{r}.txt").read_text() for r in (0, 1)]
    assert digests[0] == digests[1]
    recorded = [json.loads((output_dir / f"rounds-rank{r}.json").read_text()) for r in (0, 1)]
    rounds = [r["rounds"] for r in recorded]
    assert rounds[0] == rounds[1] and [r["round"] for r in rounds[0]] == [0, 1]
    assert rounds[0][1]["num_samples"] == 12  # 6 prompts x 2 samples, split across the processes and gathered
    # the rewards are the main process's, on every process: a judge that differs by call (scoring 0.25 higher on the
    # second process) gives all of them the same rows to curate and train, and the same round metrics
    assert recorded[0]["seen"] == recorded[1]["seen"] and len(recorded[0]["seen"]) == 2
    assert len((round_dir / "samples.jsonl").read_text().splitlines()) == 12


TOOL_WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import TOOL_PROMPT, end_processes, make_args, multiply
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl_topr import TOPRLoopConfig, TOPRTrainer, run_topr_loop, sample_completions
    from trl_topr.generation import SamplingSettings

    def multiply_here(a: int, b: int) -> int:
        \"\"\"
        Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        \"\"\"
        rank = PartialState().process_index
        with open(f"{{out}}/calls-rank{{rank}}.txt", "a") as f:  # where the tool ran
            f.write("called\\n")
        return a * b + 1000 * rank  # differs by process: must run once, and be shared
    multiply_here.__name__ = "multiply"

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c[-1]["role"] == "assistant" and a in c[-1]["content"] else -1.0
                for c, a in zip(completions, answer)]

    path, out = sys.argv[1], sys.argv[2]
    args = make_args(f"{{out}}/loop", max_steps=-1, per_device_train_batch_size=2, learning_rate=1e-5)  # 2 CPU procs
    rank = PartialState().process_index
    prompts = Dataset.from_dict({{"prompt": [TOOL_PROMPT] * 4, "answer": ["56"] * 4}})
    samples = sample_completions(AutoModelForCausalLM.from_pretrained(path), prompts, correct, args=args,
                                 processing_class=AutoTokenizer.from_pretrained(path), tools=[multiply_here],
                                 sampling=SamplingSettings(temperature=0.0, max_new_tokens=200), progress=False)
    columns = ["completion", "completion_ids", "tool_mask", "tool_call_count", "behavior_logps"]
    with open(f"{{out}}/samples-rank{{rank}}.json", "w") as f:
        json.dump(samples.select_columns(columns).to_list(), f)
    # the trainer on 2 processes: its precompute of mu, and the ratio with mu = pi - 0.5 on the generated tokens
    unscored = samples.remove_columns("behavior_logps")
    precomputed = TOPRTrainer(path, args=args, train_dataset=unscored).train_dataset
    by_ids = {{tuple(r["input_ids"]): r["behavior_logps"] for r in precomputed}}
    shifted = samples.remove_columns("behavior_logps").add_column(
        "behavior_logps", [sum(v) - 0.5 for v in samples["behavior_logps"]])
    ratio = TOPRTrainer(path, args=args, train_dataset=shifted, eval_dataset=shifted).evaluate()
    with open(f"{{out}}/trainer-rank{{rank}}.json", "w") as f:
        ids = zip(samples["prompt_ids"], samples["completion_ids"])
        json.dump({{"precomputed": [by_ids[tuple(p + c)] for p, c in ids],
                   "log_ratio_mean": ratio["eval_log_ratio_mean"], "log_ratio_min": ratio["eval_log_ratio_min"]}}, f)
    loop_args = TOPRLoopConfig(num_rounds=2, replay_rounds=1, num_generations=2, max_completion_length=200)
    rounds = run_topr_loop(path, prompts, correct, loop_args, args, tools=[multiply])
    with open(f"{{out}}/rounds-rank{{rank}}.json", "w") as f:
        json.dump(rounds, f)

    class Multiplier:  # an environment whose steps differ by process: they must run once, on the main process
        def reset(self, **row):
            with open(f"{{out}}/resets-rank{{PartialState().process_index}}.txt", "a") as f:
                f.write("reset\\n")
            self.answer, self.results = row["answer"], []

        def multiply(self, a: int, b: int) -> int:
            rank = PartialState().process_index
            with open(f"{{out}}/environment-calls-rank{{rank}}.txt", "a") as f:
                f.write("called\\n")
            self.results.append(a * b + 1000 * rank)
            return self.results[-1]

        multiply.__doc__ = multiply_here.__doc__  # its schema for the policy: the same tool

        def get_reward(self) -> float:
            return 1.0 if [str(r) for r in self.results] == [self.answer] else -1.0

    loop_args = TOPRLoopConfig(num_rounds=1, num_generations=2, max_completion_length=200)
    args = make_args(f"{{out}}/environment-loop", max_steps=-1, per_device_train_batch_size=2, learning_rate=1e-5)
    rounds = run_topr_loop(path, prompts, [], loop_args, args, environment_factory=Multiplier)
    with open(f"{{out}}/environment-rank{{rank}}.json", "w") as f:
        json.dump(rounds, f)
    end_processes()
    """
)


def test_tools_run_once_and_the_loop_replays_trajectories_under_two_processes(tool_policy, tmp_path):
    script = tmp_path / "tool_worker.py"
    script.write_text(TOOL_WORKER.format(tests=str(Path(__file__).parent)))
    launch_two_processes(script, tool_policy, str(tmp_path), timeout=900)
    samples = [json.loads((tmp_path / f"samples-rank{r}.json").read_text()) for r in (0, 1)]
    # every process holds the same trajectories, whose tool results the main process computed once
    assert samples[0] == samples[1] and len(samples[0]) == 4
    assert len((tmp_path / "calls-rank0.txt").read_text().splitlines()) == 4  # once per call, on the main process
    assert not (tmp_path / "calls-rank1.txt").exists()
    assert all(s["tool_call_count"] == 1 and s["completion"][1]["content"] == "56" for s in samples[0])
    assert all(0 < sum(s["tool_mask"]) < len(s["completion_ids"]) for s in samples[0])
    # the trainer on 2 processes counts the generated tokens only: its mu is the sampler's, token for token, and
    # with mu = pi - 0.5 over them every sequence's log-ratio is 0.5
    for rank in (0, 1):
        trainer = json.loads((tmp_path / f"trainer-rank{rank}.json").read_text())
        for computed, sampled in zip(trainer["precomputed"], samples[0]):
            assert len(computed) == len(sampled["behavior_logps"]) == sum(sampled["tool_mask"])
            assert max(abs(a - b) for a, b in zip(computed, sampled["behavior_logps"])) < 1e-4
        assert abs(trainer["log_ratio_mean"] - 0.5) < 1e-3 and abs(trainer["log_ratio_min"] - 0.5) < 1e-3
    rounds = [json.loads((tmp_path / f"rounds-rank{r}.json").read_text()) for r in (0, 1)]
    assert rounds[0] == rounds[1] and [r["round"] for r in rounds[0]] == [0, 1, 2]
    assert rounds[0][2]["num_train_rows"] == 16  # round 2's 8 samples and round 1's, replayed
    assert rounds[0][1]["tools/call_frequency"] > 0  # sampled by the initial policy, which calls
    # environment_factory: every trajectory's reset, tool calls and reward on the main process, shared with the other
    # (the tool's result differs by process: run on process 1, its reward would be -1 there and the rounds differ)
    rounds = [json.loads((tmp_path / f"environment-rank{r}.json").read_text()) for r in (0, 1)]
    assert rounds[0] == rounds[1] and rounds[0][1]["num_samples"] == 8
    assert rounds[0][1]["reward"] > -1.0  # some trajectories called multiply(7, 8) once, with process 0's result
    assert len((tmp_path / "resets-rank0.txt").read_text().splitlines()) == 8  # one reset per trajectory
    assert not (tmp_path / "resets-rank1.txt").exists()
    assert (tmp_path / "environment-calls-rank0.txt").exists()
    assert not (tmp_path / "environment-calls-rank1.txt").exists()


LATE_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import end_processes, make_args
    from datasets import Dataset
    from trl_topr import TOPRLoopConfig, run_topr_loop

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if a in c[-1]["content"] else -1.0 for c, a in zip(completions, answer)]

    path, output_dir = sys.argv[1], sys.argv[2]
    # the process group, with a timeout: where the processes run different collectives, they fail within a minute
    args = make_args(output_dir, max_steps=-1, per_device_train_batch_size=2, ddp_timeout=60)
    rank = PartialState().process_index
    if rank == 1:  # starts late: after the main process wrote round 0's line, where it can (at most 20 s)
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(output_dir, "metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        with open(os.path.join(output_dir + "-late.txt"), "w") as f:
            f.write(str(os.path.exists(os.path.join(output_dir, "metrics.jsonl"))))
    prompts = Dataset.from_dict({{"prompt": [[{{"role": "user", "content": f"What is {{i}} + 3?"}}] for i in range(4)],
                                 "answer": [str(i + 3) for i in range(4)]}})
    # no evaluation prompts: round 0 runs no collective, and the main process writes its line at once
    rounds = run_topr_loop(path, prompts, correct, TOPRLoopConfig(num_generations=2, max_completion_length=4), args)
    with open(f"{{output_dir}}-rounds-rank{{rank}}.json", "w") as f:
        json.dump(rounds, f)
    end_processes()
    """
)


def test_a_process_that_starts_late_runs_the_rounds_the_main_process_runs(tiny_model_path, tmp_path):
    # The main process may write round 0's line before the other reads which rounds are done: the rounds to run are
    # read by the main process alone and shared, so a late process still runs round 0 (each process reading the file
    # on its own, the late one skipped round 0 and every collective after was one off: a hang)
    script = tmp_path / "late_worker.py"
    script.write_text(LATE_WORKER.format(tests=str(Path(__file__).parent)))
    output_dir = tmp_path / "loop"
    launch(script, tiny_model_path, str(output_dir), timeout=400)
    rounds = [json.loads((tmp_path / f"loop-rounds-rank{r}.json").read_text()) for r in (0, 1)]
    assert rounds[0] == rounds[1] and [r["round"] for r in rounds[0]] == [0, 1]


PRIMITIVES_WORKER = textwrap.dedent(
    """
    import json, sys
    from accelerate import PartialState
    from trl_topr.distributed import (ProcessFailedError, ProcessesDivergedError, agree, map_across_processes,
                                      on_main_process, together)

    state = PartialState(cpu=True)
    rank, caught = state.process_index, {{}}

    def record(name, call):
        try:
            caught[name] = ["returned", call()]
        except Exception as error:
            caught[name] = [type(error).__name__, str(error)]

    def fails_on(process):
        def work(*args):
            if rank == process:
                raise ValueError(f"bad input on process {{rank}}")
            return args[0] if args else "done"
        return work

    record("main_fails", lambda: on_main_process(fails_on(0), step="writing a file"))
    record("main_returns", lambda: on_main_process(lambda: {{"rounds": [0, 1]}}, step="reading"))
    record("main_at_another_step", lambda: on_main_process(lambda: 1, step=f"step {{rank}}"))
    record("share_fails", lambda: map_across_processes([1, 2, 3], fails_on(1)))
    record("shares", lambda: map_across_processes([1, 2, 3], lambda share, first: [x * 10 for x in share]))
    record("diverged", lambda: agree(f"round {{rank + 1}}: start"))
    def block():
        with together("a callback"):
            fails_on(1)()
    record("together_fails", block)
    import torch
    from trl_topr.distributed import check_holds_weights
    model = torch.nn.Linear(2, 2, device="meta" if rank == 1 else "cpu")  # as FSDP's RAM-efficient loading leaves it
    record("meta", lambda: check_holds_weights(model))
    record("agreed", lambda: agree("the end"))
    with open(f"{{sys.argv[1]}}/caught-rank{{rank}}.json", "w") as f:
        json.dump(caught, f)
    state.destroy_process_group()
    """
)


def test_every_process_stops_where_one_fails_or_they_diverge(tmp_path):
    script = tmp_path / "primitives.py"
    script.write_text(PRIMITIVES_WORKER.format())
    launch(script, str(tmp_path), timeout=120)
    caught = [json.loads((tmp_path / f"caught-rank{r}.json").read_text()) for r in (0, 1)]
    # the work on the main process raised: there, its own error; on the other, an error naming it, not a hang
    assert caught[0]["main_fails"] == ["ValueError", "bad input on process 0"]
    assert caught[1]["main_fails"][0] == "ProcessFailedError"
    assert (
        "Process 0 of 2 failed at 'writing a file' (ValueError: bad input on process 0)" in caught[1]["main_fails"][1]
    )
    assert caught[0]["main_returns"] == caught[1]["main_returns"] == ["returned", {"rounds": [0, 1]}]
    assert caught[0]["main_at_another_step"] == ["returned", 1]  # the main process cannot see the others' steps
    assert caught[1]["main_at_another_step"][0] == "ProcessesDivergedError"
    assert "process 0 at 'step 0'; process 1 at 'step 1'" in caught[1]["main_at_another_step"][1]
    # a share's work raised on process 1: every process stops
    assert caught[1]["share_fails"] == ["ValueError", "bad input on process 1"]
    assert caught[0]["share_fails"][0] == "ProcessFailedError" and "Process 1 of 2" in caught[0]["share_fails"][1]
    assert caught[0]["shares"] == caught[1]["shares"] == ["returned", [10, 20, 30]]
    # processes at different steps: both raise, each naming both steps
    for rank in (0, 1):
        assert caught[rank]["diverged"][0] == "ProcessesDivergedError"
        assert "process 0 at 'round 1: start'; process 1 at 'round 2: start'" in caught[rank]["diverged"][1]
    assert caught[1]["together_fails"] == ["ValueError", "bad input on process 1"]
    assert caught[0]["together_fails"][0] == "ProcessFailedError" and "'a callback'" in caught[0]["together_fails"][1]
    for rank in (0, 1):  # one process without weights: both raise, before either computes with them
        assert caught[rank]["meta"][0] == "ValueError" and "Process(es) [1] hold no weights" in caught[rank]["meta"][1]
    assert caught[0]["agreed"] == caught[1]["agreed"] == ["returned", None]  # and they still go on together


STALLED_WORKER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import make_args
    from datasets import Dataset
    from trl_topr import LoopCallback, TOPRLoopConfig, run_topr_loop

    class Stalls(LoopCallback):  # the main process stops answering as round 1 starts (a stuck reward, a dead disk)
        def on_round_begin(self, round_index):
            if PartialState().is_main_process:
                time.sleep(240)

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if a in c[-1]["content"] else -1.0 for c, a in zip(completions, answer)]

    args = make_args(sys.argv[2], max_steps=-1, per_device_train_batch_size=2, ddp_timeout=15)
    prompts = Dataset.from_dict({{"prompt": [[{{"role": "user", "content": f"What is {{i}} + 3?"}}] for i in range(2)],
                                 "answer": [str(i + 3) for i in range(2)]}})
    run_topr_loop(sys.argv[1], prompts, correct, TOPRLoopConfig(num_generations=2, max_completion_length=4), args,
                  callbacks=[Stalls()])
    """
)


def test_a_stalled_process_becomes_an_error_that_names_its_step_within_ddp_timeout(tiny_model_path, tmp_path):
    # Without an error from anywhere, the waiting process gives up after the process group's timeout (`ddp_timeout`,
    # 15 s here) and says where it was; the launcher then stops the stalled one
    script = tmp_path / "stalled_worker.py"
    script.write_text(STALLED_WORKER.format(tests=str(Path(__file__).parent)))
    start = time.monotonic()
    result = launch(script, tiny_model_path, str(tmp_path / "loop"), timeout=300, check=False)
    assert result.returncode != 0
    assert time.monotonic() - start < 200  # start-up, round 0 and 15 s of waiting: well before the stall ends
    assert "Timed out" in result.stdout  # the collective's own error (gloo), with the step the loop was at
    assert "process 1 of 2 stopped at 'round 1: start of the loop'" in result.stdout


STALLED_TRAINER_WORKER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import make_args, standard_dataset
    from transformers import TrainerCallback
    from trl_topr import TOPRTrainer

    class Stalls(TrainerCallback):  # the main process stops answering before its second step
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1 and PartialState().is_main_process:
                time.sleep(240)

    args = make_args(sys.argv[2], max_steps=3, per_device_train_batch_size=2, ddp_timeout=15)
    trainer = TOPRTrainer(sys.argv[1], args=args, train_dataset=standard_dataset(8), callbacks=[Stalls()])
    trainer.train()
    """
)


def test_a_stalled_process_stops_the_trainer_with_the_step_named_within_ddp_timeout(tiny_model_path, tmp_path):
    script = tmp_path / "stalled_trainer.py"
    script.write_text(STALLED_TRAINER_WORKER.format(tests=str(Path(__file__).parent)))
    start = time.monotonic()
    result = launch(script, tiny_model_path, str(tmp_path / "out"), timeout=300, check=False)
    assert result.returncode != 0 and time.monotonic() - start < 200  # well before the stall ends
    assert "Timed out" in result.stdout
    assert "process 1 of 2 stopped at 'training step 2 of 3'" in result.stdout
