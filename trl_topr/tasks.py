"""
The embedded tasks in GSM8K's question/answer format, and the few-shot chat prompt of the GSM8K recipe: what the
embedded default run, the recipes and the benchmarks train on without a download.
"""

import random
import re

from datasets import Dataset

from .rewards import gold_answer


INSTRUCTION = "Solve the problem step by step. End your response with 'The answer is N.' where N is the final number."


def solution_text(answer_field: str) -> str:
    """A GSM8K solution rewritten in the prompt's format: calculator annotations removed, "#### N" replaced by
    "The answer is N."."""
    reasoning = re.sub(r"<<[^>]*>>", "", answer_field.split("####")[0]).strip()
    return f"{reasoning}\nThe answer is {gold_answer(answer_field)}."


def arithmetic_problems(seed: int = 0) -> list[dict[str, str]]:
    """All 243 single-digit `a op b` questions (op in + - *), shuffled, in GSM8K's question/answer format."""
    problems = []
    for a in range(1, 10):
        for op, result in (("+", lambda x, y: x + y), ("-", lambda x, y: x - y), ("*", lambda x, y: x * y)):
            for b in range(1, 10):
                value = result(a, b)
                problems.append(
                    {"question": f"What is {a} {op} {b}?", "answer": f"{a} {op} {b} = {value}\n#### {value}"}
                )
    random.Random(seed).shuffle(problems)
    return problems


def few_shot_prompts(problems: list[dict], shots: list[dict]) -> Dataset:
    """Conversational prompts: the worked examples as earlier turns, then the question; `answer` kept for scoring."""
    context = []
    for shot in shots:
        context += [
            {"role": "user", "content": shot["question"]},
            {"role": "assistant", "content": solution_text(shot["answer"])},
        ]
    rows = []
    for problem in problems:
        messages = [
            {"role": "system", "content": INSTRUCTION},
            *context,
            {"role": "user", "content": problem["question"]},
        ]
        rows.append({"prompt": messages, "answer": problem["answer"]})
    return Dataset.from_list(rows)
