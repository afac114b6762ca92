"""
Sample a TOPR dataset: completions of a prompts dataset by a model, scored by reward functions, with their behavior
log-probs ([`~trl_topr.sample_completions`]).

The output has one row per completion: `prompt`, `completion`, `reward` (the weighted sum of the reward functions),
`behavior_logps` (one value per completion token, computed as `trl-topr train` computes them), a column
`rewards/<name>` per reward function and the prompts' other columns: it is ready for `trl-topr train --dataset_name
<output_path>`.

Reward functions have TRL GRPO's signature, `fn(prompts, completions, **columns) -> list[float | None]`, and are given
by dotted path, as in TRL's GRPO script (`my_rewards.my_reward` for `./my_rewards.py`); a bare name is a function of
`trl_topr.rewards`. A weight of 0 keeps a function as a column only, e.g. the `gsm8k_invalid` flag. The sampling
options are [`~trl_topr.TOPRLoopConfig`]'s (TRL GRPO's names), the options of the training the samples are for
(`max_length`, the precision, `seed`) [`~trl_topr.TOPRConfig`]'s, the model's TRL's `ModelConfig`.

# GSM8K with SmolLM2-135M-Instruct (default model), 16 samples per prompt
```bash
trl-topr sample \
    --dataset_name openai/gsm8k --dataset_config main --dataset_split "train[:256]" \
    --prompt_column question --conversational \
    --reward_funcs trl_topr.rewards.gsm8k_reward trl_topr.rewards.gsm8k_invalid --reward_weights 1 0 \
    --num_generations 16 --temperature 1.0 --top_k 500 --max_completion_length 512 \
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

from trl_topr.quiet import show_messages
from trl_topr.scripts.utils import (
    SAMPLING_SCRIPT_DEFAULTS,
    PromptArguments,
    check_dataset_path,
    import_function,
    load_prompts,
    model_init_kwargs,
    resolve_model,
    save_dataset,
)


@dataclass
class SampleArguments:
    """
    Arguments of `trl-topr sample` besides the prompts ([`~trl_topr.scripts.utils.PromptArguments`]), the sampling
    ([`~trl_topr.TOPRLoopConfig`]: `num_generations`, `reward_weights`, `use_vllm`, ...), the training the samples
    are for ([`~trl_topr.TOPRConfig`]: `max_length`, the precision, `seed`) and the model (TRL's `ModelConfig`).

    Args:
        reward_funcs (`list[str]`):
            Reward functions, as dotted paths (e.g. `trl_topr.rewards.gsm8k_reward my_rewards.my_reward`) or names of
            `trl_topr.rewards` functions. Each gets a column named after it.
        output_path (`str`):
            Where to write the samples: a `.jsonl`, `.json` or `.parquet` file, or else a `save_to_disk` folder.
    """

    reward_funcs: list[str] = field(
        metadata={"help": "Reward functions: dotted paths (`my_rewards.my_reward`) or names in `trl_topr.rewards`."}
    )
    output_path: str = field(
        metadata={"help": "Output: a .jsonl, .json or .parquet file, or else a `save_to_disk` folder."}
    )


def main(script_args: SampleArguments, prompt_args: PromptArguments, loop_args, training_args, model_args):
    """
    Sample, score and save a TOPR dataset with a [`~trl_topr.Sampler`].

    Args:
        script_args ([`SampleArguments`]):
            Reward functions and output path.
        prompt_args ([`~trl_topr.scripts.utils.PromptArguments`]):
            The prompts.
        loop_args ([`~trl_topr.TOPRLoopConfig`]):
            How to sample: completions per prompt, temperature, ..., the reward weights, the engine (`use_vllm`) and
            the behavior log-probs' source.
        training_args ([`~trl_topr.TOPRConfig`]):
            The training the samples are for: its `max_length`, precision and `padding_free` set how the behavior
            log-probs are computed, its `seed` the sampling's.
        model_args ([`~trl.ModelConfig`]):
            The model.

    Returns:
        [`~datasets.Dataset`]: the samples, as written to `script_args.output_path`.
    """
    from accelerate import PartialState
    from transformers import AutoTokenizer
    from trl.trainer.utils import create_model_from_path

    from trl_topr import Sampler
    from trl_topr.distributed import together

    check_dataset_path(script_args.output_path)  # before anything is sampled, on every process
    reward_funcs = [import_function(path) for path in script_args.reward_funcs]
    prompts = load_prompts(prompt_args, training_args.prompt_column)
    model_path = resolve_model(model_args.model_name_or_path)
    training_args.model_init_kwargs = model_init_kwargs(
        model_args, trust_remote_code=training_args.trust_remote_code, device_per_process=True
    )
    model = create_model_from_path(model_path, **training_args.model_init_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(
        model_path, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    state = PartialState()
    with Sampler.from_config(
        model, tokenizer, loop_args, training_args, reward_funcs, progress=state.is_main_process
    ) as sampler:
        samples = sampler.sample(prompts, loop_args.sampling(seed=training_args.seed))
    with together(f"saving the samples to {script_args.output_path}"):  # every process stops where it fails
        if state.is_main_process:
            save_dataset(samples, script_args.output_path)
            rewards = samples["reward"]
            print(
                f"{len(samples)} samples of {len(prompts)} prompts, mean reward {sum(rewards) / len(rewards):.3f}, "
                f"saved to {script_args.output_path}."
            )
    return samples


def make_parser(prog: str | None = None):
    """
    TRL's parser for [`SampleArguments`], [`~trl_topr.scripts.utils.PromptArguments`], [`~trl_topr.TOPRLoopConfig`],
    [`~trl_topr.TOPRConfig`] and TRL's `ModelConfig`.

    Args:
        prog (`str`, *optional*):
            Program name shown in the usage, e.g. `"trl-topr sample"`.

    Returns:
        [`~trl.TrlParser`]: the parser.
    """
    from trl import ModelConfig, TrlParser

    from trl_topr import TOPRConfig, TOPRLoopConfig

    parser = TrlParser(
        (SampleArguments, PromptArguments, TOPRLoopConfig, TOPRConfig, ModelConfig),
        prog=prog,
        description="Sample a TOPR dataset: completions, rewards and behavior log-probs.",
    )
    parser.set_defaults(**SAMPLING_SCRIPT_DEFAULTS)
    return parser


if __name__ == "__main__":
    show_messages()
    parser = make_parser()
    main(*parser.parse_args_and_config(fail_with_unknown_args=False))
