"""Security: remote code stays off unless asked for, and no Hub token lands in logs, cards or saved files."""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from conftest import make_args, standard_dataset

from trl_topr import TOPRConfig, TOPRTrainer


TOKEN, ENV_TOKEN = "hf_argsSECRET0123456789abcdef", "hf_envSECRET0123456789abcdef"


def test_trust_remote_code_is_off_by_default_and_remote_code_never_runs(tiny_model_path, tmp_path):
    assert TOPRConfig(output_dir=str(tmp_path), use_cpu=True).trust_remote_code is False
    # A checkpoint that ships its own modeling code, which would leave a marker file if it ever ran.
    folder = tmp_path / "remote"
    shutil.copytree(tiny_model_path, folder)
    marker = tmp_path / "remote-code-ran"
    (folder / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig\n\nclass EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="evil", architectures=["EvilForCausalLM"], auto_map={"AutoConfig": "configuration_evil.EvilConfig"}
    )
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        TOPRTrainer(str(folder), args=make_args(tmp_path / "out"), train_dataset=standard_dataset())
    assert not marker.exists()


def test_no_token_in_logs_cards_or_saved_files(tiny_model_path, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    output_dir = tmp_path / "out"
    args = make_args(
        output_dir,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        hub_token=TOKEN,
        hub_model_id="someone/model",
        log_level="info",
    )
    with caplog.at_level(logging.DEBUG):
        trainer = TOPRTrainer(tiny_model_path, args=args, train_dataset=standard_dataset())
        trainer.train()
        trainer.save_model()
        print(trainer.args)  # the arguments' repr, as scripts print them
    logs = caplog.text + "".join(capsys.readouterr())
    assert TOKEN not in logs and ENV_TOKEN not in logs
    files = [os.path.join(d, f) for d, _, names in os.walk(output_dir) for f in names]
    assert any(f.endswith("training_args.bin") for f in files) and any(f.endswith("README.md") for f in files)
    for path in files:
        content = Path(path).read_bytes()
        assert TOKEN.encode() not in content and ENV_TOKEN.encode() not in content, path
    assert trainer.args.hub_token == TOKEN  # kept in memory for pushing
