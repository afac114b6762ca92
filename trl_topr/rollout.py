"""Rollouts: what a policy writes for prompts, through one generation engine, as a sampler records it. A single-turn
completion is a one-turn trajectory; with tools, as TRL's GRPO trainer samples (`tools`,
`max_tool_calling_iterations`), the policy generates a turn, the tool calls TRL's `parse_response` finds in it are run,
their results appended, and the policy goes on, until it answers without a call or reaches the limit. Each trajectory
is recorded with the token ids generated and appended and, with tools, TRL's `tool_mask` (1 on the tokens the policy
generated, 0 on the rest). A [`~trl_topr.Sampler`] calls [`rollout`] to sample and to evaluate."""

import dataclasses
import time
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase
from trl.chat_template_utils import add_response_schema, parse_response, supports_tool_calling

from .distributed import on_main_process
from .generation import GenerationEngine, Generations, SamplingSettings
from .tokens import text_tokenizer
from .trajectories import TrajectoryError, tool_suffix_ids


@dataclasses.dataclass
class Trajectories:
    """
    What [`rollout`] returns, one entry per trajectory, prompt-major (the samples of prompt 0 first).

    Args:
        completions (`list`):
            Each trajectory: its text, or its messages for a conversational prompt (one assistant turn without tools;
            with tools, the assistant turns, TRL's parsed `content` / `tool_calls`, and the tool results).
        completion_ids (`list[list[int]]`):
            The token ids after the prompt: the generated turns and, with tools, the template's text with the tool
            results between them.
        tool_mask (`list[list[int]]`, *optional*):
            With tools, one 0 / 1 per completion id: 1 on the tokens the policy generated. `None` without tools:
            every token is the policy's.
        logprobs (`list[list[float]]`, *optional*):
            The engine's log-prob of each generated token (mask 1 only), `None` where the engine has none.
        tool_calls (`list[int]`):
            The tool calls each trajectory made (0 each without tools).
        tool_failures (`list[int]`):
            Those that failed (an unknown tool, or one that raised).
        tokens_per_s (`float`):
            Generated tokens per second of wall time.
    """

    completions: list
    completion_ids: list[list[int]]
    tool_mask: list[list[int]] | None
    logprobs: list[list[float]] | None
    tool_calls: list[int]
    tool_failures: list[int]
    tokens_per_s: float


def prepare_tool_calling(processing_class: PreTrainedTokenizerBase, tools: list[Callable]) -> None:
    """
    Check that tools can be shown and called, and that the chat template can show them and their results; give the
    tokenizer TRL's response parser for its template when it has none
    ([`~trl.chat_template_utils.add_response_schema`]), as TRL's GRPO trainer does. A [`~trl_topr.Sampler`] runs it
    once per set of tools, when it is built.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        tools (`list[Callable]`):
            The tools: functions with type hints and a docstring describing their arguments (what
            `apply_chat_template` turns into their schemas).

    Raises:
        `ValueError`: for a tool that is not a function, two tools of one name, or a template that cannot render a
            tool-calling conversation or that TRL knows no parser for.
    """
    if not tools:
        return
    not_functions = [tool for tool in tools if not callable(tool) or not hasattr(tool, "__name__")]
    if not_functions:
        raise ValueError(f"`tools` must be functions, got {not_functions[0]!r}.")
    names = [tool.__name__ for tool in tools]
    if len(set(names)) < len(names):
        raise ValueError(f"`tools` must have distinct names (the policy calls them by name), got {names}.")
    if not supports_tool_calling(processing_class):
        raise ValueError(
            "The chat template cannot render a tool-calling conversation (user -> assistant with tool_calls -> "
            "tool), so the policy would never see its tools or their results. Use a model whose template supports "
            "tools, or set one (e.g. `tokenizer.chat_template`)."
        )
    tokenizer = text_tokenizer(processing_class)
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        add_response_schema(processing_class)


