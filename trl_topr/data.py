"""The TOPR data contract: the one place where datasets are checked, and the collator that batches them.

A TOPR dataset has one row per completion, with columns (names configurable in [`TOPRConfig`]):

- `prompt`, `completion`: text, or lists of messages (conversational), as TRL's prompt-completion datasets. A
  conversational completion may be a multi-turn trajectory: several assistant turns (with `content` and/or TRL's
  `tool_calls`) and the `tool` messages that answer them, with TRL's `tools` column. Only the policy's tokens are
  trained: those of the assistant turns (see [`is_multi_turn`]);
- `reward`: a finite number, or instead a boolean `label` (+1 / -1);
- `behavior_logps` (optional): log mu of the completion, one float (summed over the completion tokens) or a list with
  one float per completion token;
- `prompt_ids`, `completion_ids` (optional, together; TRL's names for tokenized data): the token ids the sampler
  produced. When given, they are what is trained, exactly: no re-tokenization of the text, and no end-of-sequence
  token added (a completion cut at the length limit stays cut; one that ended carries its own end token). The text
  columns are then for reading and for reward functions only.
- `tool_mask` (optional, with the token ids; TRL's name): one 0 / 1 per completion token, 0 on the tokens the policy
  did not produce (tool results, the template's headers around them). Those tokens are context: they are not
  trained and do not count in log pi, log mu, the ratio, the length normalization or the metrics.

The *trained tokens* of a row are the completion tokens the policy produced; per-token `behavior_logps` give one
value per trained token. Every row must keep at least one trained token after tokenization and `max_length`
truncation. An empty completion does: it is trained on what the tokenization adds after it (the EOS token of text,
the end of the assistant turn of messages), the decision to stop at once.

Errors name the column and the first offending row, and are raised before any model is loaded or trained.
"""

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling


# Canonical column names inside the trainer. User columns are renamed to these before tokenization.
PROMPT, COMPLETION, REWARD, BEHAVIOR_LOGPS = "prompt", "completion", "reward", "behavior_logps"
# Token ids of sampled data (TRL's names for tokenized prompt-completion data); never renamed.
PROMPT_IDS, COMPLETION_IDS = "prompt_ids", "completion_ids"
# 0 on the completion tokens the policy did not produce (TRL's name, as its GRPO trainer records tool results)
TOOL_MASK = "tool_mask"


class TOPRDataError(ValueError):
    """A dataset breaks the TOPR data contract. The message names the column and the first offending row."""


def data_error(dataset_name: str, column: str, row: int, problem: str) -> TOPRDataError:
    """
    The error of a bad value in a dataset, worded the same everywhere: the dataset, the column and the row, then the
    problem.

    Args:
        dataset_name (`str`):
            The dataset's name in the message (e.g. `"train"`).
        column (`str`):
            The column of the bad value.
        row (`int`):
            Its row.
        problem (`str`):
            What is wrong with it, and what was expected.

    Returns:
        [`TOPRDataError`]: the error, to raise.
    """
    return TOPRDataError(f"{dataset_name} dataset, column '{column}', row {row}: {problem}")


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


# Roles chat templates know. Another role (a typo such as "usr") would be rendered as is and train on a wrong prompt.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")


def completion_text(completion) -> str:
    """The text of a completion: a string (standard format), or the content of the last assistant turn
    (conversational; empty when that turn only calls tools)."""
    if isinstance(completion, str):
        return completion
    turns = [m for m in completion if m["role"] == "assistant"]
    return (turns[-1].get("content") or "") if turns else ""


def is_multi_turn(completion) -> bool:
    """
    Whether a completion is a multi-turn trajectory: a conversational completion other than one assistant message
    (several turns, or `tool` messages). Its trained tokens are those the policy produced in its assistant turns
    (see [`~trl_topr.trajectories.trajectory_ids`]).

    Args:
        completion (`str` or `list[dict]`):
            The completion, text or messages.

    Returns:
        `bool`: whether it is multi-turn.
    """
    return isinstance(completion, list) and (len(completion) != 1 or completion[0]["role"] != "assistant")


def _is_message(message: Any) -> bool:
    # TRL's message: a string role and content; an assistant turn that calls tools may have no content
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    content = message.get("content")
    if message["role"] == "assistant" and message.get("tool_calls"):
        return content is None or isinstance(content, (str, list))
    return isinstance(content, (str, list))


