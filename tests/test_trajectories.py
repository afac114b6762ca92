"""Multi-turn tool trajectories: exactly the policy's tokens are trained and counted, in the loss, the ratio, the
behavior precompute and replay; padded and padding-free; with real templates (SmolLM2's, and a tool-calling one)."""

import json
import math

import pytest
import torch
from conftest import build_tiny_model, make_args
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.chat_template_utils import qwen2_5_chat_template

import trl_topr.replay
import trl_topr.trainer
from trl_topr import TOPRTrainer
from trl_topr.data import TOPRDataError
from trl_topr.logprobs import completion_row
from trl_topr.replay import metrics_by_age
from trl_topr.trajectories import trajectory_ids


CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "7*8"}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
PROMPT = [{"role": "user", "content": "What is 7 * 8?"}]
# The trajectory: a call in words, a tool's noisy result, the answer
WORDS = [
    {"role": "assistant", "content": "call calc 7*8"},
    {"role": "tool", "content": "zebra 56 zebra"},
    {"role": "assistant", "content": "The answer is 56."},
]
# The same with TRL's tool calls, ended by the call limit on a second call's result
CALLS = [
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calc", "content": "zebra 56 zebra"},
    {"role": "assistant", "content": "The answer is 56."},
]


@pytest.fixture(scope="session")
def tool_model_path(tmp_path_factory) -> str:
    """The tiny model with a tool-calling chat template (Qwen2.5's, as TRL ships it)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-tools")), chat_template=qwen2_5_chat_template)


def policy_pieces(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of consecutive tokens with mask 1."""
    pieces, run = [], []
    for token, bit in zip(ids + [None], mask + [0]):
        if bit:
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    return pieces


def test_smollm2_trains_the_assistant_words_only():
    from trl_topr.embedded import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    row = trajectory_ids(tokenizer, PROMPT, WORDS)
    # exactly what the policy generated after each generation prompt, up to its end-of-turn token
    assert policy_pieces(tokenizer, row["completion_ids"], row["tool_mask"]) == [
        "call calc 7*8<|im_end|>",
        "The answer is 56.<|im_end|>",
    ]
    assert tokenizer.decode(row["prompt_ids"]).endswith(
        "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n"
    )
    context = [i for i, bit in zip(row["completion_ids"], row["tool_mask"]) if not bit]
    assert tokenizer.decode(context) == "\n<|im_start|>tool\nzebra 56 zebra<|im_end|>\n<|im_start|>assistant\n"
    # the pieces are the template's tokens: the sequence is the one the model reads, up to the last end of turn
    template_ids = tokenizer.apply_chat_template(PROMPT + WORDS, tokenize=True, return_dict=False)
    sequence = row["prompt_ids"] + row["completion_ids"]
    assert template_ids[: len(sequence)] == sequence and tokenizer.decode(template_ids[len(sequence) :]) == "\n"


def test_smollm2_template_that_drops_tool_calls_is_refused():
    from trl_topr.embedded import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    with pytest.raises(ValueError, match="drops the tool calls of message 0"):
        trajectory_ids(tokenizer, PROMPT, CALLS)


def test_tool_calling_template_trains_the_calls_and_the_answer(tool_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tool_model_path)
    row = trajectory_ids(tokenizer, PROMPT, CALLS + [{"role": "tool", "name": "calc", "content": "56"}], TOOLS)
    assert policy_pieces(tokenizer, row["completion_ids"], row["tool_mask"]) == [
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "7*8"}}\n</tool_call><|im_end|>',
        "The answer is 56.<|im_end|>",
    ]
    # ended on a tool result (the call limit): legal, its tail is context
    assert row["tool_mask"][-1] == 0
    assert "<tool_response>\n56\n</tool_response>" in tokenizer.decode(row["completion_ids"])


# --- the four places: loss, ratio, behavior precompute, replay ---------------------------------------------------


def trajectory_dataset() -> Dataset:
    answers = ["The answer is 56.", "The answer is 54.", "I do not know.", "56"]
    return Dataset.from_dict(
        {
            "prompt": [PROMPT] * 4,
            "completion": [CALLS[:2] + [{"role": "assistant", "content": a}] for a in answers],
            "tools": [json.dumps(TOOLS)] * 4,
            "reward": [1.0, -1.0, -1.0, 1.0],
        }
    )


