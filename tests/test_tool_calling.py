"""Sampling with tools in the loop: the sampler runs the policy's tool calls and records what it generated, with TRL's
tool mask; reward functions see the whole trajectory; training, replay and resume keep the policy's tokens only."""

import json

import pytest
from conftest import TOOL_PROMPT as PROMPT
from conftest import TOOL_TRAJECTORY as TRAJECTORY
from conftest import make_args, multiply
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_topr import TOPRLoopConfig, TOPRTrainer, evaluate_policy, run_topr_loop, sample_completions
from trl_topr.generation import SamplingSettings
from trl_topr.loop import read_rounds
from trl_topr.trajectories import storable, trajectory_ids


GREEDY = SamplingSettings(num_samples=1, temperature=0.0, max_new_tokens=200)


def prompts(n: int = 1) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPT] * n, "answer": ["56"] * n})


def says_56(prompts, completions, answer, **kwargs):
    """1 when the last turn gives the answer, -1 otherwise; the trajectory's tool results are there to read."""
    return [
        1.0 if c[-1]["role"] == "assistant" and a in c[-1]["content"] else -1.0 for c, a in zip(completions, answer)
    ]


def load(path):
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_the_sampler_runs_the_call_and_records_what_the_policy_generated(tool_policy):
    model, tokenizer = load(tool_policy)
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return says_56(prompts, completions, **kwargs)

    samples = sample_completions(
        model, prompts(), reward, processing_class=tokenizer, sampling=GREEDY, tools=[multiply], progress=False
    )
    row = samples[0]
    # the policy called the tool, read its result (computed by the tool, 7 * 8), and answered
    assert [(m["role"], m["content"]) for m in row["completion"]] == [
        ("assistant", ""),
        ("tool", "56"),
        ("assistant", "The answer is 56."),
    ]
    assert row["completion"][0]["tool_calls"] == storable(TRAJECTORY)[0]["tool_calls"]  # arguments as JSON text
    assert json.loads(row["completion"][0]["tool_calls"][0]["function"]["arguments"]) == {"a": 7, "b": 8}
    assert (row["tool_call_count"], row["tool_failure_count"], row["reward"]) == (1, 0, 1.0)
    assert seen[0][1] == {"role": "tool", "name": "multiply", "content": "56"}  # the reward saw the whole trajectory
    # the record is the one the data contract cuts from the messages: the generated turns with mask 1, the tool's
    # result and the template's text around it with mask 0
    expected = trajectory_ids(tokenizer, PROMPT, TRAJECTORY, [multiply])
    assert (row["prompt_ids"], row["completion_ids"], row["tool_mask"]) == (
        expected["prompt_ids"],
        expected["completion_ids"],
        expected["tool_mask"],
    )
    generated = [i for i, bit in zip(row["completion_ids"], row["tool_mask"]) if bit]
    assert "56\n</tool_response>" not in tokenizer.decode(generated)
    # mu over the generated tokens only
    assert len(row["behavior_logps"]) == sum(row["tool_mask"]) < len(row["completion_ids"])


def test_training_on_sampled_trajectories_starts_at_a_ratio_of_one(tool_policy, tmp_path):
    model, tokenizer = load(tool_policy)
    args = make_args(tmp_path / "out", per_device_eval_batch_size=4)
    samples = sample_completions(
        model,
        prompts(2),
        says_56,
        processing_class=tokenizer,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=200, seed=0),
        args=args,  # mu in the precision the trainer computes pi in
        tools=[multiply],
        progress=False,
    )
    metrics = TOPRTrainer(tool_policy, args=args, train_dataset=samples, eval_dataset=samples).evaluate()
    assert abs(metrics["eval_log_ratio_mean"]) < 1e-4 and abs(metrics["eval_log_ratio_min"]) < 1e-4
    assert metrics["eval_completion_length"] == pytest.approx(sum(map(sum, samples["tool_mask"])) / len(samples))


def failing_multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    raise OverflowError("too big")


def test_a_failing_tool_is_reported_to_the_policy_and_counted(tool_policy):
    model, tokenizer = load(tool_policy)
    failing_multiply.__name__ = "multiply"  # the same tool as the policy knows, that fails
    samples = sample_completions(
        model,
        prompts(),
        says_56,
        processing_class=tokenizer,
        sampling=GREEDY,
        tools=[failing_multiply],
        progress=False,
    )
    row = samples[0]
    assert (row["tool_call_count"], row["tool_failure_count"]) == (1, 1)
    assert row["completion"][1]["content"] == str({"error": "too big"})


