"""
What `trl_topr/trl_seam/` takes from TRL's internals, checked against the installed TRL: each test fails with a
message that names what TRL changed, rather than with an error deep in a training run.
"""

import dataclasses
import inspect
import sys

import pytest

from trl_topr.trl_seam import asynchronous as trl_seam


def source_of(thing) -> str:
    return inspect.getsource(thing)


def test_the_asynchronous_trainer_and_its_modules_are_where_the_seam_looks():
    # `trl.AsyncGRPOTrainer` (stable) or `trl.experimental.async_grpo` (TRL 1.16), its worker and packing modules
    package = trl_seam.AsyncGRPOTrainer.__module__.rsplit(".", 1)[0]
    for module in ("async_rollout_worker", "packing"):
        assert f"{package}.{module}" in sys.modules, f"TRL's asynchronous trainer no longer has `{package}.{module}`"
    assert isinstance(trl_seam.TREE_ATTENTION, str), "TRL's packing module no longer names its tree attention"
    assert isinstance(trl_seam.TRL_MAX_STALENESS, int), "TRL's AsyncGRPOConfig has no integer `max_staleness` default"


def test_a_rollout_sample_carries_what_topr_reads():
    fields = {field.name for field in dataclasses.fields(trl_seam.RolloutSample)}
    needed = {"input_ids", "completion_mask", "old_log_probs", "advantage", "model_version", "group_id", "metrics"}
    assert needed <= fields, f"TRL's RolloutSample lost {sorted(needed - fields)}"


def test_trls_worker_records_the_reward_and_its_groups_spread_and_the_dataset_passes_them_on():
    # TOPR's R - c comes from the reward among a sample's metrics, the group-centred reward from GRPO's advantage and
    # the group's std (with the epsilon TRL adds), the version from the sample; TRL's dataset yields the metrics
    worker = source_of(sys.modules[trl_seam.AsyncRolloutWorker.__module__])
    assert '"reward": float(reward)' in worker, "TRL's worker no longer records each sample's reward in its metrics"
    assert '"reward_std": reward_std' in worker, "TRL's worker no longer records the group's reward std"
    epsilon = "(scored - scored.mean()) / (scored.std() + 1e-8)"
    assert trl_seam.GRPO_STD_EPSILON == 1e-8 and epsilon in worker, f"TRL's worker's advantage is no longer {epsilon}"
    trainer = source_of(sys.modules[trl_seam.AsyncGRPOTrainer.__module__])
    assert '"metrics": sample.metrics' in trainer, "TRL's rollout dataset no longer yields each sample's metrics"


@pytest.mark.parametrize("name", ["_process", "_heartbeat_value", "_stop_event_mp", "_mp_ctx"])
def test_the_workers_private_state_the_guarded_stop_reads_is_still_there(name):
    assert f"self.{name}" in source_of(trl_seam.AsyncRolloutWorker), (
        f"TRL's AsyncRolloutWorker has no `{name}`: GuardedRolloutWorker's check and stop must follow it"
    )


def test_the_peak_flops_probe_the_construction_guards_is_still_a_module_function():
    module = sys.modules[trl_seam.AsyncGRPOTrainer.__module__]
    assert callable(getattr(module, "get_peak_flops_per_device", None)), (
        "TRL's asynchronous trainer no longer calls a module-level `get_peak_flops_per_device`: drop or move the guard"
    )


def test_grpo_still_builds_its_vllm_sampler_from_its_modules_name():
    # the online trainer swaps the class GRPOTrainer builds its vLLM sampler from, for the duration of its __init__
    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    from trl_topr.trl_seam import grpo_builds_vllm_with

    assert "VLLMGeneration(" in source_of(GRPOTrainer.__init__), "GRPOTrainer no longer builds `VLLMGeneration` itself"
    original = grpo_trainer.VLLMGeneration

    class Other(original):
        pass

    with grpo_builds_vllm_with(Other):
        assert grpo_trainer.VLLMGeneration is Other
    assert grpo_trainer.VLLMGeneration is original


@pytest.mark.parametrize(
    "method, parameters",
    [
        ("_calculate_rewards", ["self", "inputs", "prompts", "completions", "completion_ids_list"]),
        ("_generate_and_score_completions", ["self", "inputs"]),
        ("_compute_loss", ["self", "model", "inputs"]),
    ],
)
def test_the_grpo_steps_the_hooks_stand_for_keep_their_signatures(method, parameters):
    # GRPOTrainerHooks overrides these private steps of GRPOTrainer, with these arguments
    from trl import GRPOTrainer

    found = getattr(GRPOTrainer, method, None)
    assert found is not None, f"GRPOTrainer has no `{method}`: GRPOTrainerHooks must follow TRL"
    assert list(inspect.signature(found).parameters) == parameters, f"GRPOTrainer.{method} takes other arguments"


def test_grpos_forward_takes_what_the_online_loss_passes():
    from trl import GRPOTrainer

    found = getattr(GRPOTrainer, "_get_per_token_logps_and_entropies", None)
    assert found is not None, "GRPOTrainer has no `_get_per_token_logps_and_entropies`"
    parameters = inspect.signature(found).parameters
    needed = ["model", "input_ids", "attention_mask", "logits_to_keep", "compute_entropy", "compute_aux_loss"]
    assert all(name in parameters for name in needed), (
        f"GRPO's forward lost {[n for n in needed if n not in parameters]}"
    )


