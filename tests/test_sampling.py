"""Sampling a scored TOPR dataset with behavior log-probs, and the reward-function plumbing."""

import math

import pytest
import torch
from conftest import make_args
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_topr import TOPRDataError, TOPRLoopConfig, TOPRTrainer
from trl_topr.generation import SamplingSettings, generation_engine
from trl_topr.sampling import sample_completions, score_completions


def has_digit(prompts, completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if any(ch.isdigit() for ch in t) else -1.0 for t in texts]


def length_bonus(prompts, completions, **kwargs):
    return [0.01 * len(c[-1]["content"] if isinstance(c, list) else c) for c in completions]


def prompts(conversational: bool, n: int = 3) -> Dataset:
    questions = [f"What is {i} + 3?" for i in range(n)]
    rows = [[{"role": "user", "content": q}] for q in questions] if conversational else questions
    return Dataset.from_dict({"prompt": rows, "answer": [str(i + 3) for i in range(n)]})


@pytest.fixture
def model_and_tokenizer(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("conversational", [False, True])
def test_sampled_dataset_follows_the_data_contract(model_and_tokenizer, tmp_path, conversational):
    model, tokenizer = model_and_tokenizer
    data = sample_completions(
        model,
        prompts(conversational),
        [has_digit, length_bonus],
        processing_class=tokenizer,
        reward_weights=[1.0, 0.5],
        args=make_args(tmp_path),
        progress=False,
        sampling=SamplingSettings(num_samples=4, max_new_tokens=12, seed=0),
    )
    assert len(data) == 12
    assert {
        "prompt",
        "completion",
        "reward",
        "behavior_logps",
        "rewards/has_digit",
        "rewards/length_bonus",
        "answer",
    } <= set(data.column_names)
    assert list(data["answer"]) == ["3"] * 4 + ["4"] * 4 + ["5"] * 4  # prompt columns follow their samples
    for row in data:
        assert row["reward"] == pytest.approx(row["rewards/has_digit"] + 0.5 * row["rewards/length_bonus"])
        assert all(v <= 0 and math.isfinite(v) for v in row["behavior_logps"])
        assert isinstance(row["completion"], list) == conversational


@pytest.mark.parametrize("conversational", [False, True])
def test_training_uses_exactly_the_sampled_token_ids(model_and_tokenizer, tmp_path, conversational):
    # Completions go through no text round trip: what is trained is what was sampled, a completion cut at
    # max_new_tokens gets no end token, and one that ended gets nothing after its own end token (the chat template
    # would add a newline after it).
    model, tokenizer = model_and_tokenizer
    args = make_args(tmp_path, max_steps=1, per_device_train_batch_size=8)
    data = sample_completions(
        model,
        prompts(conversational, 4),
        has_digit,
        processing_class=tokenizer,
        args=args,
        progress=False,
        sampling=SamplingSettings(num_samples=6, max_new_tokens=5, seed=0),
    )
    eos = tokenizer.eos_token_id
    cut = [ids for ids in data["completion_ids"] if eos not in ids]
    ended = [ids for ids in data["completion_ids"] if eos in ids]
    assert cut and all(len(ids) == 5 for ids in cut)  # the random tiny model runs into the limit
    assert all(ids.index(eos) == len(ids) - 1 for ids in ended)
    trainer = TOPRTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    prepared = trainer.train_dataset
    for row in range(len(data)):
        prompt_ids, completion_ids = data[row]["prompt_ids"], data[row]["completion_ids"]
        assert prepared[row]["input_ids"] == prompt_ids + completion_ids
        assert prepared[row]["labels"] == [-100] * len(prompt_ids) + completion_ids
        assert len(prepared[row]["behavior_logps"]) == len(completion_ids)  # mu of exactly those tokens
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


@pytest.mark.parametrize("bf16", [False, True])
def test_training_on_the_samples_starts_with_every_ratio_at_one(model_and_tokenizer, tmp_path, bf16):
    model, tokenizer = model_and_tokenizer
    args = make_args(tmp_path, bf16=bf16, max_steps=1, per_device_train_batch_size=24, learning_rate=0.0)
    data = sample_completions(
        model,
        prompts(True, 6),
        has_digit,
        processing_class=tokenizer,
        args=args,
        progress=False,
        sampling=SamplingSettings(num_samples=4, max_new_tokens=16, seed=0),
    )
    trainer = TOPRTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()  # one step over all 24 rows
    log = trainer.state.log_history[0]
    assert abs(log["log_ratio_min"]) < 1e-3 and abs(log["log_ratio_max"]) < 1e-3


def test_same_seed_same_samples_and_greedy_is_deterministic(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    kwargs = dict(processing_class=tokenizer, args=make_args(tmp_path), progress=False)
    settings = SamplingSettings(num_samples=3, max_new_tokens=10)
    first = sample_completions(model, prompts(False), has_digit, **kwargs, sampling=settings.replace(seed=1))
    again = sample_completions(model, prompts(False), has_digit, **kwargs, sampling=settings.replace(seed=1))
    other = sample_completions(model, prompts(False), has_digit, **kwargs, sampling=settings.replace(seed=2))
    assert list(first["completion"]) == list(again["completion"])
    assert list(first["completion"]) != list(other["completion"])
    greedy = sample_completions(
        model, prompts(False), has_digit, **kwargs, sampling=settings.replace(temperature=0, seed=3)
    )
    completions = list(greedy["completion"])
    assert completions[0] == completions[1] == completions[2]


@pytest.mark.parametrize("conversational", [False, True])
def test_empty_completions_are_kept_and_trainable(model_and_tokenizer, tmp_path, conversational):
    # A model that ends every completion at once (EOS forced at the length limit of 1 new token): each sample is the
    # decision to stop, kept with its reward and trained on its end-of-sequence token.
    model, tokenizer = model_and_tokenizer
    model.generation_config.forced_eos_token_id = tokenizer.eos_token_id
    args = make_args(tmp_path, max_steps=1, per_device_train_batch_size=6)
    data = sample_completions(
        model,
        prompts(conversational),
        has_digit,
        processing_class=tokenizer,
        args=args,
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=1, seed=0),
    )
    assert len(data) == 6 and set(data["reward"]) == {-1.0}
    assert all(len(values) >= 1 for values in data["behavior_logps"])
    trainer = TOPRTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    assert trainer.state.log_history[0]["negative_weight_mean"] == pytest.approx(1.0)


def test_samples_train_under_a_max_length_that_cuts_them(model_and_tokenizer, tmp_path):
    # The behavior log-probs cover whole completions; training cuts them with the completion, so the sampler's output
    # trains with the very configuration it was sampled for.
    model, tokenizer = model_and_tokenizer
    args = make_args(tmp_path, max_length=16, max_steps=1, per_device_train_batch_size=6)
    data = sample_completions(
        model,
        prompts(False),
        has_digit,
        processing_class=tokenizer,
        args=args,
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=20, seed=0),
    )
    assert max(len(values) for values in data["behavior_logps"]) > 10  # some completions exceed what fits
    trainer = TOPRTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 16
    trainer.train()
    assert abs(trainer.state.log_history[0]["log_ratio_max"]) < 1e-4  # the kept tokens' log-probs are mu's


