"""TRL GRPO's `environment_factory` in sampling, evaluation, the loop and the online trainer: each trajectory gets a
stateful instance of its own, reset with its row, whose methods are its tools, and whose `get_reward` scores it."""

import json

import pytest
from conftest import TOOL_PROMPT as PROMPT
from conftest import make_args
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_topr import TOPRLoopConfig, evaluate_policy, run_topr_loop, sample_completions
from trl_topr.environments import Environments
from trl_topr.generation import SamplingSettings


GREEDY = SamplingSettings(num_samples=1, temperature=0.0, max_new_tokens=200)


class Multiplier:
    """A stateful environment: it records the calls of its trajectory, and rewards exactly one call of 7 * 8."""

    made = 0  # instances made, over the whole test

    def __init__(self):
        Multiplier.made += 1
        self.calls, self.resets = [], 0

    def reset(self, **row):
        self.calls, self.resets, self.answer = [], self.resets + 1, row["answer"]

    def multiply(self, a: int, b: int) -> int:
        """
        Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls.append((a, b))
        return a * b

    def get_reward(self) -> float:
        return 1.0 if [str(a * b) for a, b in self.calls] == [self.answer] else -1.0


class Hinted(Multiplier):
    """The same, and its reset adds a line to the prompt."""

    def reset(self, **row):
        super().reset(**row)
        return f" (hint {self.resets})"


def prompts(n: int = 1) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPT] * n, "answer": ["56"] * n})


def load(path):
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_each_trajectory_calls_its_own_environment_and_is_scored_by_it(tool_policy):
    model, tokenizer = load(tool_policy)
    seen = []

    def reads_environments(prompts, completions, environments, **kwargs):
        seen.append(list(environments))
        return [0.0] * len(completions)

    environments = Environments(Multiplier)
    made = Multiplier.made
    sampling = SamplingSettings(num_samples=2, temperature=0.0, max_new_tokens=200)
    samples = sample_completions(
        model,
        prompts(2),
        reads_environments,
        processing_class=tokenizer,
        sampling=sampling,
        environment_factory=environments,
        progress=False,
    )
    assert len(samples) == 4 and samples["tool_call_count"] == [1] * 4  # the policy called the environment's method
    assert samples["rewards/Multiplier"] == [1.0] * 4 and samples["reward"] == [1.0] * 4  # get_reward, weight 1
    assert all(len(row["behavior_logps"]) == sum(row["tool_mask"]) for row in samples)
    # one instance per trajectory, each reset once and called once: the state of one is not another's
    (instances,) = seen
    assert len({id(e) for e in instances}) == 4 and all(e.calls == [(7, 8)] and e.resets == 1 for e in instances)
    assert Multiplier.made - made == 3  # the probe is the first instance: made once, reset for each trajectory
    # sampled again: the same instances, reset, their state fresh
    sample_completions(
        model, prompts(2), reads_environments, processing_class=tokenizer, sampling=sampling,
        environment_factory=environments, progress=False,
    )  # fmt: skip
    assert Multiplier.made - made == 3 and all(e.calls == [(7, 8)] and e.resets == 2 for e in seen[1])


def test_reset_text_is_appended_to_the_prompt_the_trajectory_is_sampled_from(tool_policy):
    model, tokenizer = load(tool_policy)
    samples = sample_completions(
        model,
        prompts(1),
        lambda completions, **kwargs: [0.0] * len(completions),
        processing_class=tokenizer,
        sampling=GREEDY,
        environment_factory=Hinted,
        progress=False,
    )
    assert samples[0]["prompt"][-1]["content"] == PROMPT[-1]["content"] + " (hint 1)"
    rendered = tokenizer.decode(samples[0]["prompt_ids"])
    assert "What is 7 * 8? (hint 1)" in rendered and "multiply" in rendered  # its tools shown beside it


def test_evaluation_resets_an_environment_per_trajectory(tool_policy):
    model, tokenizer = load(tool_policy)

    def correct(prompts, completions, environments, **kwargs):
        return [e.get_reward() for e in environments]

    metrics = evaluate_policy(
        model,
        tokenizer,
        prompts(2),
        correct,
        lambda text: "56" if "56" in text else None,
        SamplingSettings(num_samples=2, temperature=0.0, max_new_tokens=200, seed=0),
        environment_factory=Multiplier,
        progress=False,
    )
    assert metrics["pass@1_greedy"] == 1.0 and metrics["pass@1"] == 1.0 and metrics["maj@2"] == 1.0
    assert metrics["tool_call_rate"] == 1.0 and metrics["tool_call_rate_greedy"] == 1.0


def test_bad_environments_are_refused_before_anything_is_generated(tool_policy, tmp_path):
    class NoReset:
        def multiply(self, a: int, b: int) -> int:
            """
            Multiply.

            Args:
                a: a.
                b: b.
            """
            return a * b

    with pytest.raises(ValueError, match="must define a `reset` method"):
        Environments(NoReset)
    named = {"multiplier": Multiplier}
    rows = Dataset.from_dict({"prompt": [PROMPT] * 2, "answer": ["56"] * 2, "environment": ["multiplier", "game"]})
    args = make_args(tmp_path / "loop", max_steps=1)
    with pytest.raises(ValueError, match=r"Column 'environment', row 1: 'game' is not among"):
        run_topr_loop(tool_policy, rows, [], TOPRLoopConfig(num_generations=2), args, environment_factory=named)
    assert not (tmp_path / "loop").exists()  # nothing written
    with pytest.raises(ValueError, match="No reward function was given"):  # no reward, and no get_reward
        run_topr_loop(tool_policy, prompts(1), [], TOPRLoopConfig(), args, environment_factory=NoRewardMultiplier)


class NoRewardMultiplier:
    def reset(self, **row):
        pass

    def multiply(self, a: int, b: int) -> int:
        """
        Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a * b


