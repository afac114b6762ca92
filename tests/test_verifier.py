"""Generative verifier pieces: prompts from (question, solution, correct) rows, the verdict parser and reward, and the
votes over sampled answers; on real GSM8K rows."""

import math

import pytest
from test_rewards import plus_one, read_gsm8k, reasoning
from transformers import AutoTokenizer

from trl_topr import (
    best_of_n,
    extract_final_answer,
    extract_verdict,
    gsm8k_reward,
    verifier_invalid,
    verifier_prompts,
    verifier_reward,
    weighted_vote,
)
from trl_topr.rewards import gold_answer


def judged_rows(split: str, n: int) -> list[dict]:
    """For each real question, a correct and a wrong solution, labelled by the GSM8K reward (not by construction)."""
    rows = []
    for row in read_gsm8k(split, n):
        gold = gold_answer(row["answer"])
        for answer in (gold, plus_one(gold)):
            solution = f"{reasoning(row['answer'])}\nThe answer is {answer}."
            reward = gsm8k_reward(None, [solution], answer=[row["answer"]])[0]
            rows.append({"question": row["question"], "solution": solution, "correct": reward > 0})
    return rows


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The sum is right. Verdict: correct", "correct"),
        ("Verdict: Incorrect.", "incorrect"),
        ("verdict:correct", "correct"),
        ("Verdict - **Correct**", "correct"),
        ("Final verdict: INCORRECT", "incorrect"),
        ("The verdict is incorrect.", "incorrect"),
        ("Verdict: correct. On second thought, 9 * 2 is 18, not 16. Verdict: incorrect", "incorrect"),
        ("The solution is correct.", None),  # no verdict statement: invalid, as the paper counts it
        ("Verdict: correctly computed", None),
        ("Verdicts correct", None),
        ("Verdict: unsure", None),
        ("", None),
    ],
)
def test_extract_verdict(text, expected):
    assert extract_verdict(text) == expected


@pytest.mark.parametrize("split", ["test", "train"])
def test_verifier_prompts_from_real_rows(split, tiny_model_path):
    rows = judged_rows(split, 50)
    assert [r["correct"] for r in rows] == [True, False] * 50  # the reward agrees with how the solutions were made

    dataset = verifier_prompts(rows)
    assert dataset.column_names == ["prompt", "label", "question", "solution"]
    assert dataset["label"] == [True, False] * 50
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for row, example in zip(rows, dataset):
        system, user = example["prompt"]
        assert system["role"] == "system" and "Verdict: correct" in system["content"]
        assert user["role"] == "user" and row["question"].strip() in user["content"]
        assert row["solution"].strip() in user["content"]
        rendered = tokenizer.apply_chat_template(example["prompt"], tokenize=False, add_generation_prompt=True)
        assert row["question"].strip() in rendered and rendered.rstrip().endswith("assistant")

    standard = verifier_prompts(rows[:4], conversational=False)
    assert all(isinstance(p, str) and p.endswith("Assessment:") for p in standard["prompt"])
    assert rows[0]["question"].strip() in standard["prompt"][0] and standard["label"] == [True, False, True, False]


def test_verifier_prompts_take_rewards_and_conversational_solutions_from_a_dataset():
    from datasets import Dataset

    rows = judged_rows("test", 3)
    sampled = Dataset.from_list(
        [
            {
                "q": r["question"],
                "completion": [{"role": "assistant", "content": r["solution"]}],
                "reward": 1.0 if r["correct"] else -1.0,
            }
            for r in rows
        ]
    )
    dataset = verifier_prompts(sampled, question_column="q", solution_column="completion", correct_column="reward")
    assert dataset["label"] == [r["correct"] for r in rows]
    assert dataset["solution"] == [r["solution"] for r in rows]