def test_a_prompt_that_fills_max_length_is_refused_before_sampling(model_and_tokenizer, tmp_path, monkeypatch):
    model, tokenizer = model_and_tokenizer
    long_prompts = prompts(False).map(
        lambda row, i: {"prompt": row["prompt"] * (10 if i == 2 else 1)}, with_indices=True
    )
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("generated before checking the prompts"))
    with pytest.raises(TOPRDataError, match=r"column 'prompt', row 2: the prompt has \d+ tokens"):
        sample_completions(
            model,
            long_prompts,
            has_digit,
            processing_class=tokenizer,
            args=make_args(tmp_path, max_length=32),
            progress=False,
            sampling=SamplingSettings(num_samples=2, max_new_tokens=4, seed=0),
        )


def test_model_given_as_a_path(tiny_model_path, tmp_path):
    data = sample_completions(
        tiny_model_path,
        prompts(False, 2),
        has_digit,
        args=make_args(tmp_path),
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=6, seed=0),
    )
    assert len(data) == 4 and len(data["behavior_logps"]) == 4


def named(name: str, value: float):
    # A reward function called `name`, returning `value` for every completion
    def func(prompts, completions, **kwargs):
        return [value] * len(completions)

    func.__name__ = func.__qualname__ = name
    return func


@pytest.mark.parametrize("name", ["reward", "answer", "prompt", "completion", "behavior_logps", "completion_ids"])
def test_reward_functions_of_any_name_sample_and_train(name, model_and_tokenizer, tmp_path):
    # A function named like a column of the data contract, or like a prompt column (`answer`), gets its own
    # `rewards/<name>` column and changes no other column.
    model, tokenizer = model_and_tokenizer
    data = sample_completions(
        model,
        prompts(False, 2),
        [has_digit, named(name, 0.25)],
        processing_class=tokenizer,
        args=make_args(tmp_path),
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=6, seed=0),
    )
    assert data[f"rewards/{name}"] == [0.25] * 4
    assert data["reward"] == pytest.approx([r + 0.25 for r in data["rewards/has_digit"]])
    assert data["answer"] == ["3", "3", "4", "4"] and data["prompt"][0] == "What is 0 + 3?"
    assert all(isinstance(c, str) for c in data["completion"]) and all(data["completion_ids"])
    trainer = TOPRTrainer(
        model, args=make_args(tmp_path / "train", max_steps=1), train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_a_sampled_dataset_samples_again(model_and_tokenizer, tmp_path):
    # Sampling's own columns in the prompts (ids, log-probs, rewards) are replaced, not passed to the functions twice
    model, tokenizer = model_and_tokenizer
    first = sample_completions(
        model,
        prompts(False, 2),
        has_digit,
        processing_class=tokenizer,
        args=make_args(tmp_path),
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=6, seed=0),
    )
    again = sample_completions(
        model,
        first,
        [has_digit, named("bonus", 1.0)],
        processing_class=tokenizer,
        args=make_args(tmp_path),
        progress=False,
        sampling=SamplingSettings(num_samples=1, max_new_tokens=6, seed=0),
    )
    assert len(again) == 4 and again["rewards/bonus"] == [1.0] * 4
    assert sorted(again.column_names) == sorted({*first.column_names, "rewards/bonus"})


