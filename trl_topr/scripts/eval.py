"""
Evaluate a policy on held-out prompts ([`~trl_topr.evaluate_policy`]): greedy and sampled pass@1, maj@k and the
invalid-output rate, the metrics of the TOPR paper. The metrics are printed as JSON on stdout and, with
`--output_path`, written to a JSON file.

A completion is correct when `--correct_func` (a reward function with TRL GRPO's signature, given by dotted path)
scores it above 0; `--answer_func` (`text -> str | None`) extracts its final answer, for maj@k and the invalid rate.
Both default to the GSM8K functions of `trl_topr.rewards`, which read the gold from an `answer` column
(`"... #### 72"`) or a `solution` column (`"72"`).

# GSM8K test set, SmolLM2-135M-Instruct (default model) before and after `trl-topr train`
```bash
trl-topr eval \
    --dataset_name openai/gsm8k --dataset_config main --dataset_split "test[:200]" \
    --prompt_column question --conversational \
    --num_generations 4 --max_completion_length 512

trl-topr eval \
    --model_name_or_path outputs/topr-smollm2-arith \
    --dataset_name openai/gsm8k --dataset_config main --dataset_split "test[:200]" \
    --prompt_column question --conversational \
    --num_generations 4 --max_completion_length 512 --output_path eval/topr.json
```

# Your data and checkers, on 8 GPUs (each generates a share of the prompts)
```bash
trl-topr eval \
    --model_name_or_path Qwen2-0.5B-TOPR \
    --dataset_name held_out.jsonl \
    --correct_func my_rewards.is_correct --answer_func my_rewards.final_answer \
    --num_processes 8
```
# With vLLM (`pip install trl-topr[vllm]`): an engine in each process, or a running server (docs/sampling.md)
```bash
trl-topr eval --dataset_name held_out.jsonl --use_vllm [--vllm_mode server --vllm_server_port 8000]
```
Without the launcher: `python -m trl_topr.scripts.eval ...`, or `accelerate launch -m trl_topr.scripts.eval ...`.
"""

from dataclasses import dataclass, field

from trl_topr.quiet import show_messages
from trl_topr.scripts.utils import (
    SAMPLING_SCRIPT_DEFAULTS,
    PromptArguments,
    import_function,
    load_prompts,
    model_init_kwargs,
    resolve_model,
)


@dataclass
class EvalArguments:
    """
    Arguments of `trl-topr eval` besides the prompts ([`~trl_topr.scripts.utils.PromptArguments`]), the sampling
    ([`~trl_topr.TOPRLoopConfig`]: `num_generations_eval`, or else `num_generations`, samples per prompt; `use_vllm`,
    ...), the precision and seed ([`~trl_topr.TOPRConfig`]) and the model (TRL's `ModelConfig`).

    Args:
        correct_func (`str`, *optional*, defaults to `"trl_topr.rewards.gsm8k_reward"`):
            Dotted path of a reward function with TRL GRPO's signature; a completion is correct when it scores > 0.
        answer_func (`str`, *optional*, defaults to `"trl_topr.rewards.extract_final_answer"`):
            Dotted path of a function `text -> str | None` giving a completion's final answer (`None`: invalid).
        output_path (`str`, *optional*):
            JSON file to write the metrics to, besides printing them.
    """

    correct_func: str = field(
        default="trl_topr.rewards.gsm8k_reward",
        metadata={"help": "Dotted path of a reward function (GRPO signature): correct when > 0."},
    )
    answer_func: str = field(
        default="trl_topr.rewards.extract_final_answer",
        metadata={"help": "Dotted path of a function `text -> str | None`: a completion's final answer."},
    )
    output_path: str | None = field(default=None, metadata={"help": "JSON file to write the metrics to."})


def main(script_args: EvalArguments, prompt_args: PromptArguments, loop_args, training_args, model_args):
    """
    Evaluate the model with a [`~trl_topr.Sampler`] (as [`~trl_topr.evaluate_policy`]), print the metrics as JSON and
    write them to `script_args.output_path`.

    Args:
        script_args ([`EvalArguments`]):
            Correctness and answer functions, output path.
        prompt_args ([`~trl_topr.scripts.utils.PromptArguments`]):
            The held-out prompts.
        loop_args ([`~trl_topr.TOPRLoopConfig`]):
            How to sample (its evaluation settings) and with which engine (`use_vllm`, ...).
        training_args ([`~trl_topr.TOPRConfig`]):
            The precision and the sampling's `seed`.
        model_args ([`~trl.ModelConfig`]):
            The model.

    Returns:
        `dict[str, float]`: `pass@1_greedy`, `pass@1`, `maj@k`, `invalid_rate`, `invalid_rate_greedy`,
        `truncated_rate` and `mean_length`.
    """
    import json
    from pathlib import Path

    from accelerate import PartialState
    from transformers import AutoTokenizer
    from trl.trainer.utils import create_model_from_path

    from trl_topr import Sampler
    from trl_topr.distributed import together

    correct_func = import_function(script_args.correct_func)
    answer_func = import_function(script_args.answer_func)
    prompts = load_prompts(prompt_args, training_args.prompt_column)
    model_path = resolve_model(model_args.model_name_or_path)
    training_args.model_init_kwargs = model_init_kwargs(
        model_args, trust_remote_code=training_args.trust_remote_code, device_per_process=True
    )
    model = create_model_from_path(model_path, **training_args.model_init_kwargs)
    state = PartialState()
    if model.device.type == "cpu" and state.device.type != "cpu":
        model = model.to(state.device)
    tokenizer = AutoTokenizer.from_pretrained(
        model_path, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    with Sampler.from_config(model, tokenizer, loop_args, training_args, progress=state.is_main_process) as sampler:
        metrics = sampler.evaluate(
            prompts, correct_func, answer_func, loop_args.eval_sampling(seed=training_args.seed)
        )
    with together("writing the metrics"):  # every process stops where it fails
        if state.is_main_process:
            text = json.dumps(metrics, indent=2)
            print(text)
            if script_args.output_path is not None:
                path = Path(script_args.output_path)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text + "\n")
    return metrics


def make_parser(prog: str | None = None):
    """
    TRL's parser for [`EvalArguments`], [`~trl_topr.scripts.utils.PromptArguments`] (whose split defaults to
    `"test"` here), [`~trl_topr.TOPRLoopConfig`], [`~trl_topr.TOPRConfig`] and TRL's `ModelConfig`.

    Args:
        prog (`str`, *optional*):
            Program name shown in the usage, e.g. `"trl-topr eval"`.

    Returns:
        [`~trl.TrlParser`]: the parser.
    """
    from trl import ModelConfig, TrlParser

    from trl_topr import TOPRConfig, TOPRLoopConfig

    parser = TrlParser(
        (EvalArguments, PromptArguments, TOPRLoopConfig, TOPRConfig, ModelConfig),
        prog=prog,
        description="Evaluate a policy: pass@1 (greedy and sampled), maj@k and invalid rate, printed as JSON.",
    )
    parser.set_defaults(dataset_split="test", **SAMPLING_SCRIPT_DEFAULTS)
    return parser


if __name__ == "__main__":
    show_messages()
    parser = make_parser()
    main(*parser.parse_args_and_config(fail_with_unknown_args=False))