def _check_text(value: Any, conversational: bool, dataset_name: str, column: str, row: int, is_completion: bool):
    if conversational:
        if not isinstance(value, list) or not all(_is_message(m) for m in value):
            raise data_error(
                dataset_name,
                column,
                row,
                f"expected a list of messages with string 'role' and 'content' (row 0's prompt is conversational), "
                f"got {value!r}.",
            )
        unknown = [m["role"] for m in value if m["role"] not in KNOWN_ROLES]
        if unknown:
            raise data_error(dataset_name, column, row, f"unknown role {unknown[0]!r}: expected one of {KNOWN_ROLES}.")
        if is_completion and not value:
            raise data_error(dataset_name, column, row, "a completion needs at least one message, got [].")
    else:
        if not isinstance(value, str):
            raise data_error(
                dataset_name,
                column,
                row,
                f"expected a string (row 0's prompt is text), got {type(value).__name__}: {value!r}.",
            )


def _check_turns(prompt: list, completion: list, dataset_name: str, column: str, row: int) -> None:
    # A trajectory: the policy speaks at least once, and every tool message answers an assistant turn before it.
    if not any(m["role"] == "assistant" for m in completion):
        raise data_error(
            dataset_name,
            column,
            row,
            f"the completion has no assistant turn, so no token of the policy to train (roles "
            f"{[m['role'] for m in completion]}). A conversational completion holds what the policy said.",
        )
    # who spoke last before the tool messages (tool results at the end of the prompt answer an earlier call)
    speaker = next((m["role"] for m in reversed(prompt) if m["role"] != "tool"), None)
    for index, message in enumerate(completion):
        if message["role"] == "tool" and speaker != "assistant":
            raise data_error(
                dataset_name,
                column,
                row,
                f"message {index} is a tool result with no assistant turn before it to have called the tool (it "
                f"follows {speaker!r}).",
            )
        if message["role"] != "tool":
            speaker = message["role"]


def check_prompts(dataset: Dataset, dataset_name: str = "prompts") -> None:
    """
    Check a prompts dataset, what sampling, evaluation and the iterative loop generate from: a map-style dataset with
    rows and a `prompt` column of text, or of lists of messages, in one format.

    Args:
        dataset ([`~datasets.Dataset`]):
            The prompts (other columns are passed to the reward functions and are not checked).
        dataset_name (`str`, *optional*, defaults to `"prompts"`):
            Name used in error messages.

    Raises:
        [`TOPRDataError`]: naming the column and the first offending row.
    """
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset):
        raise TypeError(
            f"The {dataset_name} dataset must be a map-style `datasets.Dataset`, got {type(dataset).__name__}."
        )
    if PROMPT not in dataset.column_names:
        raise TOPRDataError(f"{dataset_name} dataset: missing column '{PROMPT}' (found {dataset.column_names}).")
    if len(dataset) == 0:
        raise TOPRDataError(f"The {dataset_name} dataset has no rows.")
    prompts = dataset[PROMPT]
    conversational = isinstance(prompts[0], list)
    for row, prompt in enumerate(prompts):
        _check_text(prompt, conversational, dataset_name, PROMPT, row, is_completion=False)
        if conversational and not prompt:
            raise data_error(dataset_name, PROMPT, row, "a conversational prompt needs at least one message, got [].")


