"""recipes/verifier.py: the votes on real GSM8K rows, and the end-to-end round on a tiny model (the embedded
configuration's path, resuming, real GSM8K questions, publishing, two processes)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import launch
from test_recipe_gsm8k import GSM8K, RECIPES, gsm8k
from test_rewards import plus_one, read_gsm8k, reasoning

from trl_topr import TOPRConfig, extract_verdict
from trl_topr.rewards import answers_match, gold_answer


sys.path.insert(0, str(RECIPES))

import verifier  # noqa: E402


EMBEDDED = RECIPES / "configs" / "verifier_embedded_cpu.yaml"


def tiny_args(tiny_model_path, output_dir, *extra):
    """The embedded configuration file, on the tiny model and at a seconds-long size."""
    return verifier.make_parser().parse_args_and_config(
        [
            "--config",
            str(EMBEDDED),
            "--model_name_or_path",
            tiny_model_path,
            "--output_dir",
            str(output_dir),
            "--num_train_questions",
            "4",
            "--num_eval_questions",
            "3",
            "--num_solutions",
            "2",
            "--num_rounds",
            "1",
            "--solution_max_new_tokens",
            "6",
            "--num_generations",
            "2",
            "--num_generations_eval",
            "2",
            "--max_completion_length",
            "6",
            "--per_device_train_batch_size",
            "4",
            "--bf16",
            "false",
            *extra,
        ]
    )


def test_help_documents_every_argument():
    result = subprocess.run(
        [sys.executable, str(RECIPES / "verifier.py"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for flag in (
        "--generator_model_name_or_path",
        "--num_solutions",
        "--num_generations",
        "--num_generations_eval",
        "--max_completion_length",
        "--loss_type",
        "--use_peft",
        "--config",
    ):
        assert flag in result.stdout, flag


def test_vote_accuracies_on_real_gsm8k_rows():
    rows = []
    for index, row in enumerate(read_gsm8k("test", 2)):
        gold = gold_answer(row["answer"])
        answers = [plus_one(gold), gold, plus_one(gold)] if index == 0 else [gold, gold, None]
        for answer in answers:
            rows.append(
                {
                    "question_index": index,
                    "answer": row["answer"],
                    "predicted": answer,
                    "correct": answer == gold,
                    "solution": reasoning(row["answer"]),
                }
            )
    # question 0: the majority is wrong, the verifier trusts the one right solution; question 1: all agree
    scores = [0.25, 1.0, 0.0, 0.5, 0.5, 1.0]
    accuracies = verifier.vote_accuracies(rows, scores)
    assert accuracies == {
        "pass@1": pytest.approx((1 / 3 + 2 / 3) / 2),
        "majority_vote": 0.5,
        "verifier_vote": 1.0,
        "best_of_n": 1.0,
    }
    # a verifier that prefers the wrong answer makes the votes wrong
    assert verifier.vote_accuracies(rows, [1.0, 0.0, 1.0, 0.5, 0.5, 1.0])["best_of_n"] == 0.5


def test_embedded_round_end_to_end(tiny_model_path, tmp_path, capsys):
    output_dir = tmp_path / "out"
    results = verifier.main(*tiny_args(tiny_model_path, output_dir))

    solutions = json.loads((output_dir / verifier.SOLUTIONS_FILE).read_text())
    assert len(solutions["train"]) == 4 * 2 and len(solutions["test"]) == 3 * 2
    assert all(
        row["correct"]
        == (row["predicted"] is not None and answers_match(row["predicted"], gold_answer(row["answer"])))
        for row in solutions["train"] + solutions["test"]
    )

    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    for key in ("pass@1_greedy", "pass@1", "invalid_rate", "invalid_rate_greedy"):
        assert 0.0 <= rounds[0][key] <= 1.0 and 0.0 <= rounds[1][key] <= 1.0
    samples = [json.loads(line) for line in (output_dir / "round-1" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 2 * 2  # training solutions x verdicts
    truth = {(row["question"], row["solution"]): row["correct"] for row in solutions["train"]}
    for sample in samples:  # each verdict's reward says whether it matches the truth of the solution it judged
        assert sample["label"] == truth[sample["question"], sample["solution"]]
        verdict = extract_verdict(sample["completion"][-1]["content"])
        assert sample["reward"] == (1.0 if verdict == ("correct" if sample["label"] else "incorrect") else -1.0)
        assert sample["rewards/invalid"] == float(verdict is None)

    test_pass_at_1 = sum(r["correct"] for r in solutions["test"]) / len(solutions["test"])
    for when in ("before", "after"):  # the generator's solutions are the same before and after
        assert results["votes"][when]["pass@1"] == pytest.approx(test_pass_at_1)
        assert all(0.0 <= v <= 1.0 for v in results["votes"][when].values())
    assert json.loads((output_dir / "verifier_results.json").read_text())["votes"] == results["votes"]
    printed = capsys.readouterr().out
    assert "Verifier on the test solutions" in printed and "| best-of-2 |" in printed and "Done in" in printed
    constant = max(test_pass_at_1, 1 - test_pass_at_1)
    assert f"always giving the test split's more frequent verdict scores {constant:.3f}" in printed
    card = (output_dir / "round-1" / "README.md").read_text()
    assert "Verifier evaluation per round" in card and "What the verifier does for answers" in card

    # started again: the same solutions, the loop's finished round is not redone
    mtime = (output_dir / verifier.SOLUTIONS_FILE).stat().st_mtime_ns
    again = verifier.main(*tiny_args(tiny_model_path, output_dir))
    assert (output_dir / verifier.SOLUTIONS_FILE).stat().st_mtime_ns == mtime
    assert again["rounds"] == rounds


def test_num_rounds_0_scores_the_initial_verifier_and_exits_cleanly(tiny_model_path, tmp_path, capsys):
    results = verifier.main(*tiny_args(tiny_model_path, tmp_path / "out", "--num_rounds", "0"))
    assert [r["round"] for r in results["rounds"]] == [0]
    assert results["votes"]["before"] == results["votes"]["after"]  # nothing trained: the same verifier twice
    assert os.listdir(tmp_path / "out" / "round-0") == ["evaluation.jsonl"]  # its prompts' outcomes, no model
    assert "Done in" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--push_to_hub with --num_rounds 0"):
        verifier.main(*tiny_args(tiny_model_path, tmp_path / "hub", "--num_rounds", "0", "--push_to_hub", "true"))
    assert not (tmp_path / "hub").exists()


def test_real_gsm8k_questions_from_a_local_folder(tiny_model_path, tmp_path):
    verifier.main(
        *tiny_args(
            tiny_model_path,
            tmp_path,
            "--task",
            "gsm8k",
            "--dataset_path",
            str(GSM8K),
            "--num_shots",
            "1",
            "--max_length",
            "2048",
        )
    )
    solutions = json.loads((tmp_path / verifier.SOLUTIONS_FILE).read_text())
    train = read_gsm8k("train", 5)
    assert solutions["train"][0]["question"] == train[1]["question"]  # after the one-shot example
    assert solutions["train"][0]["answer"] == train[1]["answer"]
    samples = [json.loads(line) for line in (tmp_path / "round-1" / "samples.jsonl").read_text().splitlines()]
    assert train[1]["question"] in samples[0]["prompt"][-1]["content"]


def test_push_to_hub_publishes_the_verifier_with_its_votes(hub, tiny_model_path, tmp_path):
    verifier.main(
        *tiny_args(
            tiny_model_path,
            tmp_path / "topr-verifier",
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "someone/topr-verifier",
        )
    )
    assert hub["repos"] == ["someone/topr-verifier"]
    (commit,) = hub["commits"]
    card = commit["files"]["README.md"].decode()
    assert "| verifier-weighted vote of 2 |" in card and "Tapered Off-Policy REINFORCE" in card
    assert "samples.jsonl" not in commit["files"]


WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {recipes!r}); sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import end_processes
    import verifier, test_recipe_verifier

    results = verifier.main(*test_recipe_verifier.tiny_args(sys.argv[1], sys.argv[2]))
    # each process's votes to a file of its own: two processes' stdout can interleave mid-line in one pipe
    Path(sys.argv[2], f"votes-rank{{PartialState().process_index}}.json").write_text(json.dumps(results["votes"]))
    end_processes()
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "zero3", "fsdp2"])
def test_recipe_under_accelerate_launch_with_two_processes(engine, tiny_model_path, tmp_path):
    # the shipped configurations on 2 CPU processes: the recipe's own generation (solutions, scores) loads whole
    # models next to the training engine
    from test_sharded import accelerate_config

    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(recipes=str(RECIPES), tests=str(Path(__file__).parent)))
    result = launch(script, tiny_model_path, tmp_path / "out", config_file=accelerate_config(engine, tmp_path))
    votes = [json.loads((tmp_path / "out" / f"votes-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert votes[0] == votes[1]  # both processes hold every solution and every score
    assert result.stdout.count("Verifier on the test solutions") == 1  # the main process reports
    assert (tmp_path / "out" / "round-1" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "recipe, name",
    [(gsm8k, "llama3_8b_full"), (gsm8k, "llama3_8b_qlora"), (verifier, "verifier_llama3_8b_qlora")],
)
def test_the_papers_configurations_train_with_its_baseline(recipe, name):
    # the configurations of the paper's setup say "baseline 0": they set it, where the loop's own default (no baseline
    # set) would train TOPR with a target positive fraction of 0.8
    parsed = recipe.make_parser().parse_args_and_config(["--config", str(RECIPES / "configs" / f"{name}.yaml")])
    (args,) = [a for a in parsed if isinstance(a, TOPRConfig)]
    assert args.baseline == 0.0 and args.target_positive_fraction is None
    assert "baseline 0" in (RECIPES / "configs" / f"{name}.yaml").read_text().split("\n# TOPRLoopConfig")[0]
