"""Evaluation of a policy on held-out prompts: pass@1 (greedy and sampled), maj@k, invalid and truncated rates; and
the votes over sampled answers (majority, verifier-weighted, best-of-n)."""

from collections.abc import Callable, Sequence

from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .data import PROMPT, completion_text
from .environments import EnvironmentFactory, Environments, as_environments
from .generation import GenerationEngine, SamplingSettings, TransformersEngine
from .rollout import Trajectories, prepare_tool_calling, rollout
from .sampling import ENVIRONMENTS, checked_prompt_ids, score_completions


def evaluate_policy(
    model: PreTrainedModel | None,
    processing_class: PreTrainedTokenizerBase,
    dataset: Dataset,
    correct_func: Callable,
    answer_func: Callable[[str], str | None],
    sampling: SamplingSettings | None = None,
    *,
    engine: GenerationEngine | None = None,
    progress: bool = True,
    bf16: bool | None = None,
    tools: list[Callable] | None = None,
    max_tool_calling_iterations: int | None = None,
    environment_factory: EnvironmentFactory | Environments | None = None,
    return_per_prompt: bool = False,
) -> dict[str, float] | tuple[dict[str, float], list[dict[str, int]]]:
    """
    Accuracy and validity of a policy's answers, as the TOPR paper reports them: greedy decoding, then
    `sampling.num_samples` samples per prompt.

    Args:
        model ([`~transformers.PreTrainedModel`], *optional*):
            Policy to evaluate (`None` with an `engine` that holds it).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            Its tokenizer.
        dataset ([`~datasets.Dataset`]):
            Held-out prompts (`prompt` column) and the columns `correct_func` needs (e.g. `answer`).
        correct_func (`Callable`):
            Reward function with TRL GRPO's signature; a completion is correct when its value is > 0 (e.g.
            [`~trl_topr.rewards.gsm8k_reward`]).
        answer_func (`Callable[[str], str | None]`):
            Final answer of a completion text, `None` when it has none (an invalid output); used for maj@k and the
            invalid rate (e.g. [`~trl_topr.rewards.extract_final_answer`]).
        sampling ([`~trl_topr.generation.SamplingSettings`], *optional*):
            How to sample the k samples of the sampled pass@1 and maj@k (k = `num_samples`). Defaults to
            `SamplingSettings(num_samples=4, seed=0)`.
        engine ([`~trl_topr.generation.GenerationEngine`], *optional*):
            Generate with this engine (e.g. vLLM, from [`~trl_topr.generation.generation_engine`]), holding the
            policy's weights, instead of `model.generate`.
        progress (`bool`, *optional*, defaults to `True`):
            Show progress bars.
        bf16 (`bool`, *optional*):
            Generate under bf16 autocast (transformers, without an `engine`). Defaults to the hardware (see
            [`~trl_topr.precision.bf16_is_faster`]).
        tools (`list[Callable]`, *optional*):
            Tools the policy may call, as in [`~trl_topr.sample_completions`]: each answer is then the last turn of
            a trajectory ([`~trl_topr.rollout.rollout`]).
        max_tool_calling_iterations (`int`, *optional*):
            The most rounds of tool calls of a trajectory; `None` for no limit but the length.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*):
            TRL GRPO's environments, as in [`~trl_topr.sample_completions`]: each trajectory, greedy or sampled, gets
            an instance reset with its row; `correct_func` gets them as `environments`.
        return_per_prompt (`bool`, *optional*, defaults to `False`):
            Also return each prompt's outcome, in the dataset's order: `{"greedy_correct": 0 or 1, "correct": the
            number of its k samples that are correct, "invalid": the number without a final answer}`. Paired
            comparisons of two policies on the same prompts (a bootstrap over prompts) need them.

    Returns:
        `dict[str, float]`: `pass@1_greedy` (greedy accuracy), `pass@1` (mean accuracy of the samples),
        `maj@k` (accuracy of the most frequent valid answer among the k samples), `invalid_rate` (share of samples
        without a final answer), `invalid_rate_greedy`, and two signs of degeneration: `truncated_rate` (share of
        samples that reach `max_new_tokens` without ending) and `mean_length` (mean sample length in tokens). With
        `tools`, also `tool_call_rate` and `tool_call_rate_greedy` (tool calls per sample) and `tool_failure_rate`
        (failed calls per sample); the lengths count the tools' results too. With `return_per_prompt`, the tuple
        `(metrics, per_prompt)`.
    """
    settings = sampling or SamplingSettings(num_samples=4, seed=0)
    if engine is None:
        if model is None:
            raise ValueError("`evaluate_policy` needs a `model` or an `engine` holding it.")
        engine = TransformersEngine(model, processing_class, bf16=bf16)
    k = settings.num_samples
    environments = as_environments(environment_factory, tools)

    def run(sampling: SamplingSettings) -> tuple[Trajectories, list[bool]]:
        # the trajectories, and whether each is correct
        rows, own_tools, instances = dataset, tools, None
        if environments is not None:  # one row per trajectory, with its environment
            rows, own_tools, instances = environments.expand(dataset, sampling.num_samples)
        prompts = list(rows[PROMPT])
        prepare_tool_calling(processing_class, own_tools, prompts)
        ids = checked_prompt_ids(processing_class, prompts, None, tools=own_tools)
        if environments is not None:
            sampling = sampling.replace(num_samples=1)
        out = rollout(
            engine, processing_class, prompts, ids, sampling, own_tools, max_tool_calling_iterations, progress
        )
        repeats = sampling.num_samples
        repeated = {c: [v for v in rows[c] for _ in range(repeats)] for c in rows.column_names if c != PROMPT}
        repeated |= {ENVIRONMENTS: instances} if instances is not None else {}
        prompt_list = [p for p in prompts for _ in range(repeats)]
        _, per_func = score_completions(prompt_list, out.completions, {"correct": correct_func}, **repeated)
        return out, [value > 0 for value in per_func["correct"]]

    (greedy_run, greedy_correct), (sampled_run, sampled_correct) = run(settings.greedy()), run(settings)
    greedy, sampled, sampled_ids = greedy_run.completions, sampled_run.completions, sampled_run.completion_ids
    tool_metrics = {}
    if tools or environments is not None:
        tool_metrics = {
            "tool_call_rate": _mean(sampled_run.tool_calls),
            "tool_call_rate_greedy": _mean(greedy_run.tool_calls),
            "tool_failure_rate": _mean(sampled_run.tool_failures),
        }
    sampled_answers = [answer_func(completion_text(c)) for c in sampled]

    majority_correct = [_majority_correct(sampled_answers, sampled_correct, i, k) for i in range(len(dataset))]
    metrics = {
        "pass@1_greedy": _mean(greedy_correct),
        "pass@1": _mean(sampled_correct),
        f"maj@{k}": _mean(majority_correct),
        "invalid_rate": _mean([answer is None for answer in sampled_answers]),
        "invalid_rate_greedy": _mean([answer_func(completion_text(c)) is None for c in greedy]),
        "truncated_rate": _mean(
            [len(sample) >= settings.max_new_tokens and sample[-1] not in engine.eos_ids for sample in sampled_ids]
        ),
        "mean_length": _mean([len(sample) for sample in sampled_ids]),
        **tool_metrics,
    }
    if not return_per_prompt:
        return metrics
    per_prompt = [
        {
            "greedy_correct": int(greedy_correct[i]),
            "correct": sum(sampled_correct[i * k : (i + 1) * k]),
            "invalid": sum(answer is None for answer in sampled_answers[i * k : (i + 1) * k]),
        }
        for i in range(len(dataset))
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