def validate_and_standardize(dataset: Dataset, args, dataset_name: str = "train") -> Dataset:
    """
    Check a raw TOPR dataset and rename its columns to the canonical `prompt`, `completion`, `reward` and
    `behavior_logps` (a `label` column becomes `reward` +1 / -1).

    Args:
        dataset ([`~datasets.Dataset`]):
            Raw dataset, see the module docstring for its columns.
        args ([`TOPRConfig`]):
            Configuration holding the column names.
        dataset_name (`str`, *optional*, defaults to `"train"`):
            Name used in error messages.

    Returns:
        [`~datasets.Dataset`]: the dataset with canonical column names and float rewards.

    Raises:
        [`TOPRDataError`]: naming the column and the first offending row.
    """
    _check_columns(dataset, args, dataset_name)
    columns = dataset.column_names
    # Prompts and completions: one format (standard or conversational) for the whole dataset. An empty completion is
    # valid: it is trained on what the tokenization adds after it (the EOS token, the end of the assistant turn).
    prompts, completions = dataset[args.prompt_column], dataset[args.completion_column]
    conversational = isinstance(prompts[0], list)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        _check_text(prompt, conversational, dataset_name, args.prompt_column, row, is_completion=False)
        _check_text(completion, conversational, dataset_name, args.completion_column, row, is_completion=True)
        if conversational:
            _check_turns(prompt, completion, dataset_name, args.completion_column, row)
    _check_token_ids(dataset, dataset_name)
    _check_multi_turn(dataset, args, dataset_name)
    rewards = _checked_rewards(dataset, args, dataset_name)
    if args.behavior_logps_column in columns:
        _check_behavior_logps(dataset[args.behavior_logps_column], args, dataset_name)

    # Rename to the canonical names TRL's tokenization and the collator read.
    renames = {
        args.prompt_column: PROMPT,
        args.completion_column: COMPLETION,
        args.behavior_logps_column: BEHAVIOR_LOGPS,
        args.reward_column: REWARD,
    }
    renames = {column: target for column, target in renames.items() if column != target and column in columns}
    clashes = [target for target in renames.values() if target in columns]
    if clashes:
        raise TOPRDataError(
            f"{dataset_name} dataset: column(s) {clashes} exist but the config reads other columns for them "
            f"({renames}). Remove or rename them."
        )
    dataset = dataset.rename_columns(renames)
    if REWARD in dataset.column_names:
        dataset = dataset.remove_columns(REWARD)  # replaced by the checked float rewards
    return dataset.add_column(REWARD, rewards)


