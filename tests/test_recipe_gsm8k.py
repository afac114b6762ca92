"""recipes/gsm8k.py on a tiny model: real GSM8K rows, the offline arithmetic task, publishing, two processes."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from conftest import launch
from trl import ModelConfig

from trl_topr import TOPRConfig, TOPRLoopConfig


RECIPES = Path(__file__).resolve().parents[1] / "recipes"
GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"  # a 200-row sample of each split, MIT
sys.path.insert(0, str(RECIPES))

import gsm8k  # noqa: E402


def tiny_run(tiny_model_path, output_dir, **overrides):
    """Arguments of a seconds-long run: 4 training questions, 2 samples each, 2 test questions."""
    script = dict(task="arithmetic", num_shots=1, num_train_prompts=4, num_eval_prompts=2)
    script.update({k: v for k, v in overrides.items() if k in gsm8k.GSM8KArguments.__dataclass_fields__})
    loop = dict(num_generations=2, max_completion_length=8, num_generations_eval=2, sampling_batch_size=8, top_k=0)
    loop.update({k: v for k, v in overrides.items() if k in TOPRLoopConfig.__dataclass_fields__})
    training = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        activation_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
    )
    training.update({k: v for k, v in overrides.items() if k in TOPRConfig.__dataclass_fields__})
    return (
        gsm8k.GSM8KArguments(**script),
        TOPRLoopConfig(**loop),
        TOPRConfig(**training),
        ModelConfig(model_name_or_path=tiny_model_path),
    )


def test_help_documents_every_argument():
    result = subprocess.run(
        [sys.executable, str(RECIPES / "gsm8k.py"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for flag in (
        "--num_generations",
        "--top_k",
        "--curation",
        "--dataset_path",
        "--loss_type",
        "--use_peft",
        "--load_in_4bit",
        "--config",
    ):
        assert flag in result.stdout, flag


def test_solution_rewrite_and_few_shot_prompt():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 24"
    assert gsm8k.solution_text(answer) == "Natalia sold 48/2 = 24 clips in May.\nThe answer is 24."
    problems = gsm8k.arithmetic_problems()
    assert len(problems) == 243 and len({p["question"] for p in problems}) == 243
    prompts = gsm8k.few_shot_prompts(problems[2:4], shots=problems[:2])
    messages = prompts[0]["prompt"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[2]["content"].endswith(f"The answer is {problems[0]['answer'].split('#### ')[1]}.")
    assert messages[-1]["content"] == problems[2]["question"] and prompts[0]["answer"] == problems[2]["answer"]


def test_arithmetic_round_evaluates_before_and_after(tiny_model_path, tmp_path, capsys):
    rounds = gsm8k.main(*tiny_run(tiny_model_path, tmp_path / "out", curation="anna_karenina"))
    assert [r["round"] for r in rounds] == [0, 1]
    assert {"pass@1_greedy", "pass@1", "maj@2", "invalid_rate"} <= set(rounds[0]) & set(rounds[1])
    assert rounds[1]["num_samples"] == 8 and rounds[1]["num_train_rows"] <= 8  # Anna Karenina drops positives
    printed = capsys.readouterr().out
    assert "round 0 = before training" in printed and "| 0 |" in printed and "| 1 |" in printed
    card = (tmp_path / "out" / "round-1" / "README.md").read_text()
    assert "GSM8K evaluation per round" in card and "2503.14286" in card


def test_calculator_flag_offers_the_tool_and_trains_trajectories(tiny_model_path, tmp_path):
    run = tiny_run(tiny_model_path, tmp_path / "out", tools="calculator", max_completion_length=12, max_length=2048)
    rounds = gsm8k.main(*run)  # (the tiny tokenizer spells the tools' schema in many tokens)
    # the evaluation and the round report how often the (untrained, random) policy called it
    assert "tool_call_rate" in rounds[0] and "tool_call_rate" in rounds[1] and "tools/call_frequency" in rounds[1]
    sample = json.loads((tmp_path / "out" / "round-1" / "samples.jsonl").read_text().splitlines()[0])
    assert len(sample["tool_mask"]) == len(sample["completion_ids"])
    # the worked example calls the calculator and reads its result before it answers
    roles = [(m["role"], bool(m.get("tool_calls"))) for m in sample["prompt"]]
    assert roles[2:5] == [("assistant", True), ("tool", False), ("assistant", False)]


def test_calculator_evaluates_arithmetic_only():
    from trl_topr.tasks import calculator

    assert [calculator(e) for e in ("7 * 8", "48 / 2", "(3 + 4) * 2 - 1", "10 / 4", "-3 * 2")] == [
        "56",
        "24",
        "13",
        "2.5",
        "-6",
    ]
    for bad in ('__import__("os").system("ls")', "2 ** 99999999", "x + 1", "[1] * 3"):
        with pytest.raises(ValueError, match="not an arithmetic expression"):
            calculator(bad)


def test_num_rounds_0_evaluates_and_exits_cleanly(tiny_model_path, tmp_path, capsys):
    # Evaluation only: round 0's line and its prompts' outcomes, no model, no model card; the summary says nothing
    # was trained
    rounds = gsm8k.main(*tiny_run(tiny_model_path, tmp_path / "out", num_rounds=0))
    assert [r["round"] for r in rounds] == [0] and 0.0 <= rounds[0]["pass@1_greedy"] <= 1.0
    assert sorted(os.listdir(tmp_path / "out")) == ["metrics.jsonl", "metrics.png", "round-0"]
    assert os.listdir(tmp_path / "out" / "round-0") == ["evaluation.jsonl"]
    printed = capsys.readouterr().out
    assert "without training (--num_rounds 0)" in printed and "| 0 |" in printed and "Done in" in printed
    # the same folder again (a resumed evaluation) reads the round back; asking for fewer rounds than it holds fails
    assert gsm8k.main(*tiny_run(tiny_model_path, tmp_path / "out", num_rounds=0)) == rounds
    gsm8k.main(*tiny_run(tiny_model_path, tmp_path / "out", num_rounds=1))
    with pytest.raises(ValueError, match=r"records 1 completed round\(s\), more than `num_rounds` \(0\)"):
        gsm8k.main(*tiny_run(tiny_model_path, tmp_path / "out", num_rounds=0))


def test_num_rounds_0_refuses_to_publish_before_running(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="--push_to_hub with --num_rounds 0"):
        gsm8k.main(*tiny_run(tiny_model_path, tmp_path / "out", num_rounds=0, push_to_hub=True, hub_model_id="u/m"))
    assert not (tmp_path / "out").exists()


def test_real_gsm8k_rows_from_a_local_folder(tiny_model_path, tmp_path):
    rounds = gsm8k.main(
        *tiny_run(
            tiny_model_path,
            tmp_path / "out",
            task="gsm8k",
            dataset_path=str(GSM8K),
            num_shots=2,
            num_train_prompts=3,
            max_length=2048,
        )
    )
    samples = [json.loads(line) for line in (tmp_path / "out" / "round-1" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6
    # the prompts are real GSM8K questions with a 2-shot chain-of-thought context and gold answers
    train = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:5]]
    assert samples[0]["prompt"][-1]["content"] == train[2]["question"]
    assert samples[0]["prompt"][2]["content"].endswith(f"The answer is {train[0]['answer'].split('#### ')[1]}.")
    assert all(s["reward"] in (1.0, -1.0) and s["rewards/invalid"] in (0.0, 1.0) for s in samples)
    assert rounds[1]["invalid_rate"] >= 0.0


def test_push_to_hub_uploads_the_final_model_with_the_evaluation_table(hub, tiny_model_path, tmp_path):
    rounds = gsm8k.main(
        *tiny_run(
            tiny_model_path,
            tmp_path / "topr-gsm8k",
            push_to_hub=True,
            hub_model_id="someone/topr-gsm8k",
            hub_token="hf_secretTOKEN0123456789",
        )
    )
    assert hub["repos"] == ["someone/topr-gsm8k"]
    (commit,) = hub["commits"]
    files = set(commit["files"])
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json"} <= files
    assert "samples.jsonl" not in files
    card = commit["files"]["README.md"].decode()
    assert "- topr" in card and "Tapered Off-Policy REINFORCE" in card
    assert "| round | pass@1_greedy | pass@1 | maj@2 | invalid_rate" in card
    assert f"| 1 | {rounds[1]['pass@1_greedy']:.3f}" in card
    for name, content in commit["files"].items():
        assert b"hf_secretTOKEN" not in content, name


RECIPE_WORKER = textwrap.dedent(
    """
    import hashlib, sys
    sys.path.insert(0, {recipes!r}); sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import end_processes
    from trl_topr import TOPRTrainer
    import gsm8k, test_recipe_gsm8k

    save_model = TOPRTrainer.save_model
    def recording_save_model(self, output_dir=None, _internal_call=False):
        h = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            h.update(name.encode()); h.update(tensor.detach().float().cpu().numpy().tobytes())
        with open(f"{{output_dir}}/weights-rank{{PartialState().process_index}}.txt", "w") as f:
            f.write(h.hexdigest())
        return save_model(self, output_dir, _internal_call)
    TOPRTrainer.save_model = recording_save_model

    gsm8k.main(*test_recipe_gsm8k.tiny_run(sys.argv[1], sys.argv[2], per_device_train_batch_size=2))
    end_processes()
    """
)


@pytest.mark.multiprocess
def test_recipe_under_accelerate_launch_with_two_processes(tiny_model_path, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(RECIPE_WORKER.format(recipes=str(RECIPES), tests=str(Path(__file__).parent)))
    result = launch(script, tiny_model_path, tmp_path / "out")
    digests = [(tmp_path / "out" / "round-1" / f"weights-rank{r}.txt").read_text() for r in (0, 1)]
    assert digests[0] == digests[1]
    assert "round 0 = before training" in result.stdout


EMBEDDED = RECIPES / "configs" / "embedded_cpu.yaml"


def embedded_args(tiny_model_path, output_dir):
    """The embedded default's configuration file, on the tiny model and at a seconds-long size."""
    return gsm8k.make_parser().parse_args_and_config(
        [
            "--config",
            str(EMBEDDED),
            "--model_name_or_path",
            tiny_model_path,
            "--output_dir",
            str(output_dir),
            "--num_train_prompts",
            "4",
            "--num_eval_prompts",
            "2",
            "--num_generations",
            "2",
            "--num_generations_eval",
            "2",
            "--max_completion_length",
            "6",
            "--per_device_train_batch_size",
            "4",
        ]
    )


