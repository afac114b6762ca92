"""The benchmarks' tasks: digit reversal with a tiny Llama pretrained to a middling accuracy (the learning benchmark's
and the iterative benchmark's fast scale), and two-digit products in GSM8K's format for SmolLM2-135M-Instruct (the
iterative benchmark's real scale). The embedded arithmetic task and the few-shot prompt are the library's
(`trl_topr.tasks`)."""

import os
import random
import shutil
from pathlib import Path


PRETRAIN_ROWS = 2048  # SFT rows of the reversal task's behavior policy


def reversal_rows(numbers: list[int]) -> list[dict]:
    """Reversal prompts of 4-digit strings ("rev 0 3 9 1 =" -> "1 9 3 0"), one per number in [0, 10000)."""
    rows = []
    for number in numbers:
        digits = list(f"{number:04d}")
        rows.append({"prompt": "rev " + " ".join(digits) + " =", "answer": " ".join(reversed(digits))})
    return rows


def reversal_numbers(rows: int) -> list[int]:
    """The fast scale's numbers, drawn once with seed 0: the behavior policy's `PRETRAIN_ROWS` SFT rows, then `rows`
    prompts (training, validation and test, in that order), all distinct."""
    return random.Random(0).sample(range(10**4), PRETRAIN_ROWS + rows)


def reversal_answer(text: str) -> str | None:
    """The four digits of a reversal completion, or None when it is not four single digits (invalid)."""
    tokens = text.split()
    return " ".join(tokens) if len(tokens) == 4 and all(len(t) == 1 and t.isdigit() for t in tokens) else None


def reversal_reward(prompts, completions, answer, **kwargs) -> list[float]:
    return [1.0 if reversal_answer(c) == a else -1.0 for c, a in zip(completions, answer)]


def pretrain_reverser(folder: str, numbers: list[int], steps: int = 130) -> str:
    """A tiny Llama that reverses 4 digits at a middling accuracy: the fast scale's behavior policy. The task is learnt
    abruptly: on held-out strings, 120 SFT steps give 36% greedy / 4% sampled accuracy (a start where positives are
    scarce), 130 steps (the default) 66% / 15%, 160 steps 100% / 74%. Built in a folder of its own and moved to
    `folder` once trained, so that an interrupted build, or two calls building it at once, never leave an untrained
    model there; where `folder` exists, it is kept (the build is seeded: the same model)."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from trl_topr.testing import build_tiny_model

    partial = Path(f"{folder}.partial-{os.getpid()}")
    build_tiny_model(str(partial), hidden_size=64)
    rows = reversal_rows(numbers)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": " " + r["answer"]} for r in rows])
    args = SFTConfig(
        output_dir=str(partial / "sft"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=steps,
        per_device_train_batch_size=32,
        learning_rate=3e-3,
        save_strategy="no",
        logging_steps=10**6,
        activation_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(str(partial), args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    trainer.save_model(str(partial))
    try:
        partial.rename(folder)
    except OSError:  # another call moved its model there first
        shutil.rmtree(partial)
        if not (Path(folder) / "model.safetensors").exists():
            raise
    return folder


def product_problems() -> list[dict[str, str]]:
    """The real scale's task, in GSM8K's question/answer format: the 712 products `a * b`, a in 11-99 and b in 2-9,
    shuffled."""
    problems = [
        {"question": f"What is {a} * {b}?", "answer": f"{a} * {b} = {a * b}\n#### {a * b}"}
        for a in range(11, 100)
        for b in range(2, 10)
    ]
    random.Random(0).shuffle(problems)
    return problems
