"""Names that differ between the versions of the libraries trl-topr supports."""

from dataclasses import fields

from transformers import TrainingArguments


# transformers 5.20 renamed gradient checkpointing "activation checkpointing" (the old names stay as deprecated
# aliases); vLLM's CPU build pins transformers < 5.20, which has the old names only.
CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}
    else "gradient_checkpointing"
)