def test_two_reward_functions_of_one_name_are_both_named(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(
        ValueError,
        match=r"Two reward functions are named 'reward': .*\.reward \(reward function 0\) "
        r"and .*\.reward \(reward function 2\).*pass a dict",
    ):
        sample_completions(
            model,
            prompts(False, 2),
            [named("reward", 1.0), has_digit, named("reward", 2.0)],
            processing_class=tokenizer,
            progress=False,
        )


def test_score_completions_combines_ignores_none_and_names_columns():
    def maybe(prompts, completions, **kwargs):
        return [None, 2.0]

    rewards, per_func = score_completions(
        ["p", "q"], ["a", "b"], {"correct": has_digit, "extra": maybe}, reward_weights=[1.0, 0.5]
    )
    assert rewards == [-1.0, -1.0 + 1.0]
    assert math.isnan(per_func["extra"][0]) and per_func["correct"] == [-1.0, -1.0]


def test_score_completions_passes_columns_like_grpo():
    seen = {}

    def spy(prompts, completions, completion_ids=None, answer=None, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer)
        return [0.0] * len(completions)

    score_completions(["p"], ["c"], spy, completion_ids=[[1, 2]], answer=["4"])
    assert seen == {"prompts": ["p"], "completions": ["c"], "completion_ids": [[1, 2]], "answer": ["4"]}


@pytest.mark.parametrize(
    "func, message",
    [
        (lambda prompts, completions, **kw: [1.0], "returned 1 values for 2 completions"),
        (lambda prompts, completions, **kw: None, "returned None"),
        (lambda prompts, completions, **kw: [None, None], "Every reward function returned None for completion 0"),
        (lambda prompts, completions, **kw: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_bad_reward_functions_raise_clearly(func, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        score_completions(["p", "q"], ["a", "b"], func)


def test_reward_weight_count_must_match():
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        score_completions(["p"], ["a"], has_digit, reward_weights=[1.0, 1.0])


def test_prompt_column_is_required(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="missing column 'prompt'"):
        sample_completions(model, Dataset.from_dict({"question": ["hi"]}), has_digit, processing_class=tokenizer)


def test_sampling_leaves_the_model_usable_for_training(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    data = sample_completions(
        model,
        prompts(False),
        has_digit,
        processing_class=tokenizer,
        args=make_args(tmp_path),
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=8, seed=0),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = TOPRTrainer(
        model, args=make_args(tmp_path / "train", max_steps=2), train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_use_vllm_without_vllm_says_how_to_install(model_and_tokenizer, tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: this checks the message shown without it")
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ImportError, match=r"pip install trl-topr\[vllm\]"):
        generation_engine(model, tokenizer, TOPRLoopConfig(use_vllm=True))


def test_vllm_options_are_checked(model_and_tokenizer):
    with pytest.raises(ValueError, match="vllm_mode"):
        TOPRLoopConfig(use_vllm=True, vllm_mode="remote")
    with pytest.raises(ValueError, match="behavior_logps_source"):
        TOPRLoopConfig(behavior_logps_source="engine")
    with pytest.raises(ValueError, match="use_vllm=True"):
        TOPRLoopConfig(behavior_logps_source="sampler")
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="behavior_logps_source"):  # checked where it is read, too
        sample_completions(model, prompts(False, 1), has_digit, processing_class=tokenizer, behavior_logps_source="x")


def test_behavior_logps_mismatch_compares_the_summed_log_probs():
    from trl_topr.sampling import behavior_logps_mismatch

    data = Dataset.from_dict({"sampler_logps": [[-1.0, -2.0], [-0.5]], "behavior_logps": [[-1.0, -2.5], [-0.5]]})
    assert behavior_logps_mismatch(data) == {"behavior_logps_mismatch_mean": 0.25, "behavior_logps_mismatch_max": 0.5}
    assert behavior_logps_mismatch(data.remove_columns("sampler_logps")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM")
def test_vllm_engine_on_gpu(tiny_model_path, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is an optional GPU extra: pip install trl-topr[vllm]")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).cuda()
    args = make_args(
        tmp_path, use_cpu=False, bf16=False, max_steps=1, per_device_train_batch_size=8, learning_rate=0.0
    )
    loop_args = TOPRLoopConfig(use_vllm=True, vllm_gpu_memory_utilization=0.2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    with generation_engine(model, tokenizer, loop_args, args) as engine:
        data = sample_completions(
            model,
            prompts(False, 2),
            has_digit,
            processing_class=tokenizer,
            args=args,
            engine=engine,
            progress=False,
            sampling=SamplingSettings(num_samples=4, max_new_tokens=8, seed=0),
        )
    trainer = TOPRTrainer(model, args=args, train_dataset=data)
    trainer.train()
    assert abs(trainer.state.log_history[0]["log_ratio_max"]) < 1e-3


@pytest.mark.parametrize("shared_prefix, static", [(True, True), (True, False), (False, True), (False, False)])
def test_key_values_computed_ahead_score_what_each_prompt_alone_scores(model_and_tokenizer, shared_prefix, static):
    # Prompts of different lengths that share a prefix, their key/values computed ahead for 3 copies each (the prefix
    # once for the batch, each prompt's rest once for its copies) in a preallocated or a growing cache: greedy
    # decoding scores every token as each prompt alone, unpadded and computed by `generate`, scores it. The padded
    # prompt's positions count along its attention mask (counting them from the padding moves every score).
    from transformers import StaticCache

    from trl_topr.generation.transformers_engine import _cache_argument, _generation_inputs

    model, tokenizer = model_and_tokenizer
    shared = "You are a careful assistant. Answer in one line. "
    ids = [
        tokenizer(shared + text)["input_ids"] for text in ("What is 2 + 3?", "Tell me a story about a cat and a dog.")
    ]
    assert len(ids[0]) < len(ids[1])
    shapes = []  # the tokens each forward reads: the shared prefix once, for one row

    def record(module, args, kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    inputs = _generation_inputs(model, ids, tokenizer.pad_token_id, 3, 8, [], shared_prefix, static)
    hook.remove()
    prefix = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shapes[0] == ((1, prefix) if shared_prefix else (2, len(ids[1]) - 1))
    assert isinstance(inputs[_cache_argument(model)], StaticCache) == static
    settings = dict(
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=tokenizer.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
        disable_compile=True,
    )
    batched = model.generate(**inputs, **settings)
    width = inputs["input_ids"].size(1)
    for index, prompt in enumerate(ids):
        alone = model.generate(input_ids=torch.tensor([prompt]), **settings)
        steps = len(alone.logits)
        for row in range(3 * index, 3 * index + 3):
            assert batched.sequences[row, width : width + steps].tolist() == alone.sequences[0, len(prompt) :].tolist()
            scores = torch.stack([logits[row] for logits in batched.logits[:steps]])
            torch.testing.assert_close(scores, torch.cat(alone.logits), atol=1e-4, rtol=1e-4)
