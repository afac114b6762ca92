"""`accelerate launch --num_processes 2` on CPU: the behavior precompute and training run across processes."""

import json
import subprocess
import sys
import textwrap

from conftest import make_args, standard_dataset
from datasets import Dataset

from trl_topr import TOPRTrainer


WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from accelerate import PartialState
    from conftest import make_args
    from datasets import Dataset
    from trl_topr import TOPRTrainer

    model_path, data_path, output_dir = sys.argv[1:4]
    trainer = TOPRTrainer(model_path, args=make_args(output_dir, max_steps=2, per_device_train_batch_size=2),
                          train_dataset=Dataset.from_json(data_path))
    trainer.train()
    rank = PartialState().process_index
    with open(f"{{output_dir}}/rank{{rank}}.json", "w") as f:
        json.dump({{"behavior": list(trainer.train_dataset["behavior_logps"]), "world": PartialState().num_processes,
                   "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}}, f)
    PartialState().destroy_process_group()
    """
)


def varied_lengths_dataset() -> Dataset:
    # Completions of different lengths, so the processes' batches differ in length during the precompute.
    dataset = standard_dataset(10)
    completions = [c + " The answer is 3." * (i % 4) for i, c in enumerate(dataset["completion"])]
    return dataset.remove_columns("completion").add_column("completion", completions)


def test_two_processes_agree_with_one_on_the_behavior_logps(tiny_model_path, tmp_path):
    data_path = tmp_path / "data.jsonl"
    varied_lengths_dataset().to_json(str(data_path))
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(__import__("pathlib").Path(__file__).parent)))
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    # `--multi_gpu` selects accelerate's torch.distributed launcher; without a GPU the processes use gloo on CPU.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(script), tiny_model_path, str(data_path), str(output_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]

    ranks = [json.loads((output_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    single = TOPRTrainer(tiny_model_path, args=make_args(tmp_path / "single"),
                         train_dataset=Dataset.from_json(str(data_path)))
    expected = single.train_dataset["behavior_logps"]
    for rank in ranks:
        assert rank["world"] == 2
        assert len(rank["behavior"]) == len(expected)
        for got, want in zip(rank["behavior"], expected):
            assert len(got) == len(want)
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert rank["losses"] == ranks[0]["losses"]  # metrics are gathered: every rank logs the same
