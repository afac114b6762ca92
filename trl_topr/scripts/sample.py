"""
Sample a TOPR dataset: completions of a prompts dataset by a model, scored by reward functions, with their behavior
log-probs ([`~trl_topr.sample_completions`]).

The output has one row per completion: `prompt`, `completion`, `reward` (the weighted sum of the reward functions),
`behavior_logps` (one value per completion token, computed as `trl-topr train` computes them), a column
`rewards/<name>` per reward function and the prompts' other columns: it is ready for `trl-topr train --dataset_name
<output_path>`.

Reward functions have TRL GRPO's signature, `fn(prompts, completions, **columns) -> list[float | None]`, and are given
by dotted path, as in TRL's GRPO script (`my_rewards.my_reward` for `./my_rewards.py`); a bare name is a function of
`trl_topr.rewards`. A weight of 0 keeps a function as a column only, e.g. the `gsm8k_invalid` flag.

# GSM8K with SmolLM2-135M-Instruct (default model), 16 samples per prompt
```bash
trl-topr sample \
    --dataset_name openai/gsm8k --dataset_config main --dataset_split "train[:256]" \
    --prompt_column question --conversational \
    --reward_funcs trl_topr.rewards.gsm8k_reward trl_topr.rewards.gsm8k_invalid --reward_weights 1 0 \
    --num_samples 16 --temperature 1.0 --top_k 500 --max_new_tokens 512 \
    --output_path samples/gsm8k.jsonl
```

# Your prompts and reward function, on 8 GPUs (each samples a share of the prompts)
```bash
trl-topr sample \
    --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
    --dataset_name prompts.jsonl \
    --reward_funcs my_rewards.my_reward \
    --output_path samples \
    --num_processes 8
```
# With vLLM (`pip install trl-topr[vllm]`): an engine in each process, or a running server (docs/sampling.md)
```bash
trl-topr sample --dataset_name prompts.jsonl --reward_funcs my_rewards.my_reward --output_path samples.jsonl \
    --use_vllm [--vllm_mode server --vllm_server_port 8000] [--behavior_logps_source sampler]
```
An `--output_path` ending in `.jsonl`, `.json` or `.parquet` writes that file; any other path a
`save_to_disk` folder. Without the launcher: `python -m trl_topr.scripts.sample ...` (same arguments, minus the
`accelerate launch` ones), or `accelerate launch -m trl_topr.scripts.sample ...`.
"""

from dataclasses import dataclass, field

from trl_topr.generation import VLLMArguments
from trl_topr.scripts.utils import (
    GenerationArguments,
    import_function,
    load_prompts,
    resolve_model,
    sampling_config,
    save_dataset,
    show_messages,
)


@dataclass
class SampleArguments:
    """
    Arguments of `trl-topr sample` besides [`~trl_topr.scripts.utils.GenerationArguments`].

    Args:
        reward_funcs (`list[str]`):
            Reward functions, as dotted paths (e.g. `trl_topr.rewards.gsm8k_reward my_rewards.my_reward`) or names of
            `trl_topr.rewards` functions. Each gets a column named after it.
        output_path (`str`):
            Where to write the samples: a `.jsonl`, `.json` or `.parquet` file, or else a `save_to_disk` folder.
        reward_weights (`list[float]`, *optional*):
            Weight of each reward function in the `reward` column; defaults to 1 each.
        max_length (`int` or `None`, *optional*, defaults to `1024`):
            `max_length` of the training the samples are for: prompt + completion tokens beyond it are truncated
            when computing the behavior log-probs, as in training. `None` for no truncation.
    """

    reward_funcs: list[str] = field(
        metadata={"help": "Reward functions: dotted paths (`my_rewards.my_reward`) or names in `trl_topr.rewards`."}
    )
    output_path: str = field(
        metadata={"help": "Output: a .jsonl, .json or .parquet file, or else a `save_to_disk` folder."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weight of each reward function in `reward` (default 1 each)."}
    )
    max_length: int | None = field(
        default=1024,
        metadata={"help": "Training `max_length`: longer rows are truncated for the behavior log-probs, as there."},
    )


def main(script_args: SampleArguments, generation_args: GenerationArguments, vllm_args: VLLMArguments | None = None):
    """
    Sample, score and save a TOPR dataset with [`~trl_topr.sample_completions`].

    Args:
        script_args ([`SampleArguments`]):
            Reward functions, output path, and `max_length`.
        generation_args ([`~trl_topr.scripts.utils.GenerationArguments`]):
            Model, prompts and sampling settings.
        vllm_args ([`~trl_topr.generation.arguments.VLLMArguments`], *optional*):
            Sampling with vLLM (TRL's `use_vllm`, `vllm_mode`... options) and the behavior log-probs' source.

    Returns:
        [`~datasets.Dataset`]: the samples, as written to `script_args.output_path`.
    """
    import tempfile

    from accelerate import PartialState
    from transformers import AutoTokenizer

    from trl_topr import sample_completions

    reward_funcs = [import_function(path) for path in script_args.reward_funcs]
    prompts = load_prompts(generation_args)
    model = resolve_model(generation_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(
        model, revision=generation_args.model_revision, trust_remote_code=generation_args.trust_remote_code
    )
    with tempfile.TemporaryDirectory() as scratch:
        args = sampling_config(generation_args, vllm_args, scratch, max_length=script_args.max_length)
        samples = sample_completions(
            model,
            prompts,
            reward_funcs,
            processing_class=tokenizer,
            reward_weights=script_args.reward_weights,
            sampling=generation_args.sampling_settings(),
            args=args,
        )
    state = PartialState()
    if state.is_main_process:
        save_dataset(samples, script_args.output_path)
        rewards = samples["reward"]
        print(
            f"{len(samples)} samples of {len(prompts)} prompts, mean reward {sum(rewards) / len(rewards):.3f}, "
            f"saved to {script_args.output_path}."
        )
    state.wait_for_everyone()
    return samples


def make_parser(prog: str | None = None):
    """
    TRL's parser for [`SampleArguments`] and [`~trl_topr.scripts.utils.GenerationArguments`].

    Args:
        prog (`str`, *optional*):
            Program name shown in the usage, e.g. `"trl-topr sample"`.

    Returns:
        [`~trl.TrlParser`]: the parser.
    """
    from trl import TrlParser

    return TrlParser(
        (SampleArguments, GenerationArguments, VLLMArguments),
        prog=prog,
        description="Sample a TOPR dataset: completions, rewards and behavior log-probs.",
    )


if __name__ == "__main__":
    show_messages()
    parser = make_parser()
    script_args, generation_args, vllm_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, generation_args, vllm_args)
