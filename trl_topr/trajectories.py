"""Multi-turn trajectories: assistant turns, the tool results between them, and which of their tokens the policy
produced.

Only the policy's tokens are trained: a tool's words are not the policy's action, so they have no place in log pi, log
mu or their ratio. A trajectory is trained as token ids with TRL's `tool_mask` (0 on the tokens the policy did not
produce), as a sampler records it; a trajectory given as messages is first cut into those ids here."""

import json
from typing import Any

from datasets import Dataset

from .data import COMPLETION, COMPLETION_IDS, PROMPT, PROMPT_IDS, TOOL_MASK, data_error, first_multi_turn_row
from .tokens import stop_texts, text_tokenizer


# TRL's column of the tools a row's model could call (JSON text or a list of schemas)
TOOLS = "tools"


class TrajectoryError(ValueError):
    """A trajectory the chat template cannot cut into the policy's tokens and the rest."""


def row_tools(tools: Any) -> list | None:
    """The tools of a row as `apply_chat_template` takes them: TRL's `tools` column holds JSON text or a list."""
    return json.loads(tools) if isinstance(tools, str) else tools


def storable(messages: list[dict]) -> list[dict]:
    """
    Messages whose tool calls hold their arguments as JSON text (OpenAI's format), so that one dataset column holds
    the calls of any tools, whatever their arguments' names and types (Arrow gives a column one type). [`render`]
    reads them back.

    Args:
        messages (`list[dict]`):
            Messages, with TRL's `tool_calls` (arguments as a dict or as JSON text).

    Returns:
        `list[dict]`: copies of the messages.
    """
    return [_with_arguments(message, lambda a: a if isinstance(a, str) else json.dumps(a)) for message in messages]


def _with_arguments(message: dict, convert) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and "arguments" in function:
            call = {**call, "function": {**function, "arguments": convert(function["arguments"])}}
        converted.append(call)
    return {**message, "tool_calls": converted}


def _parsed_arguments(arguments):
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def render(processing_class, messages: list[dict], tools: list | None = None, generation_prompt: bool = False) -> str:
    """The text of a conversation, as the chat template renders it (with the tools' schemas, and the generation prompt
    when asked); tool call arguments stored as JSON text ([`storable`]) are rendered as the dicts they hold."""
    messages = [_with_arguments(message, _parsed_arguments) for message in messages]
    return processing_class.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def _not_prefix_preserving(index: int) -> TrajectoryError:
    return TrajectoryError(
        f"the chat template renders the conversation up to message {index} of the completion differently once the "
        "rest follows (it is not prefix-preserving), so the policy's text cannot be told from the rest. Use a "
        "template that renders earlier turns the same way (TRL's `get_training_chat_template` gives one for many "
        "models), or give the trajectory as token ids with a `tool_mask`."
    )


def end_of_turn(text: str, start: int, end: int, stops: list[str]) -> int:
    """
    Where the policy's turn that starts at `start` ends in a rendered conversation: just after the first of the
    end-of-turn texts `stops` found in `text[start:end]` (generation stops at the first such token, so nothing after
    it is the policy's), or at `end` where none is (a template that writes no end-of-turn token). The one cut of
    [`trajectory_ids`] (offline data) and [`tool_suffix_ids`] (the sampler).

    Args:
        text (`str`):
            The rendered conversation.
        start (`int`):
            The turn's start: the end of its generation prompt.
        end (`int`):
            The end of the turn's rendering.
        stops (`list[str]`):
            The texts of the tokens that end a turn ([`~trl_topr.tokens.stop_texts`]).

    Returns:
        `int`: the position after the turn's end.

    Example:
    ```python
    >>> from trl_topr.trajectories import end_of_turn

    >>> text = "<user>7*8?<end><assistant>56<end>\\n<eos>"
    >>> start = text.index("<assistant>") + len("<assistant>")
    >>> text[start : end_of_turn(text, start, len(text), ["<eos>", "<end>"])]  # the first of them, not the last
    '56<end>'

    ```
    """
    found = [(position, len(stop)) for stop in stops if (position := text.find(stop, start, end)) >= 0]
    if not found:
        return end
    position, length = min(found)
    return position + length


