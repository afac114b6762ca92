"""`push_to_hub` at the Hub client boundary (no network): which files would be uploaded and what the card says."""

from pathlib import Path

import pytest
from conftest import make_args, standard_dataset
from huggingface_hub import CommitInfo, HfApi, RepoUrl
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from peft import LoraConfig

from trl_topr import TOPRTrainer


@pytest.fixture
def hub(monkeypatch):
    """Records what `HfApi` would send: the repos created and, for each upload, the files it would upload."""
    calls = {"repos": [], "commits": []}

    def create_repo(self, repo_id, **kwargs):
        calls["repos"].append(repo_id)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, allow_patterns=None, **kwargs):
        # The selection `upload_folder` makes, with its own filter and default ignore patterns.
        paths = [str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file()]
        ignore = list(ignore_patterns or []) + DEFAULT_IGNORE_PATTERNS
        selected = filter_repo_objects(paths, allow_patterns=allow_patterns, ignore_patterns=ignore)
        files = {path: (Path(folder_path) / path).read_bytes() for path in selected}
        calls["commits"].append({"repo_id": repo_id, "files": files})
        url = f"https://huggingface.co/{repo_id}/commit/0"
        return CommitInfo(commit_url=url, commit_message="", commit_description="", oid="0" * 40)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_push_to_hub_uploads_the_adapter_and_a_topr_card(hub, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretTOKEN0123456789")
    args = make_args(tmp_path / "topr-tiny", max_steps=1, hub_model_id="someone/topr-tiny")
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
    for name, content in commit["files"].items():  # no secret in anything uploaded
        assert b"hf_secretTOKEN" not in content, name


def test_full_model_push_uploads_weights(hub, tiny_model_path, tmp_path):
    args = make_args(tmp_path / "full", max_steps=1, hub_model_id="someone/full")
    trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset())
    trainer.train()
    trainer.push_to_hub()
    (commit,) = hub["commits"]
    assert {"model.safetensors", "config.json", "README.md"} <= set(commit["files"])
