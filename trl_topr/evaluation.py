"""Evaluation of a policy on held-out prompts: pass@1 (greedy and sampled), maj@k, invalid and truncated rates, from
the trajectories a [`~trl_topr.Sampler`] generated and judged ([`~trl_topr.Sampler.evaluate`],
[`~trl_topr.evaluate_policy`]); and the votes over sampled answers (majority, verifier-weighted, best-of-n)."""

from collections.abc import Callable, Sequence

from .data import completion_text
from .generation import SamplingSettings
from .rollout import Trajectories


def policy_metrics(
    greedy: tuple[Trajectories, list[bool]],
    sampled: tuple[Trajectories, list[bool]],
    answer_func: Callable[[str], str | None],
    settings: SamplingSettings,
    eos_ids: set[int],
    with_tools: bool = False,
) -> tuple[dict[str, float], list[dict[str, int]]]:
    """
    The metrics of [`~trl_topr.evaluate_policy`] from the greedy and the sampled trajectories of the held-out prompts,
    each with whether it is correct.

    Args:
        greedy (`tuple[Trajectories, list[bool]]`):
            One greedy trajectory per prompt, and whether each is correct.
        sampled (`tuple[Trajectories, list[bool]]`):
            `settings.num_samples` sampled trajectories per prompt (prompt-major), and whether each is correct.
        answer_func (`Callable[[str], str | None]`):
            A completion's final answer, `None` when it has none.
        settings ([`~trl_topr.generation.SamplingSettings`]):
            How the samples were drawn (their number k and `max_new_tokens`).
        eos_ids (`set[int]`):
            The ids that end a completion: a sample of `max_new_tokens` without one is truncated.
        with_tools (`bool`, *optional*, defaults to `False`):
            Also report the tool calls.

    Returns:
        `tuple[dict[str, float], list[dict[str, int]]]`: the metrics, and each prompt's outcome.
    """
    (greedy_run, greedy_correct), (sampled_run, sampled_correct) = greedy, sampled
    k = settings.num_samples
    sampled_answers = [answer_func(completion_text(c)) for c in sampled_run.completions]
    sampled_ids = sampled_run.completion_ids
    count = len(greedy_correct)
    tool_metrics = {}
    if with_tools:
        tool_metrics = {
            "tool_call_rate": _mean(sampled_run.tool_calls),
            "tool_call_rate_greedy": _mean(greedy_run.tool_calls),
            "tool_failure_rate": _mean(sampled_run.tool_failures),
        }
    metrics = {
        "pass@1_greedy": _mean(greedy_correct),
        "pass@1": _mean(sampled_correct),
        f"maj@{k}": _mean([_majority_correct(sampled_answers, sampled_correct, i, k) for i in range(count)]),
        "invalid_rate": _mean([answer is None for answer in sampled_answers]),
        "invalid_rate_greedy": _mean([answer_func(completion_text(c)) is None for c in greedy_run.completions]),
        "truncated_rate": _mean(
            [len(sample) >= settings.max_new_tokens and sample[-1] not in eos_ids for sample in sampled_ids]
        ),
        "mean_length": _mean([len(sample) for sample in sampled_ids]),
        **tool_metrics,
    }
    per_prompt = [
        {
            "greedy_correct": int(greedy_correct[i]),
            "correct": sum(sampled_correct[i * k : (i + 1) * k]),
            "invalid": sum(answer is None for answer in sampled_answers[i * k : (i + 1) * k]),
        }
        for i in range(count)
    ]
    return metrics, per_prompt


def _majority_correct(answers: list, correct: list[bool], prompt: int, k: int) -> bool:
    # whether prompt `prompt`'s most frequent valid answer among its k samples is correct
    group = range(prompt * k, (prompt + 1) * k)
    winner = weighted_vote([answers[j] for j in group])
    return winner is not None and next(correct[j] for j in group if answers[j] == winner)


def _mean(values) -> float:
    """The mean of `values`, 0 for none."""
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def weighted_vote(answers: Sequence[str | None], weights: Sequence[float] | None = None) -> str | None:
    """
    The answer with the largest total weight: a majority vote, or a verifier-weighted vote.

    Args:
        answers (`Sequence[str | None]`):
            The final answers of the sampled solutions to one question (`None`: an invalid solution, which gets no
            vote), e.g. from [`~trl_topr.rewards.extract_final_answer`].
        weights (`Sequence[float]`, *optional*):
            One weight per solution, e.g. a verifier's probability that it is correct. Defaults to 1 each: the
            majority vote (maj@k).

    Returns:
        `str | None`: the winning answer (ties go to the answer seen first), or `None` when no answer is valid or
        every valid one weighs 0.

    Example:
    ```python
    >>> from trl_topr.evaluation import weighted_vote

    >>> answers = ["18", "16", "16", None, "18", "16"]
    >>> weighted_vote(answers)
    '16'
    >>> weighted_vote(answers, weights=[0.9, 0.1, 0.2, 1.0, 0.8, 0.3])
    '18'

    ```
    """
    if weights is None:
        weights = [1.0] * len(answers)
    if len(weights) != len(answers):
        raise ValueError(f"weighted_vote: {len(answers)} answers but {len(weights)} weights.")
    totals: dict[str, float] = {}
    for answer, weight in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + weight
    winner = max(totals, key=totals.get, default=None)  # max keeps the first of equal totals
    return winner if winner is not None and totals[winner] > 0 else None


def best_of_n(answers: Sequence[str | None], scores: Sequence[float]) -> str | None:
    """
    The answer of the best-scored valid solution (best-of-n with a verifier or a reward model).

    Args:
        answers (`Sequence[str | None]`):
            The final answers of the sampled solutions to one question (`None`: invalid, never chosen).
        scores (`Sequence[float]`):
            One score per solution, e.g. a verifier's probability that it is correct.

    Returns:
        `str | None`: the answer of the highest score (ties go to the first), `None` when no answer is valid.

    Example:
    ```python
    >>> from trl_topr.evaluation import best_of_n

    >>> best_of_n(["18", "16", None], scores=[0.4, 0.7, 0.9])
    '16'

    ```
    """
    if len(scores) != len(answers):
        raise ValueError(f"best_of_n: {len(answers)} answers but {len(scores)} scores.")
    valid = [(score, -i, answer) for i, (answer, score) in enumerate(zip(answers, scores)) if answer is not None]
    return max(valid)[2] if valid else None