def policy_logps(model, tokenizer, dataset: Dataset) -> tuple[list[list[float]], list[list[int]], list[list[int]]]:
    """The sequences a sampler records for the dataset's trajectories, the positions of the tokens the policy
    generated in them (each assistant turn's text after its own context, up to its end-of-turn token), and their log
    pi by a plain forward of the whole sequence."""
    values, positions, sequences = [], [], []
    for prompt, completion, tools in zip(dataset["prompt"], dataset["completion"], dataset["tools"]):
        tools = json.loads(tools)
        # The sequence a sampler records: the prompt with its generation prompt, then each turn and the template's
        # text between them, each tokenized alone.
        ids, where = [], []
        text = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        for index, message in enumerate(completion):
            if message["role"] != "assistant":
                continue
            before = tokenizer.apply_chat_template(
                prompt + completion[:index], tools=tools, add_generation_prompt=True, tokenize=False
            )
            between = before[len(text) :]
            ids += tokenizer(between, add_special_tokens=False)["input_ids"] if between else []
            said = tokenizer.apply_chat_template(prompt + completion[: index + 1], tools=tools, tokenize=False)
            turn = said[len(before) : said.index("<|im_end|>", len(before)) + len("<|im_end|>")]
            generated = tokenizer(turn, add_special_tokens=False)["input_ids"]
            where += range(len(ids), len(ids) + len(generated))
            ids += generated
            text = before + turn
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logps = torch.log_softmax(logits, -1)
        values.append([logps[p - 1, ids[p]].item() for p in where])
        positions.append(where)
        sequences.append(ids)
    return values, positions, sequences


