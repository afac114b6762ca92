"""The iterative loop end to end on a tiny model (sample -> score -> curate -> train -> evaluate -> save), its
resumption, and the evaluation helper."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import alive, make_args, recording_trainer
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_topr import TOPRDataError, TOPRLoopConfig, evaluate_policy
from trl_topr.distributed import give_back_freed_memory
from trl_topr.generation import GenerationEngine, SamplingSettings
from trl_topr.loop import read_rounds, run_topr_loop


def text(completion):
    return completion[-1]["content"] if isinstance(completion, list) else completion


def last_number(answer_text):
    numbers = re.findall(r"\d+", answer_text)
    return numbers[-1] if numbers else None


def correct(prompts, completions, answer, **kwargs):
    return [1.0 if last_number(text(c)) == a else -1.0 for c, a in zip(completions, answer)]


def reward(prompts, completions, answer, **kwargs):
    # `correct` under the name people reach for first: its column is `rewards/reward`, beside the combined `reward`
    return correct(prompts, completions, answer)


def prompts(n, offset=0):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(offset, offset + n)],
            "answer": [str(i + 3) for i in range(offset, offset + n)],
        }
    )


def test_evaluate_policy_counts_greedy_sampled_majority_and_invalid(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    metrics = evaluate_policy(
        model,
        tokenizer,
        prompts(3),
        correct,
        last_number,
        progress=False,
        sampling=SamplingSettings(num_samples=3, max_new_tokens=8, seed=0),
    )
    assert set(metrics) == {
        "pass@1_greedy",
        "pass@1",
        "maj@3",
        "invalid_rate",
        "invalid_rate_greedy",
        "truncated_rate",
        "mean_length",
    }
    assert all(0.0 <= v <= 1.0 for k, v in metrics.items() if k != "mean_length")
    assert 1.0 <= metrics["mean_length"] <= 8.0
    # an answer function that never finds an answer: everything invalid, no majority
    none = evaluate_policy(
        model,
        tokenizer,
        prompts(2),
        correct,
        lambda t: None,
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=4, seed=0),
    )
    assert none["invalid_rate"] == 1.0 and none["maj@2"] == 0.0


class ScriptedEngine(GenerationEngine):
    # A generation engine that returns given token ids: the greedy ones for greedy settings, else the sampled ones
    def __init__(self, tokenizer, greedy, sampled):
        super().__init__(tokenizer, {tokenizer.eos_token_id})
        self.scripted = {True: greedy, False: sampled}

    def _generate_share(self, prompts, settings, progress):
        return self.scripted[settings.is_greedy], None


def test_evaluate_policy_majority_vote_and_truncation_are_exact(tiny_model_path):
    # Scripted generations: prompt 0's samples answer 3, 3, 9 (majority 3, correct); prompt 1's 9, 9, 4 (majority 9,
    # wrong). Samples 2 and 5 run to max_new_tokens=4 without EOS (truncated), sample 3 ends with EOS at the limit,
    # sample 4 has tokens after its EOS (cut off by the engine).
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    eos = tokenizer.eos_token_id
    three, nine, four = (tokenizer.encode(n, add_special_tokens=False) for n in "394")
    letter = tokenizer.encode("a", add_special_tokens=False)
    assert len(three) == len(nine) == len(four) == len(letter) == 1
    sampled = [
        three + [eos],
        three + letter * 3,
        nine + letter * 2 + [eos],
        nine + [eos] + letter * 2,
        nine + letter * 3,
        four + [eos],
    ]
    engine = ScriptedEngine(tokenizer, greedy=[three + [eos], nine + [eos]], sampled=sampled)
    metrics = evaluate_policy(
        None,
        tokenizer,
        prompts(2),
        correct,
        last_number,
        progress=False,
        engine=engine,
        sampling=SamplingSettings(num_samples=3, max_new_tokens=4, seed=0),
    )
    assert metrics["pass@1_greedy"] == 0.5
    assert metrics["pass@1"] == pytest.approx(3 / 6)
    assert metrics["maj@3"] == 0.5
    assert metrics["invalid_rate"] == 0.0
    assert metrics["truncated_rate"] == pytest.approx(2 / 6)
    assert metrics["mean_length"] == pytest.approx((2 + 4 + 4 + 2 + 4 + 2) / 6)
    # each prompt's outcome, for paired comparisons over prompts: the same generations, counted per prompt
    again, per_prompt = evaluate_policy(
        None,
        tokenizer,
        prompts(2),
        correct,
        lambda text: last_number(text) if "a" not in text else None,  # a trailing letter makes an answer invalid
        progress=False,
        engine=ScriptedEngine(tokenizer, greedy=[three + [eos], nine + [eos]], sampled=sampled),
        sampling=SamplingSettings(num_samples=3, max_new_tokens=4, seed=0),
        return_per_prompt=True,
    )
    assert again["pass@1"] == metrics["pass@1"]
    assert per_prompt == [
        {"greedy_correct": 1, "correct": 2, "invalid": 2},  # "3", "3aaa" (correct, invalid), "9aa" (invalid)
        {"greedy_correct": 0, "correct": 1, "invalid": 1},  # "9" (cut at its EOS), "9aaa" (invalid), "4"
    ]


def test_loop_runs_rounds_writes_metrics_and_resumes(tiny_model_path, tmp_path, monkeypatch):
    args = make_args(tmp_path / "loop", per_device_train_batch_size=4, max_steps=-1, logging_steps=1)
    # a curation given by its dotted path, which drops the last sample: proves the curation step runs
    (tmp_path / "my_curation.py").write_text(
        "def drop_last(samples):\n    return samples.select(range(len(samples) - 1))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    loop_args = TOPRLoopConfig(num_generations=2, max_completion_length=8, curation="my_curation.drop_last")
    kwargs = dict(eval_prompts=prompts(2, offset=10), correct_func=correct, answer_func=last_number)
    rounds = run_topr_loop(tiny_model_path, prompts(4), correct, loop_args, args, **kwargs)
    assert [r["round"] for r in rounds] == [0, 1]
    assert rounds[1]["num_samples"] == 8 and rounds[1]["num_train_rows"] == 7
    for name in (
        "reward",
        "pass@1",
        "pass@1_greedy",
        "maj@2",
        "invalid_rate",
        "effective_positive_fraction",
        "train_loss",
    ):
        assert math.isfinite(rounds[1][name]), name
    round_1 = tmp_path / "loop" / "round-1"
    assert {"model.safetensors", "samples.jsonl", "README.md", "trainer_state.json"} <= set(os.listdir(round_1))
    steps = [h for h in json.loads((round_1 / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(steps) == 2 and all(0.0 <= h["negative_weight_share"] <= 1.0 for h in steps)  # 7 rows, batch 4
    assert (tmp_path / "loop" / "metrics.png").stat().st_size > 0
    samples = [json.loads(line) for line in (round_1 / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all("behavior_logps" in s for s in samples)

    # Killed in round 2 while its metrics line was being written: a partial folder and a cut last line. Restarted
    # with 2 rounds: round 1 is not redone, round 2 is redone from its start, and the cut line is replaced.
    model_time = (round_1 / "model.safetensors").stat().st_mtime_ns
    (tmp_path / "loop" / "round-2").mkdir()
    (tmp_path / "loop" / "round-2" / "partial").write_text("interrupted")
    metrics = tmp_path / "loop" / "metrics.jsonl"
    complete = metrics.read_text()
    metrics.write_text(complete + json.dumps({"round": 2, **rounds[1]})[:40])
    with pytest.warns(UserWarning, match="ends with a cut line"):
        assert read_rounds(str(tmp_path / "loop")) == rounds
    with pytest.warns(UserWarning, match="ends with a cut line"):
        loop_args.num_rounds = 2
        rounds = run_topr_loop(tiny_model_path, prompts(4), correct, loop_args, args, **kwargs)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert (round_1 / "model.safetensors").stat().st_mtime_ns == model_time
    assert not (tmp_path / "loop" / "round-2" / "partial").exists()
    assert metrics.read_text().startswith(complete) and len(metrics.read_text().splitlines()) == 3
    assert read_rounds(str(tmp_path / "loop")) == rounds
    assert not (tmp_path / "loop" / "metrics.jsonl.partial").exists()

    # A damaged line before the last is not a kill's cut: a clear error, not a silent redo
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], lines[1][:20], lines[2]]) + "\n")
    with pytest.raises(ValueError, match="line 2, is not JSON"):
        read_rounds(str(tmp_path / "loop"))


def test_loop_frees_each_rounds_trainer_model_and_optimizer(tiny_model_path, tmp_path, monkeypatch):
    # What a finished round leaves alive adds up round after round (its model and optimizer states: under DeepSpeed
    # ZeRO-3, the whole engine; see tests/test_sharded.py). Checked without a garbage collection of the test's own: a
    # trained model refers to itself (its patched `forward` is a method bound to it), so only a collection frees it,
    # and the loop must not leave that to chance (the next round would load its model and optimizer next to it).
    import trl_topr.loop

    # The round's memory then goes back to the system (glibc's reserve of freed memory otherwise grows round after
    # round): the loop gives it back each round, once nothing of the round is alive to hold it.
    trained, alive_at_give_back = [], []

    def give_back():
        alive_at_give_back.append(alive(trained))
        return give_back_freed_memory()

    monkeypatch.setattr(trl_topr.loop, "TOPRTrainer", recording_trainer(trained))
    monkeypatch.setattr(trl_topr.loop, "give_back_freed_memory", give_back)
    args = make_args(tmp_path / "loop", per_device_train_batch_size=4, max_steps=-1)
    loop_args = TOPRLoopConfig(num_rounds=2, num_generations=2, max_completion_length=4)
    run_topr_loop(tiny_model_path, prompts(2), correct, loop_args, args)
    assert [name for name, _ in trained].count("optimizer") == 2  # both rounds recorded
    assert alive(trained) == []
    assert alive_at_give_back == [[], []]  # once a round, after its trainer went


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_give_back_freed_memory_returns_the_allocators_reserve():
    # In a fresh process: 256 MiB freed in 64 KiB blocks below one that stays (so glibc cannot shrink its heap from the
    # top by itself) stay resident as the allocator's reserve until they are given back.
    code = """
