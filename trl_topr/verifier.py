"""Generative verifier prompts (the TOPR paper, section 4.4): a model reads a question and a candidate solution, writes
a short assessment and ends with a verdict, "Verdict: correct" or "Verdict: incorrect". Train it with TOPR on these
prompts and [`~trl_topr.rewards.verifier_reward`], then vote with its verdicts
([`~trl_topr.evaluation.weighted_vote`])."""

from collections.abc import Iterable, Mapping
from numbers import Real

from datasets import Dataset

from .data import completion_text, data_error


VERIFIER_INSTRUCTION = (
    "You check solutions to math problems. Read the problem and the proposed solution, assess its reasoning and its "
    "final answer in a few sentences, then end your response with 'Verdict: correct' or 'Verdict: incorrect'."
)


def verifier_prompts(
    rows: Dataset | Iterable[Mapping],
    *,
    question_column: str = "question",
    solution_column: str = "solution",
    correct_column: str = "correct",
    conversational: bool = True,
    instruction: str = VERIFIER_INSTRUCTION,
) -> Dataset:
    """
    Turn (question, solution, correct) rows into a generative verifier's prompts, with the truth as a `label` column.

    Args:
        rows ([`~datasets.Dataset`] or iterable of mappings):
            The solutions to judge, e.g. a generator's samples scored against the gold answers.
        question_column (`str`, *optional*, defaults to `"question"`):
            The problem statement (a string).
        solution_column (`str`, *optional*, defaults to `"solution"`):
            The candidate solution: a string, or a conversational completion (its last message's content is used).
        correct_column (`str`, *optional*, defaults to `"correct"`):
            Whether the solution is correct: a bool, or a number such as a reward (> 0 means correct).
        conversational (`bool`, *optional*, defaults to `True`):
            Build chat prompts (a system message with `instruction`, a user message with the problem and the solution)
            instead of plain-text prompts ending in "Assessment:".
        instruction (`str`, *optional*, defaults to `VERIFIER_INSTRUCTION`):
            What the verifier is asked to do; it must ask for the verdict format that
            [`~trl_topr.rewards.extract_verdict`] reads.

    Returns:
        [`~datasets.Dataset`]: columns `prompt`, `label` (bool, what [`~trl_topr.rewards.verifier_reward`] reads),
        `question` and `solution` (the texts judged).

    Raises:
        [`TOPRDataError`]: A column is missing, a question or solution is empty, or a label is neither a bool nor a
            number. The message names the column and the row.

    Example:
    ```python
    >>> from trl_topr.verifier import verifier_prompts

    >>> rows = [{"question": "What is 2 + 3?", "solution": "2 + 3 = 5. The answer is 5.", "correct": True}]
    >>> dataset = verifier_prompts(rows, conversational=False, instruction="Judge the solution.")
    >>> print(dataset[0]["prompt"])
    Judge the solution.
    <BLANKLINE>
    Problem: What is 2 + 3?
    <BLANKLINE>
    Proposed solution: 2 + 3 = 5. The answer is 5.
    <BLANKLINE>
    Assessment:
    >>> dataset[0]["label"]
    True

    ```
    """
    rows = list(rows)
    if not rows:
        raise ValueError("verifier_prompts: no rows to build prompts from.")
    out = {"prompt": [], "label": [], "question": [], "solution": []}
    for i, row in enumerate(rows):
        for column in (question_column, solution_column, correct_column):
            if column not in row:
                raise data_error("verifier_prompts", column, i, f"missing (the row has {sorted(row)}).")
        question, solution, correct = row[question_column], row[solution_column], row[correct_column]
        if isinstance(solution, list) and solution:  # a conversational completion
            solution = completion_text(solution)
        for column, text in ((question_column, question), (solution_column, solution)):
            if not isinstance(text, str) or not text.strip():
                raise data_error("verifier_prompts", column, i, f"expected a non-empty string, got {text!r}.")
        if not isinstance(correct, (bool, Real)) or correct != correct:
            raise data_error(
                "verifier_prompts",
                correct_column,
                i,
                f"expected a bool, or a number where > 0 means correct, got {correct!r}.",
            )
        body = f"Problem: {question.strip()}\n\nProposed solution: {solution.strip()}"
        if conversational:
            prompt = [{"role": "system", "content": instruction}, {"role": "user", "content": body}]
        else:
            prompt = f"{instruction}\n\n{body}\n\nAssessment:"
        out["prompt"].append(prompt)
        out["label"].append(bool(correct > 0))
        out["question"].append(question)
        out["solution"].append(solution)
    return Dataset.from_dict(out)