@pytest.mark.parametrize("fast", [True, False])
def test_embedded_default_picks_the_precision_of_the_hardware(fast, tiny_model_path, tmp_path, monkeypatch):
    import trl_topr.precision

    # a CPU where the precision probe found bf16 3x faster than float32, or 2x slower
    monkeypatch.setattr(trl_topr.precision, "cpu_bf16_speedup", lambda: 3.0 if fast else 0.5)
    _, _, training_args, _ = embedded_args(tiny_model_path, tmp_path)
    assert training_args.bf16 is fast


def test_embedded_default_path_raises_no_deprecation_warning(tiny_model_path, tmp_path, capsys):
    # README's first command on the tiny model: no FutureWarning or DeprecationWarning from our code or from how it
    # calls TRL and transformers. The summary says what was trained, before/after, and where the results are.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rounds = gsm8k.main(*embedded_args(tiny_model_path, tmp_path / "out"))
    deprecations = [
        f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
    ]
    assert not deprecations, deprecations
    printed = capsys.readouterr().out
    assert f"  invalid rate{'':>10}{rounds[0]['invalid_rate']:>8.3f}{rounds[1]['invalid_rate']:>8.3f}" in printed
    assert (
        f"Model: {tmp_path / 'out' / 'round-1'}" in printed and f"Plot:  {tmp_path / 'out' / 'metrics.png'}" in printed
    )
    assert (tmp_path / "out" / "metrics.png").exists() and (
        tmp_path / "out" / "round-1" / "model.safetensors"
    ).exists()
    assert "Done in " in printed


