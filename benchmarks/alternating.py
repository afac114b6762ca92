"""Two settings of one training side by side, as `allocator.py` and `denormals.py` compare them: each measurement a
fresh process running the script's `--worker`, the settings taking turns."""

import json
import os
import subprocess
import sys
from pathlib import Path

from provenance import ROOT


def start_model(quick: bool, work: str) -> tuple[str, str]:
    """The model to train and its name: a tiny one built under `work` with `quick`, else SmolLM2-135M-Instruct."""
    if quick:
        from trl_topr.testing import build_tiny_model

        return build_tiny_model(str(Path(work) / "tiny")), "a tiny model"
    from trl_topr.embedded import smollm2_path

    return smollm2_path(), "SmolLM2-135M-Instruct"


def in_fresh_process(script: str, spec: dict, setting: str, env: dict | None = None) -> dict:
    """`python script --worker SPEC` in a fresh process (offline, in `env` or this one's), from the repository root:
    the JSON of the last line it prints."""
    env = dict(env if env is not None else os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, script, "--worker", json.dumps(spec)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the {setting} training failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternate(settings: tuple[str, ...], reps: int, measure) -> dict[str, list[dict]]:
    """`reps` measurements of each setting, `measure(setting)`, alternating: each setting takes its turn first."""
    runs = {setting: [] for setting in settings}
    for rep in range(reps):
        for setting in settings[rep % 2 :] + settings[: rep % 2]:
            runs[setting].append(measure(setting))
    return runs
