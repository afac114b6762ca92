"""
One contract for every TOPR trainer (offline `TOPRTrainer`, which the loop trains each round with; online
`TOPRGRPOTrainer`; asynchronous `TOPRAsyncGRPOTrainer`): a TOPR model card wherever the model is saved, no Hub token
in the pickled arguments, TOPR's options from `TOPRArguments` alone, and TOPR's metrics logged under the same names.
"""

import dataclasses

import pytest
import torch
from conftest import make_args, standard_dataset
from test_async import ListWorker, NoTransfer, async_args, made_samples
from test_async import prompts as async_prompts
from test_online import grpo_args
from test_online import prompts as online_prompts

from trl_topr import TOPRArguments, TOPRAsyncGRPOTrainer, TOPRTrainer
from trl_topr.loss import METRIC_SUPPORT
from trl_topr.online import TOPRGRPOTrainer


SECRET = "hf_not_a_real_token"
# what each trainer logs of TOPR's loss (the reward and completion length TRL's GRPO trainers log as their own)
TOPR_METRICS = set(METRIC_SUPPORT) - {"reward", "completion_length"}


def alternating(completions, **kwargs):
    """+1 and -1 in turn: every generation batch holds both, whatever the model writes."""
    return [1.0 if i % 2 == 0 else -1.0 for i in range(len(completions))]


def offline(path, folder):
    args = make_args(folder, max_steps=1, hub_token=SECRET, target_positive_fraction=0.5)
    return TOPRTrainer(path, args=args, train_dataset=standard_dataset())


def online(path, folder):
    args = grpo_args(folder, max_steps=1, hub_token=SECRET, target_positive_fraction=0.5)
    return TOPRGRPOTrainer(path, alternating, args, train_dataset=online_prompts())


def asynchronous(path, folder):
    args = async_args(folder, max_steps=1, hub_token=SECRET, target_positive_fraction=0.5)
    worker = ListWorker(made_samples())
    return TOPRAsyncGRPOTrainer(
        path, args=args, train_dataset=async_prompts(), rollout_worker=worker, weight_transfer=NoTransfer()
    )


TRAINERS = {"offline": offline, "online": online, "asynchronous": asynchronous}


@pytest.mark.parametrize("build", TRAINERS.values(), ids=TRAINERS.keys())
def test_every_trainer_keeps_toprs_contract(tiny_model_path, tmp_path, build):
    trainer = build(tiny_model_path, tmp_path / "out")
    # TOPR's options come from TOPRArguments alone: no configuration redefines one
    topr_options = {field.name: field for field in dataclasses.fields(TOPRArguments)}
    fields = {field.name: field for field in dataclasses.fields(trainer.args)}
    redefined = [name for name, field in topr_options.items() if fields[name].default != field.default]
    assert isinstance(trainer.args, TOPRArguments) and not redefined
    assert type(trainer.args).__getstate__ is TOPRArguments.__getstate__

    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert TOPR_METRICS <= set(entry), sorted(TOPR_METRICS - set(entry))  # none dropped, none renamed
    assert entry["effective_positive_fraction"] == pytest.approx(0.5, abs=1e-3)  # the target, over what it centres

    saved = tmp_path / "saved"
    trainer.save_model(str(saved))
    card = (saved / "README.md").read_text()
    assert "- topr" in card and "Tapered Off-Policy REINFORCE" in card and "2503.14286" in card
    assert "huggingface.co/None" not in card
    arguments = torch.load(saved / "training_args.bin", weights_only=False)
    assert arguments.hub_token is None and trainer.args.hub_token == SECRET
    assert SECRET.encode() not in (saved / "training_args.bin").read_bytes()
