"""GSM8K correctness reward: answer extraction, matching, the TRL reward signature, and real GSM8K rows."""

import json
from pathlib import Path

import pytest

from trl_topr.rewards import answers_match, extract_final_answer, gold_answer, gsm8k_invalid, gsm8k_reward


GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"  # a 200-row sample of each split, MIT


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So 9 * 2 = 18. The answer is 18.", "18"),
        ("THE ANSWER IS 18", "18"),
        ("Thus the final answer is 18.", "18"),
        ("The answer is: $18.", "18"),
        ("The answer is **18**.", "18"),
        ("The answer is 1,234,567.", "1234567"),
        ("The answer is -3.", "-3"),
        ("The answer is -$3.", "-3"),
        ("The answer is 2.50.", "2.50"),
        ("9 * 2 = 18\n#### 18", "18"),
        ("#### 1,000", "1000"),
        ("#### -7", "-7"),
        (r"So the total is \boxed{18}.", "18"),
        (r"\boxed{\frac{144}{2}}", r"\frac{144}{2}"),
        (r"The answer is $\boxed{72}$.", "72"),
    ],
)
def test_extracts_every_format(text, expected):
    assert extract_final_answer(text) == expected


def test_the_last_occurrence_wins():
    assert extract_final_answer("The answer is 5. No wait, the answer is 6.") == "6"
    assert extract_final_answer("#### 5\n#### 6") == "6"
    assert extract_final_answer(r"\boxed{5} or rather \boxed{6}") == "6"


def test_formats_are_tried_in_order():
    assert extract_final_answer("#### 5\nThe answer is 6.") == "6"
    assert extract_final_answer(r"\boxed{5}\n#### 6") == "6"


@pytest.mark.parametrize(
    "text", ["", "She makes 9 * 2 = 18 dollars a day.", "18", "The answer is unknown.", r"\boxed{18", r"\boxed{}"]
)
def test_no_final_answer_statement_is_invalid(text):
    assert extract_final_answer(text) is None
    assert gsm8k_invalid(None, [text]) == [1.0]
    assert gsm8k_reward(None, [text], solution=["18"]) == [-1.0]


def test_gold_answer():
    assert gold_answer("Some reasoning.\n#### 1,018") == "1018"
    assert gold_answer("a #### b\n#### 7") == "7"
    assert gold_answer(" 72 ") == "72"


@pytest.mark.parametrize("predicted", ["72", "72.0", "72.00", r"\frac{144}{2}", "144/2"])
def test_equivalent_answers_match(predicted):
    assert answers_match(predicted, "72")


@pytest.mark.parametrize("predicted", ["73", "-72", "7.2", "720", r"\frac{1}{2}", "banana"])
def test_different_answers_do_not_match(predicted):
    assert not answers_match(predicted, "72")


def test_both_completion_formats_and_both_gold_columns():
    texts = ["The answer is 72.", "The answer is 71.", "no answer"]
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    for completions in (texts, conversational):
        assert gsm8k_reward(None, completions, answer=["... #### 72"] * 3) == [1.0, -1.0, -1.0]
        assert gsm8k_reward(None, completions, solution=["72"] * 3) == [1.0, -1.0, -1.0]
        assert gsm8k_invalid(None, completions) == [0.0, 0.0, 1.0]


def test_keyword_call_as_trl_makes_it_and_log_extra():
    logged = {}
    rewards = gsm8k_reward(
        prompts=["q1", "q2"],
        completions=["#### 3", "nothing"],
        answer=["#### 3", "#### 4"],
        question=["q1", "q2"],
        log_extra=logged.__setitem__,
    )
    assert rewards == [1.0, -1.0]
    assert logged == {"extracted_answer": ["3", "[invalid]"]}


def test_answer_column_is_preferred_and_missing_gold_is_none():
    assert gsm8k_reward(None, ["#### 3"], answer=["#### 3"], solution=["4"]) == [1.0]
    assert gsm8k_reward(None, ["#### 3", "#### 3"], solution=[None, "3"]) == [None, 1.0]


def test_missing_gold_column_raises():
    with pytest.raises(ValueError, match="`answer` column.*`solution` column"):
        gsm8k_reward(None, ["The answer is 3."], question=["What is 1 + 2?"])


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        gsm8k_reward(None, ["#### 3", "#### 4"], solution=["3"])


def read_gsm8k(split, n):
    with (GSM8K / f"{split}.jsonl").open() as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    assert len(rows) == n and all(row["answer"].count("####") == 1 for row in rows)
    return rows


def reasoning(answer_field):
    """The GSM8K solution without its final `#### N` line."""
    return answer_field.rsplit("####", 1)[0].rstrip()


def plus_one(gold):
    return str(int(gold) + 1) if gold.lstrip("-").isdigit() else str(float(gold) + 1)


@pytest.mark.parametrize("split", ["test", "train"])
def test_real_rows_rewritten_with_the_gold_answer_are_correct(split):
    rows = read_gsm8k(split, 200)
    answers = [row["answer"] for row in rows]
    completions = [f"{reasoning(a)} The answer is {gold_answer(a)}." for a in answers]
    assert gsm8k_reward(None, completions, answer=answers) == [1.0] * len(rows)
    assert gsm8k_invalid(None, completions) == [0.0] * len(rows)
    # the same with thousands separators and a plain gold column
    with_commas = [f"{reasoning(a)} The answer is {int(float(gold_answer(a))):,}." for a in answers]
    assert gsm8k_reward(None, with_commas, solution=[gold_answer(a) for a in answers]) == [1.0] * len(rows)


@pytest.mark.parametrize("split", ["test", "train"])
def test_real_rows_rewritten_with_a_wrong_answer_are_incorrect(split):
    rows = read_gsm8k(split, 200)
    answers = [row["answer"] for row in rows]
    completions = [f"{reasoning(a)} The answer is {plus_one(gold_answer(a))}." for a in answers]
    assert gsm8k_reward(None, completions, answer=answers) == [-1.0] * len(rows)
    assert gsm8k_invalid(None, completions) == [0.0] * len(rows)


@pytest.mark.parametrize("split", ["test", "train"])
def test_raw_gsm8k_answers_score_through_the_hashes_format(split):
    rows = read_gsm8k(split, 200)
    answers = [row["answer"] for row in rows]
    conversational = [[{"role": "assistant", "content": a}] for a in answers]
    assert gsm8k_reward(None, conversational, answer=answers) == [1.0] * len(rows)


@pytest.mark.parametrize("split", ["test", "train"])
def test_real_solutions_without_their_final_line_are_invalid(split):
    rows = read_gsm8k(split, 200)
    answers = [row["answer"] for row in rows]
    stripped = [reasoning(a) for a in answers]
    assert gsm8k_invalid(None, stripped) == [1.0] * len(rows)
    assert gsm8k_reward(None, stripped, answer=answers) == [-1.0] * len(rows)
