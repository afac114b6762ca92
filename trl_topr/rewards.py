r"""GSM8K correctness reward and generative-verifier verdict reward, as TRL reward functions:
`fn(prompts, completions, **columns) -> list[float]`.

A completion is correct when its final answer, stated as "The answer is N" (as in the TOPR paper), "#### N" or
"\boxed{N}", equals the gold number. A completion without such a statement is *invalid*: it gets the reward of a wrong
answer (-1), and [`gsm8k_invalid`] flags it. A bare last number is deliberately not taken as the answer, since the
paper counts outputs without a final answer statement as invalid.

Comparison uses `math_verify` when it is installed (so "72", "72.0" and "\frac{144}{2}" match), else plain numbers.
"""

import math
import re
import threading
from collections.abc import Callable

from .data import completion_text


try:
    from math_verify import parse, verify
except ImportError:  # optional: answers_match then compares plain numbers only
    parse = verify = None


_NUMBER = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 72, -3, 1,234, $18, 2.5 (a trailing period is not taken)
_ANSWER_IS = re.compile(rf"\banswer\s+is[\s:*$]*({_NUMBER})", re.IGNORECASE)  # "The (final) answer is: $1,234."
_HASHES = re.compile(rf"####[\s$]*({_NUMBER})")
_BOXED = "\\boxed{"


def _clean(text: str) -> str:
    """Strip spaces, dollar signs, thousands separators and a trailing period from an answer."""
    text = text.strip().replace("$", "").rstrip(".").strip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    depth, begin = 1, start + len(_BOXED)
    for end in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return _clean(text[begin:end]) or None
    return None  # unbalanced braces: the box was cut off


def extract_final_answer(text: str) -> str | None:
    r"""
    Extract the final answer of a solution text.

    The formats are tried in order, and within a format the last occurrence wins: "The answer is N" (case-insensitive,
    also "the final answer is", with optional `$`, thousands commas and a trailing period), then "#### N", then
    "\boxed{N}". A bare number is not an answer: without one of these statements the output is invalid.

    Args:
        text (`str`):
            The solution text, e.g. a model completion.

    Returns:
        `str | None`:
            The answer without `$` or thousands commas (e.g. `"1234"`), or `None` when no final answer is stated.

    Example:
    ```python
    >>> from trl_topr.rewards import extract_final_answer

    >>> extract_final_answer("3 + 4 = 7, so 7 * 2 = 14. The answer is $1,400.")
    '1400'
    >>> extract_final_answer("She makes 9 * 2 = 18 dollars.\n#### 18")
    '18'
    >>> print(extract_final_answer("She makes 9 * 2 = 18 dollars."))
    None

    ```
    """
    for pattern in (_ANSWER_IS, _HASHES):
        matches = pattern.findall(text)
        if matches:
            return _clean(matches[-1])
    return _last_boxed(text)


def gold_answer(answer_field: str) -> str:
    """
    Gold number of a GSM8K `answer` field: the text after the last `####`, commas removed.

    Args:
        answer_field (`str`):
            The GSM8K answer, reasoning followed by `#### N`. Without `####`, the whole (stripped) text is the answer.

    Returns:
        `str`:
            The gold answer, e.g. `"1234"` for `"... #### 1,234"`.

    Example:
    ```python
    >>> from trl_topr.rewards import gold_answer

    >>> gold_answer("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\\n#### 1,018")
    '1018'

    ```
    """
    return _clean(answer_field.rsplit("####", 1)[-1])


def answers_match(predicted: str, gold: str) -> bool:
    r"""
    Whether a predicted answer equals the gold one, with `math_verify` (falling back to comparing plain numbers).

    Args:
        predicted (`str`):
            The predicted answer, e.g. from [`extract_final_answer`].
        gold (`str`):
            The gold answer, e.g. from [`gold_answer`].

    Returns:
        `bool`:
            `True` when both denote the same value.

    Example:
    ```python
    >>> from trl_topr.rewards import answers_match

    >>> answers_match("72.0", "72"), answers_match(r"\frac{144}{2}", "72"), answers_match("73", "72")
    (True, True, False)

    ```
    """
    if parse is not None:
        # math_verify times out with signal.alarm, which only works in the main thread (as in TRL's accuracy_reward)
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        gold_parsed = parse(gold, parsing_timeout=timeout)
        predicted_parsed = parse(predicted, parsing_timeout=timeout)
        if gold_parsed and predicted_parsed:
            return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))
    try:
        return math.isclose(float(_clean(predicted)), float(_clean(gold)), rel_tol=1e-6)
    except ValueError:
        return False