def trajectory_ids(
    processing_class, prompt: list[dict], completion: list[dict], tools: list | None = None, stop_ids=None
) -> dict:
    """
    The token ids of a conversational prompt and completion, and which completion tokens the policy produced: what a
    sampler records for the trajectory (the completion's ids and TRL's `tool_mask`).

    The chat template renders the conversation once. In each assistant turn, the policy produced the text from the
    end of the generation prompt (the template's rendering of the conversation before the turn, with
    `add_generation_prompt=True`) to its end-of-turn token ([`end_of_turn`]: the first token of `stop_ids`,
    included; the whole turn where the template writes none). Everything else is context, with mask 0: tool results,
    the headers the template puts around them, the text it adds after the end-of-turn token, system and user turns.
    A trajectory that ends on an assistant turn ends at its end-of-turn token, as generation stops there. Each piece
    is tokenized on its own, as generation cuts the sequence (the policy's tokens do not merge with the template's).

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            The tokenizer (or processor) whose chat template renders the conversation.
        prompt (`list[dict]`):
            The prompt's messages.
        completion (`list[dict]`):
            The completion's messages: assistant turns (`content` and/or TRL's `tool_calls`), `tool` results and
            other turns.
        tools (`list`, *optional*):
            The tools' schemas (or functions), as `apply_chat_template` takes them.
        stop_ids (`set[int]`, *optional*):
            The ids that end a turn: the model's ([`~trl_topr.tokens.end_of_sequence_ids`], what the sampler stops
            at). Defaults to the tokenizer's EOS.

    Returns:
        `dict`: `prompt_ids`, `completion_ids` and `tool_mask` (one 0 / 1 per completion id).

    Raises:
        [`TrajectoryError`]: when the template renders a conversation's start differently once more messages follow
        (it is not prefix-preserving: the policy's text cannot be located), or drops an assistant's tool calls.
    """
    tokenizer, stops = text_tokenizer(processing_class), stop_texts(processing_class, stop_ids)
    full = render(processing_class, prompt + completion, tools)

    def length(messages: list[dict], generation_prompt: bool) -> int:
        text = render(processing_class, messages, tools, generation_prompt)
        if not full.startswith(text):
            raise _not_prefix_preserving(len(messages) - len(prompt))
        return len(text)

    cuts = [length(prompt, generation_prompt=completion[0]["role"] == "assistant")]
    for index, message in enumerate(completion):
        if message["role"] != "assistant":
            continue
        start = length(prompt + completion[:index], generation_prompt=True)
        end = end_of_turn(full, start, length(prompt + completion[: index + 1], generation_prompt=False), stops)
        for call in message.get("tool_calls") or []:
            name = call.get("function", call).get("name", "")
            if name not in full[start:end]:
                raise TrajectoryError(
                    f"the chat template drops the tool calls of message {index} of the completion (the call to "
                    f"{name!r} is not in its rendering), so the policy would be trained on a turn it did not say. "
                    "Use a chat template that renders `tool_calls`."
                )
        cuts += [start, end]
    # a trajectory that ends on the policy's turn ends at its end-of-turn token, as generation does; one that ends on
    # a tool result (the call limit) keeps it as context
    cuts.append(len(full) if completion[-1]["role"] != "assistant" else cuts[-1])

    # Pieces between the cuts alternate: context (the prompt first), then the policy's, then context...
    pieces = [full[a:b] for a, b in zip(cuts, cuts[1:])]
    completion_ids, tool_mask = [], []
    for number, piece in enumerate(pieces):
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        completion_ids += ids
        tool_mask += [number % 2] * len(ids)
    prompt_ids = tokenizer(full[: cuts[0]], add_special_tokens=False)["input_ids"]
    return {PROMPT_IDS: prompt_ids, COMPLETION_IDS: completion_ids, TOOL_MASK: tool_mask}


def tool_suffix_ids(
    processing_class,
    prompt: list[dict],
    completion: list[dict],
    tool_messages: list[dict],
    tools: list | None = None,
    stop_ids=None,
) -> list[int]:
    """
    The token ids that follow the policy's end-of-turn token once tools have answered its calls: the template's text
    around the tool results, the results, and the next generation prompt. What a sampler appends, with mask 0,
    before the policy goes on; the same text [`trajectory_ids`] finds between the turns.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            The tokenizer.
        prompt (`list[dict]`):
            The prompt's messages.
        completion (`list[dict]`):
            The trajectory so far, ending on the assistant turn that called the tools.
        tool_messages (`list[dict]`):
            The tools' results (`{"role": "tool", "name": ..., "content": ...}`).
        tools (`list`, *optional*):
            The tools, as `apply_chat_template` takes them.
        stop_ids (`set[int]`, *optional*):
            The ids that end a turn, where the policy stopped (the engine's); defaults to the tokenizer's EOS.

    Returns:
        `list[int]`: the ids.

    Raises:
        [`TrajectoryError`]: when the template is not prefix-preserving.
    """
    tokenizer = text_tokenizer(processing_class)
    before = render(processing_class, prompt + completion, tools)
    after = render(processing_class, prompt + completion + tool_messages, tools, generation_prompt=True)
    start = len(render(processing_class, prompt + completion[:-1], tools, generation_prompt=True))
    cut = end_of_turn(before, start, len(before), stop_texts(processing_class, stop_ids))
    if not after.startswith(before[:cut]):
        raise _not_prefix_preserving(len(completion))
    return tokenizer(after[cut:], add_special_tokens=False)["input_ids"]


def with_trajectory_ids(dataset: Dataset, processing_class, dataset_name: str = "train", stop_ids=None) -> Dataset:
    """
    `dataset` with the token ids of its trajectories ([`trajectory_ids`]) when it holds multi-turn conversational
    completions given as messages only; as it is otherwise. Every row of such a dataset is cut the same way, a
    single-turn one too (its policy's tokens end at its end-of-turn token).

    Args:
        dataset ([`~datasets.Dataset`]):
            A checked dataset with canonical columns (see [`~trl_topr.data.validate_and_standardize`]) and, optionally,
            TRL's `tools` column.
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            The tokenizer.
        dataset_name (`str`, *optional*, defaults to `"train"`):
            Name used in error messages.
        stop_ids (`set[int]`, *optional*):
            The ids that end a turn (the model's, see [`trajectory_ids`]).

    Returns:
        [`~datasets.Dataset`]: the dataset, with `prompt_ids`, `completion_ids` and `tool_mask` where it had
        multi-turn completions.

    Raises:
        [`~trl_topr.data.TOPRDataError`]: naming the row of a trajectory the chat template cannot cut.
    """
    if first_multi_turn_row(dataset) is None:
        return dataset
    tools = dataset[TOOLS] if TOOLS in dataset.column_names else [None] * len(dataset)
    rows = []
    for row, (prompt, completion, row_tool) in enumerate(zip(dataset[PROMPT], dataset[COMPLETION], tools)):
        try:
            rows.append(trajectory_ids(processing_class, prompt, completion, row_tools(row_tool), stop_ids))
        except TrajectoryError as error:
            raise data_error(dataset_name, COMPLETION, row, str(error)) from error
    for column in (PROMPT_IDS, COMPLETION_IDS, TOOL_MASK):
        dataset = dataset.add_column(column, [r[column] for r in rows])
    return dataset