import re
from pathlib import Path
from trl_topr.distributed import give_back_freed_memory
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
blocks = [bytearray(64 * 1024) for _ in range(4096)]
kept = bytearray(64 * 1024)
del blocks
before = rss()
answer = give_back_freed_memory()
print(answer, before - rss())
"""
    answer, given_back = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert answer == "1"
    assert int(given_back) > 200 * 2**20


def test_a_one_sided_round_trains_with_baseline_0_under_a_target_fraction(tiny_model_path, tmp_path):
    # A round where every sample is wrong (or every one right) cannot meet `target_positive_fraction`: the loop goes
    # on with baseline 0, as the online trainer does for such a batch, instead of stopping (TOPRTrainer alone raises).
    def mixed(prompts, completions, **kwargs):
        return [1.0 if i % 2 else -1.0 for i in range(len(completions))]

    def always_wrong(prompts, completions, **kwargs):
        return [-1.0] * len(completions)

    loop_args = TOPRLoopConfig(num_generations=2, max_completion_length=4)
    for name, reward, baseline in (("mixed", mixed, -0.6), ("wrong", always_wrong, 0.0)):
        args = make_args(tmp_path / name, per_device_train_batch_size=4, max_steps=-1, target_positive_fraction=0.8)
        rounds = run_topr_loop(tiny_model_path, prompts(2), reward, loop_args, args)
        logs = json.loads((tmp_path / name / "round-1" / "trainer_state.json").read_text())["log_history"]
        assert [h["baseline"] for h in logs if "baseline" in h] == [pytest.approx(baseline)], name
        assert rounds[1]["effective_positive_fraction"] == pytest.approx(0.8 if name == "mixed" else 0.0)


def test_loop_evaluates_named_sets_as_trl_eval_dataset_dicts(tiny_model_path, tmp_path):
    # A dict of held-out sets: each evaluated every round, its metrics named after it, and equal to the metrics of the
    # same set given alone (the same engine, prompts and sampling seed)
    options = dict(correct_func=correct, answer_func=last_number)
    loop_args = TOPRLoopConfig(num_rounds=0, num_generations=2, max_completion_length=8)
    sets = {"validation": prompts(2, offset=10), "test": prompts(3, offset=20)}
    named = run_topr_loop(
        tiny_model_path, prompts(2), correct, loop_args, make_args(tmp_path / "named"), eval_prompts=sets, **options
    )[0]
    for name, dataset in sets.items():
        alone = run_topr_loop(
            tiny_model_path,
            prompts(2),
            correct,
            loop_args,
            make_args(tmp_path / name),
            eval_prompts=dataset,
            **options,
        )[0]
        assert {key: value for key, value in alone.items() if key != "round"} == {
            key.removeprefix(f"{name}/"): value for key, value in named.items() if key.startswith(f"{name}/")
        }
    assert "pass@1" not in named and {"validation/pass@1", "test/pass@1_greedy"} <= set(named)
    # each prompt's outcome, one line per prompt of each set, agreeing with the set's metrics
    for name, dataset in sets.items():
        lines = (tmp_path / "named" / "round-0" / f"evaluation-{name}.jsonl").read_text().splitlines()
        outcomes = [json.loads(line) for line in lines]
        assert len(outcomes) == len(dataset)
        assert sum(o["correct"] for o in outcomes) / (2 * len(dataset)) == named[f"{name}/pass@1"]
        assert sum(o["greedy_correct"] for o in outcomes) / len(dataset) == named[f"{name}/pass@1_greedy"]
    bad = prompts(2).rename_column("prompt", "question")
    with pytest.raises(TOPRDataError, match="eval prompts 'test'"):
        run_topr_loop(
            tiny_model_path,
            prompts(2),
            correct,
            loop_args,
            make_args(tmp_path / "bad"),
            eval_prompts={"validation": prompts(2), "test": bad},
            **options,
        )
    with pytest.raises(ValueError, match="empty dict"):
        run_topr_loop(
            tiny_model_path, prompts(2), correct, loop_args, make_args(tmp_path / "bad"), eval_prompts={}, **options
        )
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_prompts_per_round_go_through_the_prompts_as_epochs(tiny_model_path, tmp_path):
    # 5 prompts, 2 a round: rounds 1, 2, 3 sample prompts 0-1, 2-3, then 4 and 0 (the start again)
    loop_args = TOPRLoopConfig(num_rounds=3, num_generations=2, max_completion_length=4, prompts_per_round=2)
    run_topr_loop(tiny_model_path, prompts(5), correct, loop_args, make_args(tmp_path / "loop"))
    sampled = []
    for r in (1, 2, 3):
        rows = [json.loads(line) for line in (tmp_path / "loop" / f"round-{r}" / "samples.jsonl").open()]
        sampled.append(sorted({int(row["answer"]) - 3 for row in rows}))
        assert len(rows) == 4  # 2 prompts x 2 samples
    assert sampled == [[0, 1], [2, 3], [0, 4]]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prompts_per_round"):
            TOPRLoopConfig(prompts_per_round=bad)
    with pytest.raises(ValueError, match="prompts_per_round"):  # more than the 5 prompts
        run_topr_loop(
            tiny_model_path, prompts(5), correct, TOPRLoopConfig(prompts_per_round=6), make_args(tmp_path / "bad")
        )
    assert not (tmp_path / "bad").exists()


def test_evaluation_needs_its_functions(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="correct_func"):
        run_topr_loop(tiny_model_path, prompts(2), correct, None, make_args(tmp_path), eval_prompts=prompts(2))


def test_loop_with_lora_merges_each_rounds_adapter(tiny_model_path, tmp_path):
    from peft import LoraConfig

    args = make_args(tmp_path / "lora", per_device_train_batch_size=4, max_steps=-1, learning_rate=1e-2)
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    loop_args = TOPRLoopConfig(num_rounds=2, num_generations=2, max_completion_length=8)
    rounds = run_topr_loop(tiny_model_path, prompts(4), correct, loop_args, args, peft_config=peft_config)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in (1, 2):
        files = set(os.listdir(tmp_path / "lora" / f"round-{r}"))
        assert {"model.safetensors", "config.json", "README.md", "adapter"} <= files
        assert "adapter_model.safetensors" in os.listdir(tmp_path / "lora" / f"round-{r}" / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "round-1")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    changed = [n for (n, a), b in zip(initial.named_parameters(), merged.parameters()) if not a.equal(b)]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)  # the merged adapter, nothing else


def test_quantized_loop_needs_an_adapter(tiny_model_path, tmp_path):
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError, match="peft_config"):
        run_topr_loop(
            tiny_model_path,
            prompts(2),
            correct,
            None,
            make_args(tmp_path),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )


def test_loop_replays_earlier_rounds_with_the_behavior_logps_recorded_when_sampled(tiny_model_path, tmp_path):
    # replay_rounds=2: round r trains on its rows and those of rounds r-1 and r-2, read from their train.jsonl with
    # the mu of their own round. Run for 2 rounds, then resumed for a third after round 1's weights were deleted.
    from trl_topr.logprobs import LogpsSettings, behavior_logps, completion_row

    args = make_args(
        tmp_path / "replay", per_device_train_batch_size=4, max_steps=-1, logging_steps=1, learning_rate=1e-2
    )
    loop_args = TOPRLoopConfig(num_rounds=2, num_generations=2, max_completion_length=6, replay_rounds=2)
    rounds = run_topr_loop(tiny_model_path, prompts(3), reward, loop_args, args)
    folder = tmp_path / "replay"
    (folder / "round-1" / "model.safetensors").unlink()  # replay reads rows, never an old round's weights
    loop_args.num_rounds = 3
    rounds = run_topr_loop(tiny_model_path, prompts(3), reward, loop_args, args)
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert "age_1/rows" not in rounds[1] and rounds[1]["age_0/rows"] == 6
    assert rounds[2]["age_0/rows"] == rounds[2]["age_1/rows"] == 6 and "age_2/rows" not in rounds[2]
    assert rounds[3]["age_0/rows"] == rounds[3]["age_1/rows"] == rounds[3]["age_2/rows"] == 6
    assert rounds[3]["num_train_rows"] == 18
    steps = [
        h for h in json.loads((folder / "round-3" / "trainer_state.json").read_text())["log_history"] if "loss" in h
    ]
    assert len(steps) == 5  # 18 rows, batch 4: the round trained on the replayed rows too
    # Own rows on arrival have ratio 1; round 1's rows, under round 3's starting policy (round 2's model), are off by
    # exactly log pi_round2 - log mu_round1, with mu as recorded in round 1's samples
    assert abs(rounds[3]["age_0/log_ratio_mean"]) < 1e-4
    old = [json.loads(line) for line in (folder / "round-1" / "samples.jsonl").read_text().splitlines()]
    saved = [json.loads(line) for line in (folder / "round-1" / "train.jsonl").read_text().splitlines()]
    assert [r["behavior_logps"] for r in saved] == [r["behavior_logps"] for r in old] and all(
        r["sample_round"] == 1 for r in saved
    )
    assert all(r["rewards/reward"] == r["reward"] in (1.0, -1.0) for r in saved)  # a function named `reward`
    model = AutoModelForCausalLM.from_pretrained(folder / "round-2")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [completion_row(r["prompt_ids"], r["completion_ids"]) for r in old]
    pi = behavior_logps(model, rows, LogpsSettings(tokenizer.pad_token_id))
    expected = [sum(p) - sum(r["behavior_logps"]) for p, r in zip(pi, old)]
    assert abs(rounds[3]["age_2/log_ratio_mean"] - sum(expected) / len(expected)) < 1e-3
    assert abs(rounds[3]["age_2/log_ratio_mean"]) > 1e-2  # the policy moved: these rows are off-policy
    assert rounds[3]["age_2/log_ratio_min"] <= rounds[3]["age_2/log_ratio_mean"]
    shares = [rounds[3][f"age_{k}/weight_share"] for k in range(3)]
    assert abs(sum(shares) - 1) < 1e-6 and all(0 <= s <= 1 for s in shares)
    with pytest.raises(ValueError, match="replay_rounds"):
        TOPRLoopConfig(replay_rounds=-1)


def test_loop_trains_num_train_epochs_per_round(tiny_model_path, tmp_path):
    # Each round trains `args.num_train_epochs` on its own data (TOPRConfig's default: the paper's one epoch)
    args = make_args(
        tmp_path / "epochs", per_device_train_batch_size=4, max_steps=-1, logging_steps=1, num_train_epochs=2
    )
    run_topr_loop(
        tiny_model_path, prompts(3), correct, TOPRLoopConfig(num_generations=2, max_completion_length=6), args
    )
    state = json.loads((tmp_path / "epochs" / "round-1" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["epoch"] == 2  # 6 rows, batch 4: 2 steps an epoch
    from trl_topr import TOPRConfig

    assert TOPRConfig(output_dir=str(tmp_path / "default")).num_train_epochs == 1


def test_loop_callbacks_see_every_round_and_can_stop_the_loop(tiny_model_path, tmp_path):
    # Each round: begin, its trainer, its recorded line, in that order (round 0: its line only). An exception in a
    # callback stops the loop there; the rounds recorded stay, and the loop resumes from them.
    from trl_topr.loop import LoopCallback

    class Record(LoopCallback):
        def __init__(self, stop_at=None):
            self.events, self.stop_at = [], stop_at

        def on_round_begin(self, round_index):
            if round_index == self.stop_at:
                raise KeyboardInterrupt(round_index)
            self.events.append(("begin", round_index))

        def on_trainer_created(self, round_index, trainer):
            self.events.append(("trainer", round_index, type(trainer).__name__, len(trainer.train_dataset)))

        def on_round_end(self, metrics):
            self.events.append(("end", metrics["round"]))

    args = make_args(tmp_path / "loop", per_device_train_batch_size=4, max_steps=1)
    loop_args = TOPRLoopConfig(num_rounds=3, num_generations=2, max_completion_length=4)
    stopper = Record(stop_at=2)
    with pytest.raises(KeyboardInterrupt):
        run_topr_loop(tiny_model_path, prompts(2), correct, loop_args, args, callbacks=[stopper])
    assert stopper.events == [("end", 0), ("begin", 1), ("trainer", 1, "TOPRTrainer", 4), ("end", 1)]
    assert [r["round"] for r in read_rounds(str(tmp_path / "loop"))] == [0, 1]
    again = Record()
    loop_args.num_rounds = 2
    rounds = run_topr_loop(tiny_model_path, prompts(2), correct, loop_args, args, callbacks=[again])
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert again.events == [("begin", 2), ("trainer", 2, "TOPRTrainer", 4), ("end", 2)]


def test_a_new_engine_is_one_registry_entry(tiny_model_path, tmp_path, monkeypatch):
    # The factory picks the engine by name in ENGINES: an engine registered under the name a configuration selects is
    # what sampling and the loop generate with, built by its `from_config`.
    import trl_topr.generation as generation
    from trl_topr import sample_completions
    from trl_topr.generation import ENGINES, TransformersEngine, engine_name, generation_engine

    assert engine_name(None) == engine_name(TOPRLoopConfig()) == "transformers"
    assert engine_name(TOPRLoopConfig(use_vllm=True)) == "vllm"
    assert set(ENGINES) == {"transformers", "vllm"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    built = generation_engine(model, tokenizer, TOPRLoopConfig(), make_args(tmp_path, bf16=False))
    assert type(built) is TransformersEngine and built.bf16 is False and built.model is model
    assert generation_engine(model, tokenizer).bf16 is None  # no configuration: the engine's defaults

    made = []

    class CountingEngine(TransformersEngine):
        @classmethod
        def from_config(cls, model, processing_class, args=None, **options):
            made.append(options["bf16"])
            return super().from_config(model, processing_class, args, **options)

        def _generate_share(self, prompts, settings, progress):
            made.append(len(prompts))
            return super()._generate_share(prompts, settings, progress)

    monkeypatch.setitem(generation.ENGINES, "transformers", CountingEngine)
    args = make_args(tmp_path)
    data = sample_completions(
        model,
        prompts(3),
        correct,
        processing_class=tokenizer,
        args=args,
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=4),
    )
    assert len(data) == 6 and made == [args.bf16, 3]  # built for the training's precision, then it generated


def test_the_loop_trains_topr_with_the_target_fraction_08_unless_a_baseline_is_set(tiny_model_path, tmp_path):
    # The loop's default for TOPR (docs/benchmarks.md, "What to set"): each round's baseline for p_eff = 0.8; the
    # paper's baseline 0 one flag away; another loss keeps baseline 0
    def mixed(prompts, completions, **kwargs):
        return [1.0 if i % 4 == 0 else -1.0 for i in range(len(completions))]

    loop_args = TOPRLoopConfig(num_generations=2, max_completion_length=4)
    for name, options, p_eff in (
        ("default", {}, 0.8),
        ("paper", {"baseline": 0.0}, 0.25),
        ("positives_only", {"loss_type": "positives_only"}, 0.25),  # baseline 0: its rewards as they are
    ):
        args = make_args(tmp_path / name, per_device_train_batch_size=4, max_steps=-1, **options)
        rounds = run_topr_loop(tiny_model_path, prompts(4), mixed, loop_args, args)
        assert rounds[1]["effective_positive_fraction"] == pytest.approx(p_eff), name