def with_tool_template(processing_class: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """
    `processing_class`, able to show tools: as it is when its chat template renders a tool-calling conversation; a
    ChatML tokenizer whose template does not (SmolLM2's, for one) gets TRL's copy of Qwen2.5's ChatML template, which
    renders the same system, user and assistant turns and adds the tools, their calls and their results.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer; its `chat_template` is replaced in place where it is given one.

    Returns:
        [`~transformers.PreTrainedTokenizerBase`]: the same tokenizer.

    Raises:
        `ValueError`: for a template that renders no tools on a tokenizer that is not ChatML.
    """
    from trl.chat_template_utils import qwen2_5_chat_template

    if supports_tool_calling(processing_class):
        return processing_class
    if "<|im_start|>" not in text_tokenizer(processing_class).get_vocab():
        raise ValueError(
            "The tokenizer's chat template renders no tools, and it is not a ChatML tokenizer that can be given a "
            "tool template. Set a chat template that supports tools (`tokenizer.chat_template`)."
        )
    text_tokenizer(processing_class).chat_template = qwen2_5_chat_template
    return processing_class


def call_tools(tool_calls: list[dict], tools: dict[str, Callable]) -> tuple[list[dict], int]:
    """
    Run a turn's tool calls, as TRL's GRPO trainer runs them: each call's function with its arguments; an unknown
    tool, a call that is not a function call, or a tool that raises gives `{"error": ...}` as its result.

    Args:
        tool_calls (`list[dict]`):
            The turn's calls, as TRL's `parse_response` gives them.
        tools (`dict[str, Callable]`):
            The tools by name.

    Returns:
        `tuple[list[dict], int]`: the tool messages (`{"role": "tool", "name": ..., "content": ...}`) and the number
        of failed calls.
    """
    messages, failures = [], 0
    for call in tool_calls:
        function = call.get("function") if call.get("type", "function") == "function" else None
        name = (function or call).get("name") or "unknown"
        try:
            if not isinstance(function, dict):
                raise ValueError(f"Unsupported tool call type: {call.get('type')!r}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            result = tools[name](**(function.get("arguments") or {}))
        except Exception as error:  # a tool's failure is the policy's outcome, reported back to it
            failures += 1
            result = {"error": str(error)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages, failures


def rollout(
    engine: GenerationEngine,
    processing_class: PreTrainedTokenizerBase,
    prompts: list,
    prompt_ids: list[list[int]],
    sampling: SamplingSettings,
    tools: list[Callable] | list[list[Callable]] | None = None,
    max_tool_calling_iterations: int | None = None,
    progress: bool = True,
) -> Trajectories:
    """
    Sample `sampling.num_samples` trajectories per prompt: one turn each, or several with tools in the loop.

    Every trajectory's first turn is generated from its prompt. Without tools that is the whole completion. With
    tools, while some turns call tools and fewer than `max_tool_calling_iterations` rounds of calls were made, the
    calls are run (once, on the main process, their results shared with every process), the template's text around
    their results is appended ([`~trl_topr.trajectories.tool_suffix_ids`]) and the policy generates its next turn from
    the whole sequence, one sample each. The whole completion (generated turns and tool results) stays within
    `sampling.max_new_tokens`: a tool result that would not leave room for a token ends its trajectory before it, and
    a turn is cut at the limit.

    Args:
        engine ([`~trl_topr.generation.GenerationEngine`]):
            The engine (transformers or vLLM).
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer; with tools, one whose template supports them (see [`prepare_tool_calling`]).
        prompts (`list`):
            The prompts, text or messages (conversational with tools).
        prompt_ids (`list[list[int]]`):
            Their token ids (rendered with the tools).
        sampling ([`~trl_topr.generation.SamplingSettings`]):
            How to sample; later turns are sampled one per trajectory, with the same temperature, top-p and top-k.
        tools (`list[Callable]` or `list[list[Callable]]`, *optional*):
            The tools the policy may call: one list for every prompt, or one list per prompt (the methods of each
            trajectory's environment, see [`~trl_topr.environments.Environments`]); `None` (or none) for single-turn
            completions.
        max_tool_calling_iterations (`int`, *optional*):
            The most rounds of tool calls; `None` for no limit but the length.
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar over the first turns.

    Returns:
        [`Trajectories`]: the trajectories.
    """
    if tools:
        with engine.turns():  # the turns after the first continue it: the engine may keep what spares them work
            first = engine.generate(prompt_ids, sampling, progress)
            return _tool_loop(
                engine, processing_class, prompts, prompt_ids, sampling, tools, max_tool_calling_iterations, first
            )
    first = engine.generate(prompt_ids, sampling, progress)
    count = len(first.completion_ids)
    return Trajectories(
        completions=decode_completions(processing_class, prompts, first.completion_ids),
        completion_ids=first.completion_ids,
        tool_mask=None,
        logprobs=first.logprobs,
        tool_calls=[0] * count,
        tool_failures=[0] * count,
        tokens_per_s=first.tokens_per_s,
    )


def decode_completions(
    processing_class: PreTrainedTokenizerBase, prompts: list, completion_ids: list[list[int]]
) -> list:
    """
    The completions' text, as messages for conversational prompts.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        prompts (`list`):
            The prompts, text or messages.
        completion_ids (`list[list[int]]`):
            Their completions, prompt-major, the same number per prompt.

    Returns:
        `list`: text, or `[{"role": "assistant", "content": text}]` for a conversational prompt.
    """
    tokenizer = text_tokenizer(processing_class)
    per_prompt = len(completion_ids) // max(len(prompts), 1)
    completions = []
    for index, ids in enumerate(completion_ids):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        prompt = prompts[index // per_prompt]
        completions.append([{"role": "assistant", "content": text}] if isinstance(prompt, list) else text)
    return completions


def _tool_loop(
    engine, processing_class, prompts, prompt_ids, sampling, tools, max_tool_calling_iterations, first: Generations
) -> Trajectories:
    # The turns after the first, with tools in the loop (see `rollout`)
    tokenizer = text_tokenizer(processing_class)
    per_prompt = tools if isinstance(tools[0], list) else [tools] * len(prompts)
    limit = sampling.max_new_tokens
    start, count = time.perf_counter(), len(first.completion_ids)
    first_seconds = sum(map(len, first.completion_ids)) / max(first.tokens_per_s, 1e-9)
    owner = [index * len(prompts) // count for index in range(count)]  # prompt-major
    ids = [list(c) for c in first.completion_ids]
    mask = [[1] * len(c) for c in ids]
    logprobs = [list(values) for values in first.logprobs] if first.logprobs is not None else None
    generated = sum(map(len, ids))
    tools = [per_prompt[owner[i]] for i in range(count)]  # each trajectory's
    messages = [[_parsed(tokenizer, ids[i], prompt_ids[owner[i]], tools[i])] for i in range(count)]
    calls, failures = [0] * count, [0] * count
    pending = [i for i in range(count) if messages[i][-1].get("tool_calls")]
    iteration = 0
    while pending and (max_tool_calling_iterations is None or iteration < max_tool_calling_iterations):
        iteration += 1
        results = _run_once([messages[i][-1]["tool_calls"] for i in pending], [tools[i] for i in pending])
        going_on = []  # those with room left for the policy to read the result and answer
        for i, (tool_messages, failed) in zip(pending, results):
            calls[i] += len(tool_messages)
            failures[i] += failed
            suffix = _result_ids(processing_class, prompts[owner[i]], messages[i], tool_messages, tools[i], engine)
            if len(ids[i]) + len(suffix) < limit:
                messages[i] += tool_messages
                ids[i] += suffix
                mask[i] += [0] * len(suffix)
                going_on.append(i)
        pending = going_on
        if not pending:
            break
        seed = None if sampling.seed is None else sampling.seed + 7919 * iteration
        room = limit - min(len(ids[i]) for i in pending)
        turn_sampling = sampling.replace(num_samples=1, max_new_tokens=room, seed=seed)
        turns: Generations = engine.generate([prompt_ids[owner[i]] + ids[i] for i in pending], turn_sampling, False)
        for n, i in enumerate(pending):
            new = turns.completion_ids[n][: limit - len(ids[i])]
            context = prompt_ids[owner[i]] + ids[i]
            ids[i] += new
            mask[i] += [1] * len(new)
            generated += len(new)
            if logprobs is not None:
                logprobs[i] += list(turns.logprobs[n][: len(new)]) if turns.logprobs is not None else [None] * len(new)
            messages[i].append(_parsed(tokenizer, new, context, tools[i]))
        pending = [i for i in pending if messages[i][-1].get("tool_calls")]
    return Trajectories(
        completions=messages,
        completion_ids=ids,
        tool_mask=mask,
        logprobs=logprobs,
        tool_calls=calls,
        tool_failures=failures,
        tokens_per_s=generated / max(first_seconds + time.perf_counter() - start, 1e-9),
    )


def _result_ids(processing_class, prompt, messages: list, tool_messages: list, tools: list, engine) -> list[int]:
    # The template's tokens around a turn's tool results, which the policy reads before its next turn
    try:
        return tool_suffix_ids(processing_class, prompt, messages, tool_messages, tools, engine.eos_ids)
    except TrajectoryError as error:
        raise ValueError(f"Sampling with tools: {error}") from error


def _run_once(turns_calls: list[list[dict]], tools: list[list[Callable]]) -> list[tuple[list[dict], int]]:
    # Each turn's calls with its trajectory's tools, run once, on the main process; every process goes on with the
    # same results
    pairs = list(zip(turns_calls, tools, strict=True))
    return on_main_process(lambda: [call_tools(calls, {t.__name__: t for t in own}) for calls, own in pairs])


def _parsed(tokenizer, ids: list[int], context: list[int], tools: list[Callable]) -> dict:
    # TRL's parser: the turn's content and tool calls (plain text when the calls are malformed)
    message = parse_response(tokenizer, ids, prefix=context, tools=tools)
    return {key: value for key, value in message.items() if key in ("role", "content", "tool_calls")}
