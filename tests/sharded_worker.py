"""Run by `tests/test_sharded.py` under `accelerate launch` (2 CPU processes): one engine, every step of the issue's
checklist for each variant asked for (full fine-tuning, padding-free, LoRA) one after the other, each variant's results
written as JSON by the main process in a folder of its own. Not a test module itself."""

import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from trl_topr.testing import reapply_fsdp_plugin


def masked_data_path(data_path: str) -> str:
    """The token-ids dataset with a tool mask written beside the text one (`tests/test_sharded.py`)."""
    return str(Path(data_path).with_name("masked.jsonl"))


def main(
    tests_dir: str,
    model_path: str,
    other_model_path: str,
    data_path: str,
    output_dir: str,
    lora: bool,
    padding_free: bool,
):
    sys.path.insert(0, tests_dir)
    from conftest import alive, make_args, recording_trainer
    from datasets import Dataset
    from peft import LoraConfig

    import trl_topr.loop
    from trl_topr import TOPRLoopConfig, TOPRTrainer, run_topr_loop
    from trl_topr.compat import CHECKPOINTING
    from trl_topr.distributed import weights_fingerprint

    output = Path(output_dir)
    state = PartialState()
    result = {}
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None

    def args(name):  # one configuration per trainer, as TrainingArguments set up accelerate's state
        return make_args(
            output / name, max_steps=6, per_device_train_batch_size=2, learning_rate=1e-2, padding_free=padding_free
        )

    # A different model on the same file dataset: its behavior log-probs must not come from the first one's cache.
    other = TOPRTrainer(other_model_path, args=args("other"), train_dataset=Dataset.from_json(data_path))
    result["other_behavior"] = list(other.train_dataset["behavior_logps"])
    del other

    # Token ids with a tool mask (a trajectory's tool results among the policy's tokens): the precompute of mu counts
    # the policy's tokens only, sharded as on one process
    masked = TOPRTrainer(model_path, args=args("masked"), train_dataset=Dataset.from_json(masked_data_path(data_path)))
    result["masked_behavior"] = list(masked.train_dataset["behavior_logps"])
    del masked

    trainer = TOPRTrainer(
        model_path, args=args("train"), train_dataset=Dataset.from_json(data_path), peft_config=peft_config
    )
    result["behavior"] = list(trainer.train_dataset["behavior_logps"])
    # ZeRO-3 partitions at load time: every parameter this process holds outside a gather is empty
    result["partitioned"] = all(p.numel() == 0 for p in trainer.model.parameters())
    trainer.train()
    result["engine"] = {
        "deepspeed": trainer.is_deepspeed_enabled,
        "fsdp": trainer.is_fsdp_enabled,
        "dtensor": any(isinstance(p, torch.distributed.tensor.DTensor) for p in trainer.model.parameters()),
    }
    result["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    # Right after training, the behavior log-probs of a raw dataset are those of the trained weights: ratios at 1.
    result["evaluate"] = trainer.evaluate(Dataset.from_json(data_path))
    result["fingerprint"] = weights_fingerprint(trainer.model)
    trainer.save_model(str(output / "model"))

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if a in c else -1.0 for c, a in zip(completions, answer)]

    prompts = Dataset.from_dict(
        {"prompt": [f"What is {i} + 3?" for i in range(6)], "answer": [str(i + 3) for i in range(6)]}
    )
    # evaluation prompts whose shares differ: the first process's share a prefix, the second's start differently (the
    # forwards of a sharded model must not depend on that)
    questions = ["What is 0 + 3?", "What is 1 + 3?", "What is 2 + 3?", "Add 3 to 3.", "Sum of 4 and 3?"]
    eval_prompts = Dataset.from_dict({"prompt": questions, "answer": ["3", "4", "5", "6", "7"]})
    # activation checkpointing on, as TRL's default runs the loop (under ZeRO-3 it left every round's model alive)
    train_args = make_args(
        output / "loop",
        max_steps=-1,
        per_device_train_batch_size=2,
        padding_free=padding_free,
        **{CHECKPOINTING: True},
    )
    loop_args = TOPRLoopConfig(num_rounds=2, replay_rounds=1, num_generations=2, max_completion_length=6)
    trained = []  # what the loop's rounds trained with: nothing of it may outlive its round
    trl_topr.loop.TOPRTrainer = recording_trainer(trained)
    result["rounds"] = run_topr_loop(
        model_path,
        prompts,
        correct,
        loop_args,
        train_args,
        peft_config=peft_config,
        eval_prompts=eval_prompts,  # an odd number: uneven shares on 2 processes
        correct_func=correct,
        answer_func=lambda text: text.split()[-1] if text.split() else None,
    )
    result["loop_trained"], result["loop_alive"] = [name for name, _ in trained], alive(trained)
    result["world"] = torch.distributed.get_world_size()
    if state.is_main_process:
        (output / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    engine, tests_dir, model_path, other_model_path, data_path, output_dir, variants = sys.argv[1:8]
    if engine == "fsdp2":
        reapply_fsdp_plugin()
    for variant in variants.split(","):  # one launch for every variant: a launch's start costs seconds here
        main(
            tests_dir,
            model_path,
            other_model_path,
            data_path,
            f"{output_dir}/{variant}",
            variant == "lora",
            variant == "padding_free",
        )
    from conftest import end_processes  # the tests' folder is on the path by now

    end_processes()