@pytest.mark.parametrize(
    "change, column, row, message",
    [
        (lambda rows: rows[3].pop("solution"), "solution", 3, "missing"),
        (lambda rows: rows[2].update(solution="  "), "solution", 2, "non-empty string"),
        (lambda rows: rows[1].update(question=None), "question", 1, "non-empty string"),
        (lambda rows: rows[4].update(correct="yes"), "correct", 4, "bool"),
        (lambda rows: rows[5].update(correct=math.nan), "correct", 5, "bool"),
    ],
)
def test_verifier_prompts_name_the_column_and_row_of_bad_input(change, column, row, message):
    rows = judged_rows("test", 3)
    change(rows)
    with pytest.raises(ValueError, match=rf"column '{column}', row {row}: .*{message}"):
        verifier_prompts(rows)


def test_verifier_prompts_need_rows():
    with pytest.raises(ValueError, match="no rows"):
        verifier_prompts([])


@pytest.mark.parametrize("split", ["test", "train"])
def test_verifier_reward_on_real_rows(split):
    dataset = verifier_prompts(judged_rows(split, 50))
    labels = dataset["label"]
    right = [f"I checked each step.\nVerdict: {'correct' if label else 'incorrect'}" for label in labels]
    wrong = [f"I checked each step.\nVerdict: {'incorrect' if label else 'correct'}" for label in labels]
    invalid = ["I checked each step and it looks fine."] * len(labels)
    assert verifier_reward(dataset["prompt"], right, label=labels) == [1.0] * len(labels)
    assert verifier_reward(dataset["prompt"], wrong, label=labels) == [-1.0] * len(labels)
    assert verifier_reward(dataset["prompt"], invalid, label=labels) == [-1.0] * len(labels)
    assert verifier_invalid(None, right + invalid) == [0.0] * len(labels) + [1.0] * len(labels)
    conversational = [[{"role": "assistant", "content": text}] for text in right]
    assert verifier_reward(None, conversational, label=labels) == [1.0] * len(labels)


def test_verifier_reward_logs_verdicts_and_handles_missing_labels():
    logged = {}
    rewards = verifier_reward(
        None,
        ["Verdict: correct", "no idea", "Verdict: incorrect"],
        label=[True, None, True],
        log_extra=lambda name, values: logged.update({name: values}),
    )
    assert rewards == [1.0, None, -1.0]
    assert logged == {"verdict": ["correct", "[invalid]", "incorrect"]}
    with pytest.raises(ValueError, match="`label` column"):
        verifier_reward(None, ["Verdict: correct"])
    with pytest.raises(ValueError):
        verifier_reward(None, ["Verdict: correct"], label=[True, False])


def test_votes_over_real_answers():
    row = read_gsm8k("test", 1)[0]
    gold = gold_answer(row["answer"])
    wrong = plus_one(gold)
    solutions = [f"{reasoning(row['answer'])}\nThe answer is {a}." for a in (wrong, gold, wrong, gold, wrong)]
    solutions.append(reasoning(row["answer"]))  # no final answer: invalid, no vote
    answers = [extract_final_answer(s) for s in solutions]
    assert answers == [wrong, gold, wrong, gold, wrong, None]

    assert weighted_vote(answers) == wrong  # 3 votes against 2
    verifier = [0.1, 0.9, 0.2, 0.8, 0.3, 1.0]  # P(correct) per solution; the invalid one's is ignored
    assert weighted_vote(answers, verifier) == gold  # 1.7 against 0.6
    assert best_of_n(answers, verifier) == gold
    assert best_of_n(answers, [0.9, 0.2, 0.1, 0.3, 0.4, 1.0]) == wrong


def test_vote_edge_cases():
    assert weighted_vote(["7", "5", "5", "7"]) == "7"  # a tie goes to the answer seen first
    assert best_of_n(["7", "5"], [0.5, 0.5]) == "7"
    assert weighted_vote([None, None]) is None and best_of_n([None], [1.0]) is None
    assert weighted_vote(["7", "5"], [0.0, 0.0]) is None  # the verifier rejects every solution
    assert weighted_vote([]) is None
    with pytest.raises(ValueError, match="2 answers but 1 weights"):
        weighted_vote(["7", "5"], [1.0])
    with pytest.raises(ValueError, match="2 answers but 3 scores"):
        best_of_n(["7", "5"], [1.0, 0.0, 0.5])
