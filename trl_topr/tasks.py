"""
The embedded tasks in GSM8K's question/answer format, and the few-shot chat prompt of the GSM8K recipe: what the
embedded default run, the recipes and the benchmarks train on without a download.
"""

import ast
import operator
import random
import re

from datasets import Dataset

from .rewards import gold_answer


__all__ = ["arithmetic_problems", "calculator", "few_shot_prompts", "solution_text"]


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


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """
    Evaluate an arithmetic expression.

    Args:
        expression: The expression, with numbers, +, -, *, / and parentheses, e.g. "12 * (3 + 4)".
    """
    # A tool for the policy to call: arithmetic only (the expression is parsed, never executed)

    def value(node):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    result = value(ast.parse(str(expression), mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.15g}"


def _is_arithmetic(expression: str) -> bool:
    try:
        calculator(expression)
    except (ValueError, SyntaxError, ArithmeticError):
        return False
    return True


def _calculator_turns(shot: dict) -> list[dict]:
    # A worked example that calls the calculator on each of its calculations (GSM8K's `<<expression=value>>`
    # annotations, or the embedded tasks' `a op b = value`), reads the results, then answers
    expressions = re.findall(r"<<([^=>]+)=[^>]*>>", shot["answer"]) or [shot["answer"].split("=")[0].strip()]
    expressions = [e for e in expressions if _is_arithmetic(e)]
    if not expressions:  # nothing to calculate: the example answers at once
        return []
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}} for e in expressions
    ]
    results = [{"role": "tool", "name": "calculator", "content": calculator(e)} for e in expressions]
    return [{"role": "assistant", "content": "", "tool_calls": calls}, *results]


def few_shot_prompts(problems: list[dict], shots: list[dict], tools: bool = False) -> Dataset:
    """
    Conversational prompts: the worked examples as earlier turns, then the question; `answer` kept for scoring.

    Args:
        problems (`list[dict]`):
            The questions (`question`, `answer` in GSM8K's format).
        shots (`list[dict]`):
            The worked examples.
        tools (`bool`, *optional*, defaults to `False`):
            Show the examples calling [`calculator`] on their calculations before they answer (sample with
            `tools=[calculator]`).

    Returns:
        [`~datasets.Dataset`]: `prompt` (messages) and `answer`.
    """
    context = []
    for shot in shots:
        context += [
            {"role": "user", "content": shot["question"]},
            *(_calculator_turns(shot) if tools else []),
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
