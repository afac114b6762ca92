"""Run by `tests/test_multiprocess_vllm.py` under `accelerate launch` (2 CPU processes, one colocated vLLM engine in
each): the loop for two rounds (its engine closed at its end) and/or the online trainer for three steps (an engine of
its own), the results written as JSON by every process. Not a test module itself."""

import json
import sys

import torch
from accelerate import PartialState


def largest_change(saved: str, initial: str) -> float:
    """The largest change of a weight between two saved models (whole: the trainer saves gathered weights)."""
    from transformers import AutoModelForCausalLM

    from trl_topr.distributed import unsharded_loading

    with unsharded_loading():  # whole on each process, also under ZeRO-3
        before, after = (
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict() for path in (initial, saved)
        )
    return max((after[name] - weight).abs().max().item() for name, weight in before.items())


def main(parts: str, engine: str, tests_dir: str, model_path: str, output_dir: str):
    sys.path.insert(0, tests_dir)
    if engine == "fsdp2":
        from trl_topr.testing import reapply_fsdp_plugin

        reapply_fsdp_plugin()
    from conftest import alive, recording_trainer
    from test_vllm import LOOP, arithmetic, loop_args, online_args, train_args

    import trl_topr.loop
    from trl_topr import TOPRGRPOTrainer, run_topr_loop
    from trl_topr.rewards import gsm8k_reward

    result = {}
    if "loop" in parts.split(","):
        trained = []
        trl_topr.loop.TOPRTrainer = recording_trainer(trained)  # what each round leaves alive (none should be)
        result["rounds"] = run_topr_loop(
            model_path,
            arithmetic(4),
            gsm8k_reward,
            loop_args(),
            train_args(output_dir),
            eval_prompts=arithmetic(3),
            **LOOP,
        )
        result["loop_trained"], result["loop_alive"] = [name for name, _ in trained], alive(trained)
        # the loop has closed its engine by now: the processes keep their group (vLLM's teardown destroys it)
        result["world_after_loop"] = [PartialState().num_processes, torch.distributed.get_world_size()]
    if "online" in parts.split(","):
        trainer = TOPRGRPOTrainer(
            model_path,
            reward_funcs=gsm8k_reward,
            args=online_args(f"{output_dir}/online"),
            train_dataset=arithmetic(8),
        )
        trainer.train()
        trainer.save_model(f"{output_dir}/online/final")
        PartialState().wait_for_everyone()
        result["moved"] = largest_change(f"{output_dir}/online/final", model_path)
        result["steps"] = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
        result["deepspeed"] = getattr(trainer, "is_deepspeed_enabled", False)
        result["fsdp"] = getattr(trainer, "is_fsdp_enabled", False)
    result["world"] = [PartialState().num_processes, torch.distributed.get_world_size()]
    with open(f"{output_dir}/result-rank{PartialState().process_index}.json", "w") as f:
        json.dump(result, f)
    PartialState().wait_for_everyone()
    PartialState().destroy_process_group()


if __name__ == "__main__":
    torch.manual_seed(0)
    main(*sys.argv[1:6])
