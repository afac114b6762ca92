"""
The vLLM backend under `accelerate launch` on 2 CPU processes, one colocated engine in each (`tests/vllm_worker.py`),
with the shipped DDP, DeepSpeed ZeRO-3 and FSDP2 configurations: the loop samples round 2 from round 1's weights on
every process, and the online trainer's engines sample with the weights synced (gathered from the shards) every step.
Each launch starts two engines: two to four minutes here. Each process peaks at about 8.5 GB under ZeRO-3, so this
module runs before `tests/test_vllm.py` (file order), in a pytest process that has not yet held an engine.
"""

import json
import os
import subprocess
import sys

import pytest
from test_vllm import check_round_two_sampled_from_round_one, smollm2, vllm_installed  # noqa: F401 (fixtures)


pytestmark = pytest.mark.vllm


def launch_two_processes(kind: str, engine: str, model_path: str, folder) -> list[dict]:
    """`accelerate launch` of `tests/vllm_worker.py` on 2 CPU processes with the shipped configuration of `engine`."""
    from test_sharded import accelerate_config

    output_dir = folder / "out"
    output_dir.mkdir()
    worker = os.path.join(os.path.dirname(__file__), "vllm_worker.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(accelerate_config(engine, folder)), worker, kind, engine, os.path.dirname(__file__), model_path,
               str(output_dir)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return [json.loads((output_dir / f"result-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("engine", ["ddp", "zero3", "fsdp2"])
def test_loop_with_an_engine_in_each_of_two_processes(smollm2, tmp_path, engine):
    path, tokenizer = smollm2
    results = launch_two_processes("loop", engine, path, tmp_path)
    assert results[0] == results[1] and results[0]["world"] == [2, 2]
    check_round_two_sampled_from_round_one(tmp_path / "out", path, tokenizer)


@pytest.mark.parametrize("engine", ["ddp", "zero3", "fsdp2"])
def test_online_trainer_with_an_engine_in_each_of_two_processes(smollm2, tmp_path, engine):
    path, _ = smollm2
    results = launch_two_processes("online", engine, path, tmp_path)
    for result in results:
        assert result["world"] == [2, 2] and result["moved"] > 1e-4
        assert result["deepspeed"] == (engine == "zero3") and result["fsdp"] == (engine == "fsdp2")
        # every process's engine samples with the synced weights (gathered from the shards by TRL's iteration)
        assert len(result["steps"]) == 3
        assert all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in result["steps"])
