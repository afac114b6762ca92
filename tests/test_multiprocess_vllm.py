"""
The vLLM backend under `accelerate launch` on 2 CPU processes, one colocated engine in each (`tests/vllm_worker.py`),
with the shipped DDP, DeepSpeed ZeRO-3 and FSDP2 configurations: the loop samples round 2 from round 1's weights on
every process, and the online trainer's engines sample with the weights synced (gathered from the shards) every step.
One launch per configuration runs both (an engine each; two launches under ZeRO-3, for memory): two to three
minutes each here. Under ZeRO-3 the loop and the online trainer after it in one launch came close to a 24 GB
machine's memory for the two processes (before the loop freed each round's engine), so this module runs before
`tests/test_vllm.py` (file order), in a pytest process that has not yet held an engine.
"""

import json
import os

import pytest
from conftest import launch
from test_vllm import check_round_two_sampled_from_round_one, smollm2, vllm_installed  # noqa: F401 (fixtures)


pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess]


def launch_two_processes(parts: str, engine: str, model_path: str, folder) -> list[dict]:
    """`accelerate launch` of `tests/vllm_worker.py` on 2 CPU processes with the shipped configuration of `engine`:
    the loop and/or the online trainer (`parts`, comma-separated)."""
    from test_sharded import accelerate_config

    output_dir = folder / "out"
    output_dir.mkdir()
    worker = os.path.join(os.path.dirname(__file__), "vllm_worker.py")
    tests = os.path.dirname(__file__)
    launch(
        worker,
        parts,
        engine,
        tests,
        model_path,
        output_dir,
        config_file=accelerate_config(engine, folder),
        timeout=1200,
    )
    return [json.loads((output_dir / f"result-rank{rank}.json").read_text()) for rank in (0, 1)]


# One launch runs the loop and then the online trainer (a launch and its engines cost minutes here), except under
# ZeRO-3, whose two processes would hold 22 of this machine's 24 GB: two launches there.
LAUNCHES = [("loop,online", "ddp"), ("loop,online", "fsdp2"), ("loop", "zero3"), ("online", "zero3")]


@pytest.mark.parametrize(("parts", "engine"), LAUNCHES)
def test_loop_and_online_trainer_with_an_engine_in_each_of_two_processes(smollm2, tmp_path, parts, engine):
    path, tokenizer = smollm2
    results = launch_two_processes(parts, engine, path, tmp_path)
    if "loop" in parts:  # both processes saw the same rounds, and kept their process group after closing engines
        assert results[0]["rounds"] == results[1]["rounds"]
        assert results[0]["world_after_loop"] == results[1]["world_after_loop"] == [2, 2]
        for result in results:  # no round's trainer, model, engine or optimizer outlived it next to the vLLM engine
            assert result["loop_trained"].count("optimizer") == 2 and result["loop_alive"] == []
        check_round_two_sampled_from_round_one(tmp_path / "out", path, tokenizer)
    if "online" in parts:
        for result in results:
            assert result["world"] == [2, 2] and result["moved"] > 1e-4
            assert result["deepspeed"] == (engine == "zero3") and result["fsdp"] == (engine == "fsdp2")
            # every process's engine samples with the synced weights (gathered from the shards by TRL's iteration)
            assert len(result["steps"]) == 3
            assert all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in result["steps"])