def gsm8k_reward(prompts, completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    """
    Reward function (TRL signature): +1.0 when the completion's final answer is the gold one, else -1.0.

    Invalid completions (no final answer statement, see [`extract_final_answer`]) are incorrect and get -1.0. A row
    whose gold is `None` gets `None`, which TRL treats as "no reward" for that example.

    Args:
        prompts (`list`):
            The prompts (unused, part of the TRL signature).
        completions (`list[str] | list[list[dict[str, str]]]`):
            Completions as strings, or as lists of messages whose last `"content"` is the answer.
        answer (`list[str]`, *optional*):
            GSM8K `answer` column, `"... #### N"`. Used in priority over `solution`.
        solution (`list[str]`, *optional*):
            A plain gold column, e.g. `"72"`.
        **kwargs (`Any`):
            Other dataset columns and trainer arguments; `log_extra`, when given by the trainer, logs the extracted
            answers.

    Returns:
        `list[float | None]`:
            One reward per completion: 1.0 or -1.0 (`None` where the gold is `None`).

    Example:
    ```python
    >>> from trl_topr.rewards import gsm8k_reward

    >>> completions = ["9 * 2 = 18. The answer is 18.", [{"role": "assistant", "content": "#### 17"}], "18"]
    >>> gsm8k_reward(None, completions, answer=["9 * 2 = 18\\n#### 18"] * 3)
    [1.0, -1.0, -1.0]

    ```
    """
    golds = answer if answer is not None else solution
    if golds is None:
        raise ValueError(
            "gsm8k_reward needs the gold answers: the dataset must have an `answer` column (GSM8K format, "
            "'... #### 72') or a `solution` column (the gold number, '72')."
        )
    predicted = [extract_final_answer(completion_text(c)) for c in completions]
    return _plus_minus_one(
        predicted,
        golds,
        lambda pred, gold: answers_match(pred, gold_answer(str(gold))),
        "extracted_answer",
        kwargs.get("log_extra"),
    )


def _plus_minus_one(extracted: list, truths: list, is_right: Callable, log_name: str, log_extra) -> list[float | None]:
    # +1 where the extracted value is right against its truth, -1 where it is wrong or missing (None: invalid),
    # None where the truth is None; the extracted values logged through the trainer's `log_extra` when given
    rewards = [
        None if truth is None else 1.0 if value is not None and is_right(value, truth) else -1.0
        for value, truth in zip(extracted, truths, strict=True)
    ]
    if log_extra is not None:
        log_extra(log_name, [value if value is not None else "[invalid]" for value in extracted])
    return rewards


def gsm8k_invalid(prompts, completions, **kwargs) -> list[float]:
    """
    Invalid-output flag (TRL signature): 1.0 when no final answer can be extracted, else 0.0.

    This is a metric, not a training signal: give it weight 0 (e.g. `reward_weights=[1.0, 0.0]` after
    [`gsm8k_reward`]) so that it is logged, and stored as an `invalid` column of a sampled dataset, without
    changing the reward.

    Args:
        prompts (`list`):
            The prompts (unused, part of the TRL signature).
        completions (`list[str] | list[list[dict[str, str]]]`):
            Completions as strings, or as lists of messages whose last `"content"` is the answer.
        **kwargs (`Any`):
            Dataset columns and trainer arguments (unused).

    Returns:
        `list[float]`:
            One flag per completion.

    Example:
    ```python
    >>> from trl_topr.rewards import gsm8k_invalid

    >>> gsm8k_invalid(None, ["The answer is 18.", [{"role": "assistant", "content": "So she makes 18."}]])
    [0.0, 1.0]

    ```
    """
    return [float(extract_final_answer(completion_text(c)) is None) for c in completions]


_VERDICT = re.compile(r"\bverdict\b(?:\W+is\b)?\W*(correct|incorrect)\b", re.IGNORECASE)  # "Verdict: **incorrect**."


def extract_verdict(text: str) -> str | None:
    """
    Extract a generative verifier's verdict: the last "Verdict: correct" or "Verdict: incorrect" statement.

    The match is case-insensitive and allows punctuation or markdown between "Verdict" and the word ("Verdict -
    **Correct**"). Without such a statement the verdict is invalid, as the TOPR paper counts unparsable verdicts.

    Args:
        text (`str`):
            The verifier's assessment, e.g. a completion of a prompt built by [`~trl_topr.verifier.verifier_prompts`].

    Returns:
        `str | None`:
            `"correct"`, `"incorrect"`, or `None` when no verdict is stated.

    Example:
    ```python
    >>> from trl_topr.rewards import extract_verdict

    >>> extract_verdict("16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars: right. Verdict: Correct.")
    'correct'
    >>> extract_verdict("The step 9 * 2 = 16 is wrong. Verdict: **incorrect**")
    'incorrect'
    >>> print(extract_verdict("The solution looks correct."))
    None

    ```
    """
    matches = _VERDICT.findall(text)
    return matches[-1].lower() if matches else None


def verifier_reward(prompts, completions, label=None, **kwargs) -> list[float | None]:
    """
    Reward function (TRL signature) of a generative verifier: +1.0 when its verdict matches the truth, else -1.0.

    The truth is the `label` column: `True` when the judged solution is correct. An invalid verdict (none stated, see
    [`extract_verdict`]) is wrong and gets -1.0. A row whose label is `None` gets `None`, which TRL treats as "no
    reward" for that example.

    Args:
        prompts (`list`):
            The prompts (unused, part of the TRL signature).
        completions (`list[str] | list[list[dict[str, str]]]`):
            The verifier's assessments, as strings or as lists of messages whose last `"content"` is the assessment.
        label (`list[bool]`):
            Whether each judged solution is correct, as [`~trl_topr.verifier.verifier_prompts`] writes it.
        **kwargs (`Any`):
            Other dataset columns and trainer arguments; `log_extra`, when given by the trainer, logs the verdicts.

    Returns:
        `list[float | None]`:
            One reward per completion: 1.0 or -1.0 (`None` where the label is `None`).

    Example:
    ```python
    >>> from trl_topr.rewards import verifier_reward

    >>> verdicts = ["Verdict: correct", "Verdict: incorrect", "Verdict: correct", "It is fine."]
    >>> verifier_reward(None, verdicts, label=[True, True, False, True])
    [1.0, -1.0, -1.0, -1.0]

    ```
    """
    if label is None:
        raise ValueError(
            "verifier_reward needs the truth: the dataset must have a `label` column, True where the judged "
            "solution is correct (trl_topr.verifier.verifier_prompts writes it)."
        )
    verdicts = [extract_verdict(completion_text(c)) for c in completions]
    return _plus_minus_one(
        verdicts,
        label,
        lambda verdict, truth: verdict == ("correct" if truth else "incorrect"),
        "verdict",
        kwargs.get("log_extra"),
    )


def verifier_invalid(prompts, completions, **kwargs) -> list[float]:
    """
    Invalid-verdict flag (TRL signature): 1.0 when no verdict can be extracted (see [`extract_verdict`]), else 0.0.

    A metric, not a training signal: give it weight 0 after [`verifier_reward`], as [`gsm8k_invalid`] after
    [`gsm8k_reward`].

    Args:
        prompts (`list`):
            The prompts (unused, part of the TRL signature).
        completions (`list[str] | list[list[dict[str, str]]]`):
            The verifier's assessments, as strings or as lists of messages.
        **kwargs (`Any`):
            Dataset columns and trainer arguments (unused).

    Returns:
        `list[float]`:
            One flag per completion.

    Example:
    ```python
    >>> from trl_topr.rewards import verifier_invalid

    >>> verifier_invalid(None, ["Verdict: incorrect", "I am not sure."])
    [0.0, 1.0]

    ```
    """
    return [float(extract_verdict(completion_text(c)) is None) for c in completions]