def test_trls_prompt_tokenization_is_where_the_seam_takes_it():
    from trl import data_utils

    found = getattr(data_utils, "_tokenize", None)
    assert found is not None, "trl.data_utils has no `_tokenize`: tokens.prompt_ids must tokenize as TRL now does"
    parameters = list(inspect.signature(found).parameters)
    assert parameters[:2] == ["processing_class", "input"], f"trl.data_utils._tokenize takes {parameters}"


@pytest.mark.parametrize(
    "name",
    ["_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples", "_step_forward_s"],
)
def test_trls_per_step_accounting_the_loss_adds_to_is_still_there(name):
    # count_micro_batch adds a micro-batch to these, as TRL's own compute_loss does
    assert f"self.{name} +=" in source_of(trl_seam.AsyncGRPOTrainer.compute_loss), (
        f"TRL's asynchronous compute_loss no longer adds to `{name}`: count_micro_batch must follow it"
    )


def test_trls_metric_sink_is_still_a_dict_of_training_metrics():
    assert 'self._metrics["train"]' in source_of(trl_seam.AsyncGRPOTrainer.compute_loss), (
        "TRL's asynchronous trainer no longer records into `_metrics['train']`: train_metrics must follow it"
    )


def test_trls_inflight_formula_is_what_the_configuration_sizes_by():
    # the configuration sizes the tasks in flight as TRL's trainer would, with TRL's default bound
    trainer = source_of(sys.modules[trl_seam.AsyncGRPOTrainer.__module__])
    assert "max(self.args.max_staleness, 1) * samples_per_step" in trainer, "TRL sizes its tasks in flight otherwise"
    compact = "".join(trainer.split())
    counted = "samples_per_step=(self.args.per_device_train_batch_size*self.args.gradient_accumulation_steps"
    assert counted + "*self.accelerator.num_processes)" in compact, "TRL counts an optimizer step's samples otherwise"


def test_trls_adapter_slots_error_is_told_apart_by_its_text():
    source = source_of(sys.modules[trl_seam.AsyncGRPOTrainer.__module__])
    assert "`max_staleness=" in source and "--max-loras" in source, (
        "TRL's refusal of too few adapter slots no longer names max_staleness and --max-loras: "
        "is_adapter_slots_error must follow it"
    )
    assert trl_seam.is_adapter_slots_error(ValueError("`max_staleness=4` ... `--max-loras 6` ..."))
    assert not trl_seam.is_adapter_slots_error(ValueError("another problem"))


def test_sfts_dataset_preparation_keeps_the_signature_the_hooks_call():
    from trl import SFTTrainer

    found = getattr(SFTTrainer, "_prepare_dataset", None)
    assert found is not None, "SFTTrainer has no `_prepare_dataset`: SFTTrainerHooks must follow TRL"
    parameters = list(inspect.signature(found).parameters)
    expected = ["self", "dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"]
    assert parameters == expected, f"SFTTrainer._prepare_dataset takes {parameters}"


@pytest.mark.parametrize("name", ["_set_signature_columns_if_needed", "_prepare_inputs"])
def test_transformers_trainer_steps_the_hooks_stand_for_are_still_there(name):
    from transformers import Trainer

    assert callable(getattr(Trainer, name, None)), (
        f"transformers' Trainer has no `{name}`: SFTTrainerHooks must follow"
    )
    if name == "_set_signature_columns_if_needed":
        assert "self._signature_columns" in source_of(Trainer._set_signature_columns_if_needed)


@pytest.mark.parametrize("name", ["_init_vllm", "_iter_named_params", "_llm_weights_sleeping"])
def test_trls_vllm_generation_keeps_what_the_hooks_stand_for(name):
    # VLLMGenerationHooks: the engine's start (called by the constructor), the weights to sync, the sleep state
    from trl.generation import vllm_generation

    source = source_of(vllm_generation.VLLMGeneration)
    assert f"self.{name}" in source, (
        f"TRL's VLLMGeneration no longer uses `{name}`: VLLMGenerationHooks must follow it"
    )
    if name == "_init_vllm":
        assert "self._init_vllm()" in source_of(vllm_generation.VLLMGeneration.__init__), (
            "TRL's VLLMGeneration no longer starts its engine from its constructor"
        )


@pytest.mark.parametrize("trainer", ["SFTTrainer", "GRPOTrainer", "AsyncGRPOTrainer"])
def test_trls_model_card_reads_the_name_paper_and_tags_each_trainer_declares(trainer):
    # every TOPR trainer declares `_tag_names`, `_name` and `_paper` for TRL's `create_model_card`
    import trl

    cls = getattr(trl, trainer, None) or trl_seam.AsyncGRPOTrainer
    card = next(c.create_model_card for c in cls.__mro__ if "create_model_card" in c.__dict__)
    source = source_of(card)
    missing = [name for name in ("self._name", "self._paper", "self._tag_names") if name not in source]
    assert not missing, f"TRL's create_model_card no longer reads {missing}: the TOPR trainers' card must follow"