def test_the_loop_trains_on_environment_trajectories_with_a_named_environment(tool_policy, tmp_path):
    # A dict of factories: each row names its environment; the loop keeps one pool over its rounds and trains on the
    # environments' rewards alone
    made = Multiplier.made
    rows = Dataset.from_dict({"prompt": [PROMPT] * 2, "answer": ["56"] * 2, "environment": ["multiplier"] * 2})
    args = make_args(tmp_path / "loop", max_steps=1, per_device_train_batch_size=2, learning_rate=1e-5)
    loop_args = TOPRLoopConfig(num_generations=2, max_completion_length=200, num_rounds=2, replay_rounds=1)
    rounds = run_topr_loop(
        tool_policy,
        rows,
        [],
        loop_args,
        args,
        eval_prompts=rows.select([0]),
        correct_func=lambda completions, environments, **kwargs: [e.get_reward() for e in environments],
        answer_func=lambda text: "56" if "56" in text else None,
        environment_factory={"multiplier": Multiplier},
    )
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[2]["tools/call_frequency"] > 0 and rounds[2]["tool_call_rate_greedy"] == 1.0
    assert rounds[2]["num_train_rows"] == 8  # replayed trajectories too
    assert Multiplier.made - made == 4  # at most 4 trajectories at once, whatever the rounds and evaluations
    sampled = [json.loads(line) for line in (tmp_path / "loop" / "round-1" / "samples.jsonl").read_text().splitlines()]
    assert all("rewards/Multiplier" in row and row["environment"] == "multiplier" for row in sampled)


def test_the_online_trainer_takes_trls_environment_factory(tool_policy, tmp_path):
    # TOPRGRPOTrainer is TRL's GRPOTrainer: its environments (reset per rollout, methods as tools, get_reward as a
    # reward of its own) reach TOPR's loss as any reward does
    from test_online import grpo_args

    from trl_topr.online import TOPRGRPOTrainer

    args = grpo_args(tmp_path, max_completion_length=200, temperature=0.1, max_steps=1, learning_rate=1e-5)
    trainer = TOPRGRPOTrainer(
        tool_policy, args=args, train_dataset=prompts(4), environment_factory=Multiplier
    )  # no reward_funcs: the environment's get_reward is the reward
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "rewards/Multiplier/mean" in entry]
    assert logged["rewards/Multiplier/mean"] == 1.0  # the policy called its environment's multiply, once each
    assert "positive_fraction" in logged and logged["positive_fraction"] == 1.0  # TOPR's loss saw those rewards
