"""Two notices that libraries print on import, which a user can do nothing about, filtered out by exact message.

- bitsandbytes (imported by PEFT whenever it is installed, 4-bit asked for or not) logs on CPUs with AVX512-BF16 that
  an optional kernel package is missing: `Failed to load CPU gemm_4bit_forward from kernels-community: ...`.
  bitsandbytes falls back to its own CPU kernels; 4-bit training is for GPUs.
- DeepSpeed (imported by accelerate when it is installed, e.g. to unwrap a model on save) logs `Setting accelerator to
  CPU. If you have GPU or other accelerator, we were unable to detect it.` when it finds no accelerator. Filtered only
  when PyTorch sees none either: where PyTorch sees one that DeepSpeed missed, the warning stays.

Every other record of these loggers passes, warnings included. [`show_messages`] is the other way round: it shows
this library's own messages, which Python's logging would leave out below a warning.
"""

import logging


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str, when=lambda: True):
        super().__init__()
        self.prefix, self.when = prefix, when

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(self.prefix) and self.when())


def _no_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return not (accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


NOTICES = {
    "bitsandbytes.backends.cpu.ops": _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community"),
    "DeepSpeed": _DropMessage("Setting accelerator to CPU. If you have GPU or other accelerator", _no_accelerator),
}


def silence_unactionable_notices() -> None:
    """Install the filters of `NOTICES` on their loggers (idempotent). Must run before the library is imported, as
    both notices are logged at import time."""
    for name, notice in NOTICES.items():
        logger = logging.getLogger(name)
        if notice not in logger.filters:
            logger.addFilter(notice)


def show_messages() -> None:
    """
    Print this library's messages (logger `trl_topr`, level INFO and above) with their time, as the `trl-topr`
    commands and the recipes do: the precision chosen and why, the loop's progress. Python's logging shows only
    warnings without this. Where the logger already has a handler (a second call, or the user's own), none is added.
    """
    logger = logging.getLogger("trl_topr")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