def test_the_call_limit_and_the_length_limit_end_a_trajectory_on_the_call(tool_policy):
    model, tokenizer = load(tool_policy)
    first_turn = trajectory_ids(tokenizer, PROMPT, TRAJECTORY[:1], [multiply])["completion_ids"]
    for iterations, sampling in ((0, GREEDY), (None, GREEDY.replace(max_new_tokens=len(first_turn) + 5))):
        samples = sample_completions(
            model,
            prompts(),
            says_56,
            processing_class=tokenizer,
            sampling=sampling,
            tools=[multiply],
            max_tool_calling_iterations=iterations,
        )
        # the trajectory ends on the policy's call, its result not read; it is still trained (its call)
        assert samples[0]["completion_ids"] == first_turn and samples[0]["tool_mask"] == [1] * len(first_turn)
        assert samples[0]["completion"][-1]["tool_calls"] and samples[0]["reward"] == -1.0


def test_evaluation_with_tools_reports_how_often_they_are_called(tool_policy):
    model, tokenizer = load(tool_policy)
    correct = says_56
    metrics = evaluate_policy(
        model,
        tokenizer,
        prompts(2),
        correct,
        lambda text: "56" if "56" in text else None,
        SamplingSettings(num_samples=2, max_new_tokens=200, seed=0),
        tools=[multiply],
        progress=False,
    )
    assert metrics["pass@1_greedy"] == 1.0 and metrics["tool_call_rate_greedy"] == 1.0
    assert 0 < metrics["tool_call_rate"] and metrics["tool_failure_rate"] == 0.0


def test_bad_tool_setups_are_refused_before_sampling(tool_policy, tiny_model_path):
    model, tokenizer = load(tool_policy)
    with pytest.raises(ValueError, match="needs conversational prompts"):
        sample_completions(
            model, Dataset.from_dict({"prompt": ["7 * 8 ="]}), says_56, processing_class=tokenizer, tools=[multiply]
        )
    with pytest.raises(ValueError, match="must be functions"):
        sample_completions(model, prompts(), says_56, processing_class=tokenizer, tools=["multiply"])
    chatml_model, chatml_tokenizer = load(tiny_model_path)  # ChatML without tools
    with pytest.raises(ValueError, match="cannot render a tool-calling conversation"):
        sample_completions(chatml_model, prompts(), says_56, processing_class=chatml_tokenizer, tools=[multiply])


def test_the_loop_samples_with_tools_replays_and_resumes(tool_policy, tmp_path, monkeypatch):
    import trl_topr.rollout

    checks = []  # the template's check renders a conversation: the loop prepares its tools once, not every round
    monkeypatch.setattr(
        trl_topr.rollout,
        "supports_tool_calling",
        lambda tokenizer, check=trl_topr.rollout.supports_tool_calling: checks.append(1) or check(tokenizer),
    )
    args = make_args(tmp_path / "loop", max_steps=1, per_device_train_batch_size=2, learning_rate=1e-5)
    common = dict(
        eval_prompts=prompts(1),
        correct_func=says_56,
        answer_func=lambda text: "56" if "56" in text else None,
        tools=[multiply],
    )
    loop_args = TOPRLoopConfig(num_generations=2, max_completion_length=200, replay_rounds=1)
    run_topr_loop(tool_policy, prompts(2), says_56, loop_args, args, **common)
    loop_args.num_rounds = 2
    rounds = run_topr_loop(tool_policy, prompts(2), says_56, loop_args, args, **common)  # resumes after round 1
    assert [r["round"] for r in rounds] == [0, 1, 2] and rounds == read_rounds(str(tmp_path / "loop"))
    assert len(checks) == 2  # once per call of the loop (each loads its own tokenizer), for 3 rounds and 4 evaluations
    assert rounds[2]["tools/call_frequency"] > 0 and rounds[2]["tools/failure_frequency"] == 0
    assert rounds[2]["tool_call_rate_greedy"] == 1.0
    assert rounds[2]["num_train_rows"] == 8  # its 4 samples and round 1's, replayed
    rows = [json.loads(line) for line in (tmp_path / "loop" / "round-1" / "train.jsonl").read_text().splitlines()]
    assert all(len(r["behavior_logps"]) == sum(r["tool_mask"]) for r in rows)
    assert any(sum(r["tool_mask"]) < len(r["completion_ids"]) for r in rows)  # a tool's result, not trained


