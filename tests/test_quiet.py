"""A first run prints only the product: the import-time notices of bitsandbytes and DeepSpeed that a user cannot act
on are filtered out, by exact message, and nothing else of theirs is."""

import logging
import os
import subprocess
import sys
from pathlib import Path

from trl_topr.quiet import NOTICES


ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Failed to load CPU gemm_4bit_forward from kernels-community", "Setting accelerator to CPU")


def run(code: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "tests"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_import_and_save_print_no_third_party_notice(tmp_path):
    # Both libraries are installed by README's test command, so both are imported here: PEFT imports bitsandbytes,
    # and accelerate imports DeepSpeed when `save_pretrained` unwraps the model. Without the filters, they would log.
    output = run(
        "import sys, trl_topr; from conftest import build_tiny_model; from transformers import AutoModelForCausalLM; "
        f"AutoModelForCausalLM.from_pretrained(build_tiny_model({str(tmp_path)!r}))"
        f".save_pretrained({str(tmp_path / 'saved')!r}); "
        "print('imported', 'bitsandbytes' in sys.modules, 'deepspeed' in sys.modules)"
    )
    assert "imported True True" in output
    assert not [line for line in output.splitlines() if line.strip() and any(noise in line for noise in NOISE)]


def test_the_recipes_import_trl_topr_before_the_libraries_that_log():
    for recipe in ("gsm8k", "verifier"):
        result = subprocess.run(
            [sys.executable, f"recipes/{recipe}.py", "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout and NOISE[0] not in result.stdout + result.stderr


def test_the_filters_drop_only_their_own_message():
    def passes(logger: str, message: str) -> bool:
        record = logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, None)
        return NOTICES[logger].filter(record)

    assert not passes("bitsandbytes.backends.cpu.ops", NOISE[0] + ": No module named 'kernels'. Please ...")
    assert passes("bitsandbytes.backends.cpu.ops", "gemv_4bit autograd is not checked for correctness")
    import torch

    # DeepSpeed's notice is dropped only where PyTorch sees no accelerator either
    assert passes("DeepSpeed", NOISE[1] + ". If you have GPU or other accelerator, ...") == torch.cuda.is_available()
    assert passes("DeepSpeed", "Setting ds_accelerator to cpu (auto detect)")
    assert all(notice in logging.getLogger(name).filters for name, notice in NOTICES.items())  # installed on import


def test_the_package_imports_trls_experimental_async_trainer_only_when_it_is_used():
    # TRL 1.16's asynchronous trainer is in `trl.experimental`, which warns when imported: `import trl_topr` does not
    # import it (nor print its warning); the async names do, when first used
    output = run(
        "import sys, warnings; warnings.simplefilter('always'); import trl_topr; "
        "print('before', any(m.startswith('trl.experimental.async_grpo') for m in sys.modules)); "
        "trl_topr.TOPRAsyncGRPOTrainer; "
        "print('after', any(m.startswith('trl.experimental.async_grpo') for m in sys.modules))"
    )
    assert "before False" in output and "after True" in output
    assert "trl.experimental" not in output.split("before False")[0]