def _check_columns(dataset, args, dataset_name: str) -> None:
    # A map-style dataset with rows and the columns the configuration names.
    if isinstance(dataset, IterableDataset):
        raise TOPRDataError(
            f"The {dataset_name} dataset is an `IterableDataset`: TOPR needs a map-style `datasets.Dataset`, since "
            "the data is validated, the baseline derived and the behavior log-probs computed over the whole set "
            "before training. Materialize it first, e.g. `Dataset.from_list(list(iterable_dataset))`."
        )
    if not isinstance(dataset, Dataset):
        raise TypeError(f"The {dataset_name} dataset must be a `datasets.Dataset`, got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise TOPRDataError(f"The {dataset_name} dataset has no rows.")
    columns = dataset.column_names
    for column in (args.prompt_column, args.completion_column):
        if column not in columns:
            raise TOPRDataError(f"{dataset_name} dataset: missing column '{column}' (found {columns}).")
    if args.reward_column not in columns and args.label_column not in columns:
        raise TOPRDataError(
            f"{dataset_name} dataset: missing column '{args.reward_column}' (or a boolean '{args.label_column}' "
            f"column) (found {columns})."
        )


def _check_token_ids(dataset, dataset_name: str) -> None:
    # Token ids: both columns or neither, lists of token ids, at least one completion token.
    columns = dataset.column_names
    if (PROMPT_IDS in columns) != (COMPLETION_IDS in columns):
        present, absent = (PROMPT_IDS, COMPLETION_IDS) if PROMPT_IDS in columns else (COMPLETION_IDS, PROMPT_IDS)
        raise TOPRDataError(
            f"{dataset_name} dataset: column '{present}' without '{absent}': token ids are given for both the prompt "
            "and the completion, or for neither (then the text is tokenized)."
        )
    if PROMPT_IDS in columns:
        for column in (PROMPT_IDS, COMPLETION_IDS):
            for row, ids in enumerate(dataset[column]):
                if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise data_error(
                        dataset_name, column, row, f"expected a list of token ids (ints >= 0), got {ids!r}."
                    )
                if column == COMPLETION_IDS and not ids:
                    raise data_error(dataset_name, column, row, "a completion needs at least one token id, got [].")
    if TOOL_MASK in columns:
        if COMPLETION_IDS not in columns:
            raise TOPRDataError(
                f"{dataset_name} dataset: column '{TOOL_MASK}' without '{COMPLETION_IDS}': the mask marks the "
                "policy's tokens among the completion's token ids."
            )
        for row, (mask, ids) in enumerate(zip(dataset[TOOL_MASK], dataset[COMPLETION_IDS], strict=True)):
            if not isinstance(mask, list) or not all(m in (0, 1) and not isinstance(m, float) for m in mask):
                raise data_error(dataset_name, TOOL_MASK, row, f"expected a list of 0 / 1, got {mask!r}.")
            if len(mask) != len(ids):
                raise data_error(
                    dataset_name,
                    TOOL_MASK,
                    row,
                    f"{len(mask)} values for {len(ids)} completion token ids: one per token of '{COMPLETION_IDS}'.",
                )
            if not any(mask):
                raise data_error(
                    dataset_name,
                    TOOL_MASK,
                    row,
                    "no token of the completion is the policy's (the mask is all 0): nothing to train.",
                )


def first_multi_turn_row(dataset: Dataset, column: str = COMPLETION) -> int | None:
    """
    The first row of `dataset` whose completion is multi-turn ([`is_multi_turn`]) and is trained from its text (no
    token ids), or `None`: whether the text is tokenized turn by turn
    ([`~trl_topr.trajectories.trajectory_ids`]).

    Args:
        dataset ([`~datasets.Dataset`]):
            The dataset.
        column (`str`, *optional*, defaults to `"completion"`):
            Its completion column.

    Returns:
        `int` or `None`: the row.
    """
    if PROMPT_IDS in dataset.column_names:  # the ids are trained, with their `tool_mask`
        return None
    return next((row for row, c in enumerate(dataset[column]) if is_multi_turn(c)), None)


def _check_multi_turn(dataset, args, dataset_name: str) -> None:
    # Multi-turn completions given as token ids need their tool mask: no way to tell the policy's tokens otherwise.
    if PROMPT_IDS not in dataset.column_names or TOOL_MASK in dataset.column_names:
        return
    column = args.completion_column
    row = next((row for row, c in enumerate(dataset[column]) if is_multi_turn(c)), None)
    if row is not None:
        raise data_error(
            dataset_name,
            column,
            row,
            f"a multi-turn completion (tool messages or several turns) given as token ids needs a '{TOOL_MASK}' "
            f"column: 0 on the tokens the policy did not produce (the tool results), so that they are not trained.",
        )


def _checked_rewards(dataset, args, dataset_name: str) -> list[float]:
    # Rewards: finite numbers, or booleans in the label column (+1 / -1).
    if args.reward_column in dataset.column_names:
        rewards = dataset[args.reward_column]
        for row, reward in enumerate(rewards):
            if not _is_number(reward):
                hint = f" For boolean outcomes use a '{args.label_column}' column." if isinstance(reward, bool) else ""
                raise data_error(dataset_name, args.reward_column, row, f"expected a number, got {reward!r}.{hint}")
            if not math.isfinite(reward):
                raise data_error(dataset_name, args.reward_column, row, f"reward must be finite, got {reward}.")
        return [float(r) for r in rewards]
    labels = dataset[args.label_column]
    for row, label in enumerate(labels):
        if not isinstance(label, bool):
            raise data_error(dataset_name, args.label_column, row, f"expected a boolean, got {label!r}.")
    return [1.0 if label else -1.0 for label in labels]


def _check_behavior_logps(values: list, args, dataset_name: str) -> None:
    # Behavior log-probs: one column format, finite and <= 0.
    column = args.behavior_logps_column
    per_token = isinstance(values[0], list)
    if args.ratio_level == "token" and not per_token:
        raise TOPRDataError(
            f"{dataset_name} dataset, column '{column}': `ratio_level='token'` needs per-token "
            "behavior log-probs, but row 0 gives one float. Give a list per row, or drop the column to have them "
            "computed."
        )
    for row, value in enumerate(values):
        items = value if per_token and isinstance(value, list) else [value]
        if (per_token and not isinstance(value, list)) or not all(_is_number(v) for v in items):
            raise data_error(
                dataset_name,
                column,
                row,
                f"expected {'a list of floats' if per_token else 'a float'}, like row 0, got {value!r}.",
            )
        for v in items:
            if not math.isfinite(v) or v > 0:
                raise data_error(dataset_name, column, row, f"log-probabilities must be finite and <= 0, got {v}.")


def check_and_truncate_tokens(dataset: Dataset, max_length: int | None, dataset_name: str = "train") -> Dataset:
    """
    Check a tokenized TOPR dataset (as produced by TRL's SFT tokenization, with `labels` at -100 on the prompt) and
    truncate it to `max_length`, keeping the start.

    The completion tokens (the trained tokens) are those whose label is not -100: the tokens of the completion text
    plus the end-of-sequence token appended to standard (non-conversational) completions; for conversational data,
    everything the chat template renders after the prompt's generation prompt (e.g. the end-of-turn token); for token
    ids (also those of multi-turn completions, see [`~trl_topr.trajectories.trajectory_ids`]), the completion ids
    where the `tool_mask` is 1. A token at position 0 (an empty
    prompt with a tokenizer that adds no BOS token) has no context to be scored from and is not a completion token.
    Per-token `behavior_logps` must have one value per completion token, in order, and are truncated with the
    completion.

    Args:
        dataset ([`~datasets.Dataset`]):
            Tokenized dataset with `input_ids`, `labels` and optionally `behavior_logps`.
        max_length (`int`, *optional*):
            Maximum sequence length. `None` keeps every token.
        dataset_name (`str`, *optional*, defaults to `"train"`):
            Name used in error messages.

    Returns:
        [`~datasets.Dataset`]: the truncated dataset.

    Raises:
        [`TOPRDataError`]: naming the column and the first offending row.
    """
    behavior = dataset[BEHAVIOR_LOGPS] if BEHAVIOR_LOGPS in dataset.column_names else None
    per_token = behavior is not None and isinstance(behavior[0], list)
    needs_rewrite = False
    for row, labels in enumerate(dataset["labels"]):
        if labels[0] != -100:  # the first token is never predicted: drop it from the completion
            labels = [-100] + labels[1:]
            needs_rewrite = True
        num_completion = sum(label != -100 for label in labels)
        if num_completion == 0:
            raise data_error(
                dataset_name,
                COMPLETION,
                row,
                "the completion has no token to train on after tokenization (e.g. a single-token sequence with an "
                "empty prompt: its first token has no context to be predicted from).",
            )
        if per_token and len(behavior[row]) != num_completion:
            raise data_error(
                dataset_name,
                BEHAVIOR_LOGPS,
                row,
                f"{len(behavior[row])} per-token values for {num_completion} trained tokens: one per token the "
                "policy produced, in order. The trained tokens are: for token ids, those of `completion_ids` (where "
                f"'{TOOL_MASK}' is 1); for text, the completion plus the EOS token; for messages, everything the chat "
                "template renders after the generation prompt, or, in a dataset of multi-turn completions, what the "
                "policy generated in each assistant turn, up to its end-of-turn token (not the tool results, nor the "
                "headers the template puts around them).",
            )
        if max_length is None or len(labels) <= max_length:
            continue
        needs_rewrite = True
        kept = sum(label != -100 for label in labels[:max_length])
        if kept == 0:
            raise data_error(
                dataset_name,
                PROMPT,
                row,
                f"the prompt fills `max_length` ({max_length}): no completion token is left to train on. Raise "
                "`max_length` or shorten the prompt.",
            )
        if behavior is not None and not per_token and kept < num_completion:
            raise data_error(
                dataset_name,
                BEHAVIOR_LOGPS,
                row,
                f"`max_length` ({max_length}) cuts the completion to {kept} of its {num_completion} tokens, but the "
                "behavior log-prob is a sum over the whole completion, so the ratio pi/mu would be wrong. Raise "
                "`max_length`, or give per-token behavior log-probs (which are truncated with the completion).",
            )
    if not needs_rewrite:
        return dataset

    def truncate(example):
        output = {"input_ids": example["input_ids"][:max_length], "labels": [-100] + example["labels"][1:max_length]}
        if per_token:
            output[BEHAVIOR_LOGPS] = example[BEHAVIOR_LOGPS][: sum(label != -100 for label in output["labels"])]
        return output

    return dataset.map(truncate, desc=f"Truncating {dataset_name} dataset")


def bucketed_length(length: int, multiple: int | None = None) -> int:
    """
    The length a padding-free batch of `length` tokens is padded to with length buckets: the next multiple of 128 up
    to 512 tokens, then of a quarter of the power of two below it (640, 768, 896, 1024, 1280, ...), so 4 lengths per
    doubling and, above 512 tokens, less than 25% padding; also a multiple of `multiple` (`pad_to_multiple_of`),
    whose steps are then the least common multiples. Without `multiple`, a run of batches of any lengths up to N
    tokens has at most `4 + 4 * log2(N / 512)` distinct lengths: flex attention compiles its kernels and its block
    mask once per length (see [`PaddingFreeCollator`]).

    Args:
        length (`int`):
            The batch's tokens, its rows laid end to end.
        multiple (`int`, *optional*):
            A multiple the length must also be.

    Returns:
        `int`: the padded length, at least `length`.
    """
    step = 128 if length <= 512 else 2 ** ((length - 1).bit_length() - 3)
    step = math.lcm(step, multiple or 1)
    return -(-length // step) * step


@dataclass
class PaddingFreeCollator(DataCollatorForLanguageModeling):
    """
    TRL's [`~trl.trainer.sft_trainer.DataCollatorForLanguageModeling`], which can pad a padding-free batch up to a
    bucket of lengths ([`bucketed_length`]). With flex attention, every new length of a padding-free batch compiles
    flex attention's kernels and its block mask again; buckets bound how many lengths a run meets. The padding is
    TRL's (`pad_to_multiple_of`'s): padding tokens, each a sequence of its own at position 0, labelled -100, so no
    completion row (see [`~trl_topr.logprobs.completion_rows`]) and no part of the loss.

    Args:
        length_buckets (`bool`, *optional*, defaults to `False`):
            Pad each padding-free batch to its bucket. No effect on padded batches.
    """

    length_buckets: bool = False

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if not (self.padding_free and self.length_buckets):
            return super().torch_call(examples)
        multiple = self.pad_to_multiple_of
        self.pad_to_multiple_of = bucketed_length(sum(len(example["input_ids"]) for example in examples), multiple)
        try:  # TRL pads the one flattened row to a multiple: this batch's bucket
            return super().torch_call(examples)
        finally:
            self.pad_to_multiple_of = multiple


@dataclass
class DataCollatorForTOPR(PaddingFreeCollator):
    """
    Data collator for TOPR: TRL's [`~trl.trainer.sft_trainer.DataCollatorForLanguageModeling`] (right padding,
    `labels` at -100 outside the completion; padding-free batches padded to a bucket of lengths with
    `length_buckets`, see [`PaddingFreeCollator`]) plus the rewards and behavior log-probs.

    Each example needs `input_ids`, `labels`, `reward` and `behavior_logps` (a float, or one float per completion
    token). The batch adds:

    - `"rewards"`: tensor of shape `(B,)`;
    - `"behavior_logps"`: tensor of shape `(B,)` for per-sequence values, or `(B, T)` for per-token values, placed
      at the positions of their tokens in `input_ids` (0 elsewhere).

    With `padding_free=True` the rows are laid end to end as TRL's collator lays them (`input_ids`, `labels` and
    `position_ids` of shape `(1, total length)`, no `attention_mask`); the rewards stay one per row, and per-token
    behavior log-probs sit at their tokens in that one row. [`~trl_topr.logprobs.completion_rows`] takes each
    completion back out.

    Example:
    ```python
    >>> from trl_topr.data import DataCollatorForTOPR

    >>> collator = DataCollatorForTOPR(pad_token_id=0)
    >>> examples = [
    ...     {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "reward": 1.0, "behavior_logps": [-0.5, -0.25]},
    ...     {"input_ids": [4, 5], "labels": [-100, 5], "reward": -1.0, "behavior_logps": [-2.0]},
    ... ]
    >>> collator(examples)["behavior_logps"]
    tensor([[ 0.0000, -0.5000, -0.2500],
            [ 0.0000, -2.0000,  0.0000]])

    ```
    """

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().torch_call(examples)
        batch["rewards"] = torch.tensor([float(example[REWARD]) for example in examples])
        behavior = [example[BEHAVIOR_LOGPS] for example in examples]
        if isinstance(behavior[0], list):
            # Completion positions are in row-major order, as are the concatenated per-token values.
            aligned = torch.zeros(batch["labels"].shape, dtype=torch.float32)
            aligned[batch["labels"] != -100] = torch.tensor([v for values in behavior for v in values])
            batch["behavior_logps"] = aligned
        else:
            batch["behavior_logps"] = torch.tensor(behavior, dtype=torch.float32)
        return batch