def test_calls_of_any_arguments_are_stored_in_one_column_and_cut_as_rendered(tool_policy):
    # A policy's calls differ in their arguments' names and types: stored as JSON text, they fit one Arrow column,
    # and the trajectory cut from the stored messages is the one cut from the calls as made.
    tokenizer = AutoTokenizer.from_pretrained(tool_policy)
    made = [
        [{**TRAJECTORY[0], "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": args}}]}]
        + TRAJECTORY[1:]
        for args in ({"a": 7, "b": 8}, {"a": "7", "b": 8.0}, {"x": [1, 2]})
    ]
    stored = Dataset.from_dict({"completion": [storable(c) for c in made]})["completion"]
    for calls, kept in zip(made, stored):
        cut = trajectory_ids(tokenizer, PROMPT, calls, [multiply])
        assert trajectory_ids(tokenizer, PROMPT, kept, [multiply]) == cut


def test_the_rollout_agrees_with_trls_grpo_tool_loop(tool_policy, tmp_path):
    # TRL's GRPOTrainer samples the same prompts with the same tools, greedily (top-k 1), through its own tool loop:
    # the completion ids and the tool mask are ours, token for token
    from trl import GRPOConfig, GRPOTrainer

    from trl_topr.generation import TransformersEngine
    from trl_topr.rollout import prepare_tool_calling, rollout
    from trl_topr.tokens import prompt_ids

    config = GRPOConfig(
        str(tmp_path / "grpo"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=200,
        top_k=1,
        max_tool_calling_iterations=3,
    )
    trainer = GRPOTrainer(tool_policy, reward_funcs=says_56, args=config, train_dataset=prompts(2), tools=[multiply])
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": PROMPT, "answer": "56"}] * 2)  # its sampling step
    lengths = batch["completion_mask"].sum(-1).tolist()
    trl_ids = [row[:n] for row, n in zip(batch["completion_ids"].tolist(), lengths)]
    trl_mask = [row[:n] for row, n in zip(batch["tool_mask"].tolist(), lengths)]

    model, tokenizer = load(tool_policy)
    prepare_tool_calling(tokenizer, [multiply])
    ids = [prompt_ids(tokenizer, PROMPT, [multiply])] * 2
    ours = rollout(
        TransformersEngine(model, tokenizer, bf16=False), tokenizer, [PROMPT] * 2, ids, GREEDY, [multiply], 3
    )
    assert trl_ids == ours.completion_ids
    assert trl_mask == ours.tool_mask
    assert all(0 in mask for mask in ours.tool_mask)  # a tool's result was appended and left untrained


def test_the_next_turn_reuses_the_key_values_of_the_turn_before(tool_policy):
    # The transformers engine keeps a turn's key/values: the turn after the tool's result computes only the result,
    # the template's text around it and what it generates, and says what the engine computing everything says
    from trl_topr.generation import TransformersEngine
    from trl_topr.rollout import prepare_tool_calling, rollout
    from trl_topr.tokens import prompt_ids

    model, tokenizer = load(tool_policy)
    prepare_tool_calling(tokenizer, [multiply])
    ids = [prompt_ids(tokenizer, PROMPT, [multiply])] * 2
    prefills = []  # the width of each forward that reads more than one new token: a turn's first

    def record(module, args, kwargs):
        width = kwargs["input_ids"].size(1) if kwargs.get("input_ids") is not None else 0
        if width > 1:
            prefills.append(width)

    hook = model.model.register_forward_pre_hook(record, with_kwargs=True)
    runs = {}
    for turn_cache in (False, True):
        engine = TransformersEngine(model, tokenizer, bf16=False, turn_cache=turn_cache, shared_prefix=turn_cache)
        start = len(prefills)
        runs[turn_cache] = rollout(engine, tokenizer, [PROMPT] * 2, ids, GREEDY, [multiply], 3), prefills[start:]
    hook.remove()
    (whole, whole_prefills), (cached, cached_prefills) = runs[False], runs[True]
    assert cached.completion_ids == whole.completion_ids and cached.tool_mask == whole.tool_mask
    assert all(0 in mask for mask in cached.tool_mask)  # a second turn, after the tool's result
    assert len(cached_prefills) == len(whole_prefills) == 2  # the first turn, and the turn after the result
    assert cached_prefills[0] == whole_prefills[0] == len(ids[0]) - 1  # the prompt but the token `generate` reads
    assert cached_prefills[1] < whole_prefills[1] - len(ids[0])  # the prompt and the first turn were not computed
