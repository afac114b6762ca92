"""`push_to_hub` at the Hub client boundary (no network): which files would be uploaded and what the card says."""

from conftest import make_args, standard_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_topr import TOPRTrainer
from trl_topr.embedded import GGUF_NAME, SOURCE


def test_push_to_hub_uploads_the_adapter_and_a_topr_card(hub, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretTOKEN0123456789")
    args = make_args(
        tmp_path / "topr-tiny", max_steps=1, hub_model_id="someone/topr-tiny", hub_token="hf_secretTOKEN0123456789"
    )
    peft_config = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset(), peft_config=peft_config)
    trainer.train()
    trainer.push_to_hub(dataset_name="arith-pos-neg")

    assert hub["repos"] == ["someone/topr-tiny"]
    (commit,) = hub["commits"]
    assert commit["repo_id"] == "someone/topr-tiny"
    files = set(commit["files"])
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= files
    assert "model.safetensors" not in files  # the adapter only
    assert not any(f.startswith("checkpoint-") for f in files)
    card = commit["files"]["README.md"].decode()
    assert "TOPR" in card
    assert "Tapered Off-Policy REINFORCE" in card and "2503.14286" in card
    assert "- trl" in card and "- topr" in card
    assert "arith-pos-neg" in card
    assert "training_args.bin" in files
    for name, content in commit["files"].items():  # no secret in anything uploaded, the pickled arguments included
        assert b"hf_secretTOKEN" not in content, name
    assert trainer.args.hub_token == "hf_secretTOKEN0123456789"  # still there for the upload itself


def test_full_model_push_uploads_weights(hub, tiny_model_path, tmp_path):
    args = make_args(tmp_path / "full", max_steps=1, hub_model_id="someone/full")
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset())
    trainer.train()
    trainer.push_to_hub()
    (commit,) = hub["commits"]
    assert {"model.safetensors", "config.json", "README.md"} <= set(commit["files"])


def card_after_training(model, tokenizer_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    trainer = TOPRTrainer(
        model,
        args=make_args(tmp_path / "out", max_steps=1),
        train_dataset=standard_dataset(),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model()
    return (tmp_path / "out" / "README.md").read_text()


def test_card_names_a_local_base_model(tiny_model_path, tmp_path):
    card = card_after_training(AutoModelForCausalLM.from_pretrained(tiny_model_path), tiny_model_path, tmp_path)
    assert f"fine-tuned version of `{tiny_model_path}`" in card
    assert f'model="{tmp_path / "out"}"' in card  # the quick start loads the saved folder
    assert "None" not in card


def test_card_names_the_gguf_file_a_model_was_converted_from(tiny_model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config.converted_from = SOURCE  # as `smollm2_path` records it
    model.save_pretrained(tmp_path / "converted")
    card = card_after_training(AutoModelForCausalLM.from_pretrained(tmp_path / "converted"), tiny_model_path, tmp_path)
    assert f"fine-tuned version of `{SOURCE}`" in card and GGUF_NAME in card
    assert "None" not in card


def test_card_links_a_hub_base_model(tiny_model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = card_after_training(model, tiny_model_path, tmp_path)
    assert "[HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)" in card
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