def test_the_card_and_the_records_say_what_the_rounds_trained_with(tiny_model_path, tmp_path):
    # README's first command's configuration sets no baseline: the loop trains TOPR's rounds with its default target
    # positive fraction, and the published card's settings, the round's line, its saved arguments and its trainer state
    # all say so (a one-sided round, which no baseline can balance, trains with baseline 0 and records it beside the
    # target, as every trainer does)
    import torch

    script_args, loop_args, training_args, model_args = embedded_args(tiny_model_path, tmp_path / "out")
    assert training_args.baseline is None and training_args.target_positive_fraction is None
    gsm8k.main(script_args, loop_args, training_args, model_args)
    card = (tmp_path / "out" / "round-1" / "README.md").read_text()
    settings = json.loads(card.split("## Recipe settings")[1].split("```json")[1].split("```")[0])
    assert settings["target_positive_fraction"] == loop_args.default_target_positive_fraction == 0.8
    assert settings["default_target_positive_fraction"] == 0.8
    (line,) = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][1:]
    saved = torch.load(tmp_path / "out" / "round-1" / "training_args.bin", weights_only=False)
    state = json.loads((tmp_path / "out" / "round-1" / "trainer_state.json").read_text())
    logged = {entry.get("target_positive_fraction") for entry in state["log_history"] if "baseline" in entry}
    assert saved.target_positive_fraction == line["target_positive_fraction"]
    assert logged == {saved.target_positive_fraction}
    samples = [json.loads(r) for r in (tmp_path / "out" / "round-1" / "samples.jsonl").read_text().splitlines()]
    assert line["target_positive_fraction"] == 0.8
    if len({row["reward"] for row in samples}) == 1:
        assert line["baseline"] == 0.0
    assert "| reward | baseline | effective_positive_fraction |" in card  # each round's baseline in the table