def four_places(model_path: str, tmp_path, padding_free: bool) -> dict[str, bool]:
    """Whether each place trains and counts exactly the policy's tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    dataset = trajectory_dataset()
    expected, positions, sequences = policy_logps(model, tokenizer, dataset)
    args = make_args(tmp_path / "out", padding_free=padding_free, per_device_eval_batch_size=4)
    places = {}

    # precompute: the sampler's sequence, trained at the policy's positions, one value per policy token
    trainer = TOPRTrainer(model_path, args=args, train_dataset=dataset)
    prepared = {tuple(r["input_ids"]): r for r in trainer.train_dataset}
    ok = len(trainer.train_dataset) == len(dataset)
    for values, where, ids in zip(expected, positions, sequences):
        row = prepared.get(tuple(ids))
        ok = (
            ok
            and row is not None
            and [i for i, label in enumerate(row["labels"]) if label != -100] == where
            and torch.allclose(torch.tensor(row["behavior_logps"]), torch.tensor(values), atol=1e-4)
        )
    places["precompute"] = ok

    # loss and ratio: with mu = pi - 0.5 on the policy's tokens, every sequence log-ratio is 0.5
    shifted = dataset.add_column("behavior_logps", [math.fsum(v) - 0.5 for v in expected])
    trainer = TOPRTrainer(model_path, args=args, train_dataset=shifted, eval_dataset=shifted)
    metrics = trainer.evaluate()
    places["ratio"] = (
        abs(metrics["eval_log_ratio_mean"] - 0.5) < 1e-3 and abs(metrics["eval_log_ratio_min"] - 0.5) < 1e-3
    )
    lengths = [len(where) for where in positions]
    places["loss"] = abs(metrics["eval_completion_length"] - sum(lengths) / len(lengths)) < 1e-6

    # replay: the recorded rows (ids, tool mask, per-token mu) at the policy's own log-probs: a ratio of 1
    recorded = Dataset.from_list(
        [
            {**trajectory_ids(tokenizer, p, c, TOOLS), "behavior_logps": v, "reward": r, "sample_round": 1}
            for p, c, v, r in zip(dataset["prompt"], dataset["completion"], expected, dataset["reward"])
        ]
    )
    replay = metrics_by_age(model, recorded, 2, args, 0.0, tokenizer)  # replayed a round later by the same policy
    places["replay"] = abs(replay["age_1/log_ratio_mean"]) < 1e-3 and abs(replay["age_1/log_ratio_min"]) < 1e-3
    return places


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_exactly_the_policy_tokens_count_in_all_four_places(padding_free, tool_model_path, tmp_path):
    assert four_places(tool_model_path, tmp_path, padding_free) == dict.fromkeys(
        ("precompute", "ratio", "loss", "replay"), True
    )


def test_the_test_fails_when_the_mask_is_dropped(tool_model_path, tmp_path, monkeypatch):
    def unmasked(prompt_ids, completion_ids, tool_mask=None):
        return completion_row(prompt_ids, completion_ids)

    monkeypatch.setattr(trl_topr.trainer, "completion_row", unmasked)
    monkeypatch.setattr(trl_topr.replay, "completion_row", unmasked)
    assert not any(four_places(tool_model_path, tmp_path, padding_free=False).values())


def test_token_ids_with_a_tool_mask_train_the_generated_tokens_only(tool_model_path, tmp_path):
    # a sampler's record: generated turns, and the tool's result between them with mask 0
    tokenizer = AutoTokenizer.from_pretrained(tool_model_path)
    first, tool, second = [[7, 8, 9], [10, 11, 12, 13], [14, 15]]
    dataset = Dataset.from_dict(
        {
            "prompt": ["What is 7 * 8?"] * 2,
            "completion": ["call calc 7*8 ... The answer is 56."] * 2,
            "prompt_ids": [[5, 6]] * 2,
            "completion_ids": [first + tool + second] * 2,
            "tool_mask": [[1] * 3 + [0] * 4 + [1] * 2] * 2,
            "reward": [1.0, -1.0],
        }
    )
    trainer = TOPRTrainer(
        tool_model_path, args=make_args(tmp_path / "out"), train_dataset=dataset, processing_class=tokenizer
    )
    for row in trainer.train_dataset:
        assert [t for t in row["labels"] if t != -100] == first + second
        assert len(row["behavior_logps"]) == 5


# --- bad multi-turn input: a clear error naming the row, before training ------------------------------------------


def ids_trajectories(**changes) -> Dataset:
    columns = {
        "prompt": [PROMPT] * 3,
        "completion": [WORDS] * 3,
        "prompt_ids": [[5, 6]] * 3,
        "completion_ids": [[7, 8, 9, 10]] * 3,
        "tool_mask": [[1, 0, 0, 1]] * 3,
        "reward": [1.0, -1.0, 1.0],
    }
    columns.update(changes)
    return Dataset.from_dict(columns)


def with_row(rows: list, row: int, value) -> list:
    return rows[:row] + [value] + rows[row + 1 :]


BAD = {
    "a tool result no assistant turn called": (
        lambda: trajectory_dataset().map(
            lambda r, i: {"completion": [WORDS[1]] + WORDS[2:] if i == 2 else r["completion"]}, with_indices=True
        ),
        "column 'completion', row 2",
        "tool result with no assistant turn before it",
    ),
    "a completion without an assistant turn": (
        lambda: ids_trajectories(completion=with_row([WORDS] * 3, 1, [{"role": "user", "content": "hi"}])),
        "column 'completion', row 1",
        "no assistant turn",
    ),
    "a tool mask of the wrong length": (
        lambda: ids_trajectories(tool_mask=with_row([[1, 0, 0, 1]] * 3, 1, [1, 0, 1])),
        "column 'tool_mask', row 1",
        "3 values for 4 completion token ids",
    ),
    "a tool mask without a policy token": (
        lambda: ids_trajectories(tool_mask=with_row([[1, 0, 0, 1]] * 3, 2, [0, 0, 0, 0])),
        "column 'tool_mask', row 2",
        "nothing to train",
    ),
    "a tool mask of other values": (
        lambda: ids_trajectories(tool_mask=with_row([[1, 0, 0, 1]] * 3, 0, [1, 0, 2, 1])),
        "column 'tool_mask', row 0",
        "list of 0 / 1",
    ),
    "multi-turn token ids without a tool mask": (
        lambda: ids_trajectories().remove_columns("tool_mask"),
        "column 'completion', row 0",
        "needs a 'tool_mask' column",
    ),
    "per-token behavior log-probs over tokens that are not trained": (
        lambda: ids_trajectories(behavior_logps=with_row([[-1.0, -1.0]] * 3, 1, [-1.0] * 4)),
        "column 'behavior_logps', row 1",
        "4 per-token values for 2 trained tokens",
    ),
    "a template that drops the tool calls": (
        lambda: trajectory_dataset(),
        "column 'completion', row 0",
        "drops the tool calls",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_multi_turn_input_raises_before_training(case, tiny_model_path, tool_model_path, tmp_path):
    make_dataset, where, what = BAD[case]
    # the plain ChatML template of the tiny model renders no tool calls
    model_path = tiny_model_path if case == "a template that drops the tool calls" else tool_model_path
    output_dir = tmp_path / "out"
    with pytest.raises(TOPRDataError) as error:
        TOPRTrainer(model_path, args=make_args(output_dir), train_dataset=make_dataset())
    assert where in str(error.value) and what in str(error.value)
    assert not output_dir.exists() or not any(output_dir.iterdir())


def test_a_completion_may_go_on_from_tool_results_that_end_the_prompt(tiny_model_path, tmp_path):
    # the prompt ends with the assistant's call and a first result; the completion starts with a second result of
    # that call, then answers: legal, the call came before (ChatML renders each message alone: prefix-preserving)
    prompt = PROMPT + WORDS[:2]
    completion = [{"role": "tool", "content": "56"}, WORDS[2]]
    rows = {"prompt": [prompt] * 2, "completion": [completion] * 2, "reward": [1.0, -1.0]}
    trainer = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "out"), train_dataset=Dataset.from_dict(rows))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    row = trainer.train_dataset[0]
    assert tokenizer.decode([t for t in row["labels"] if t != -100]) == "The answer is 56.<|im_end|>"


def template_tokenizer(tiny_model_path, template: str, specials: list[str], eos: str, stops: list[str]):
    """The tiny tokenizer with another model's chat template and special tokens, and that model's generation stop ids
    (built offline: the template is TRL's copy)."""
    from transformers import GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token, tokenizer.chat_template = eos, template
    if "<bos>" in specials:
        tokenizer.bos_token = "<bos>"
    return tokenizer, GenerationConfig(eos_token_id=tokenizer.convert_tokens_to_ids(stops))


def test_the_end_of_a_turn_comes_from_the_generation_configs_stop_ids(tiny_model_path):
    from trl.chat_template_utils import gemma_chat_template

    from trl_topr.tokens import end_of_sequence_ids, stop_texts

    # Gemma: turns end with <end_of_turn>, which its generation config stops at beside <eos> (absent from the
    # template). Cut at the tokenizer's EOS alone, each assistant turn would take the template's "\n" after it too.
    tokenizer, config = template_tokenizer(
        tiny_model_path, gemma_chat_template, ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"], "<eos>",
        ["<eos>", "<end_of_turn>"],
    )  # fmt: skip
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    stops = end_of_sequence_ids(config, tokenizer)
    assert stops == {tokenizer.eos_token_id, end} and set(stop_texts(tokenizer, stops)) == {"<eos>", "<end_of_turn>"}
    completion = [
        {"role": "assistant", "content": "7 * 8 = 56"},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes, 56."},
    ]
    row = trajectory_ids(tokenizer, PROMPT, completion, stop_ids=stops)
    policy = [[t for t, m in zip(row["completion_ids"], row["tool_mask"]) if m]]
    turns = [i for i, m in enumerate(row["tool_mask"]) if m and row["completion_ids"][i] == end]
    assert len(turns) == 2 and row["completion_ids"][-1] == end  # each turn ends on <end_of_turn>, nothing after
    assert all(row["tool_mask"][i + 1] == 0 for i in turns[:1])  # the "\n" after it is the template's
    assert tokenizer.decode(policy[0], skip_special_tokens=True).replace("\n", "") == "7 * 8 = 56Yes, 56."
    eos_only = trajectory_ids(tokenizer, PROMPT, completion)  # the other choice: a different cut
    assert sum(eos_only["tool_mask"]) > sum(row["tool_mask"])
    # Qwen2.5: <|im_end|> ends a turn, and its generation config stops at <|endoftext|> too
    tokenizer, config = template_tokenizer(
        tiny_model_path, qwen2_5_chat_template, ["<|endoftext|>"], "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]
    )
    stops = end_of_sequence_ids(config, tokenizer)
    row = trajectory_ids(tokenizer, PROMPT, CALLS, TOOLS, stop_ids=stops)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, (token, mask) in enumerate(zip(row["completion_ids"], row["tool_mask"])):
        if mask and token == im_end:  # a turn's last policy token; what follows is the template's
            assert i + 1 == len(row["tool_mask"]) or row["tool_mask"][i + 1] == 0


def test_the_sampler_and_the_data_cut_a_turn_at_its_first_stop_token(tiny_model_path):
    from trl_topr.trajectories import end_of_turn, tool_suffix_ids

    # A template whose tool-calling turns end with two stop tokens: the turn ends at the first one, for the sampler's
    # suffix and the offline cut alike (the last one would count the template's <|endoftext|> as the policy's)
    turn_end = "{%- endfor %}\n        {{- '<|im_end|>\\n' }}"
    assert qwen2_5_chat_template.count(turn_end) == 1
    template = qwen2_5_chat_template.replace(turn_end, turn_end.replace("<|im_end|>", "<|im_end|><|endoftext|>"))
    tokenizer, config = template_tokenizer(
        tiny_model_path, template, ["<|endoftext|>"], "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]
    )
    stops = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    call, result = CALLS[:1], CALLS[1:2]
    offline = trajectory_ids(tokenizer, PROMPT, call + result, TOOLS, stop_ids=stops)
    first_turn = [t for t, m in zip(offline["completion_ids"], offline["tool_mask"]) if m]
    suffix = tool_suffix_ids(tokenizer, PROMPT, call, result, TOOLS, stop_ids=stops)
    # the sampler records the first turn, then the suffix (which ends on the next generation prompt): the ids the
    # data cut makes of the trajectory that ends on the tool's result
    assert (first_turn + suffix)[: len(offline["completion_ids"])] == offline["completion_ids"]
    assert first_turn[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert suffix[0] == tokenizer.convert_tokens_to_ids("<|endoftext|>")  # the template's, context
    text = "a<|im_end|>\n<|endoftext|>"
    assert end_of_turn(text, 0, len(text), ["<|endoftext|>", "<|im_end|>"]) == len("a<|im_end|>")
