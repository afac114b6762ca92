"""
Asynchronous TOPR: [`~trl_topr.TOPRAsyncGRPOTrainer`] (TRL's asynchronous GRPO trainer with TOPR's loss, stale
samples kept) with the arguments of TRL's GRPO script (`trl grpo`: the dataset or a mixture of datasets, reward
functions from TRL's registry or by dotted path, the model) and [`~trl_topr.TOPRAsyncGRPOConfig`].

```bash
# on GPUs: TRL's rollout worker, on a vLLM server started beforehand (`trl vllm-serve --model ...`)
trl-topr async-grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
    --reward_funcs accuracy_reward --target_positive_fraction 0.8 --output_dir Qwen2.5-0.5B-TOPR-async
# on a CPU, in minutes, offline: the embedded SmolLM2-135M-Instruct on arithmetic, rollouts in the process
trl-topr async-grpo --config recipes/configs/async_grpo_cpu.yaml
```
Without a dataset (neither `dataset_name` nor `datasets`), it trains on the embedded task: single-digit arithmetic in
GSM8K's format with a one-shot prompt (`trl_topr.tasks`), scored by [`~trl_topr.gsm8k_reward`] where no reward
function is named; without `model_name_or_path`, the embedded SmolLM2-135M-Instruct.
"""

from dataclasses import dataclass, field

from trl import ModelConfig

from trl_topr.quiet import show_messages


@dataclass
class AsyncModelConfig(ModelConfig):
    """
    TRL's `ModelConfig` without its `dtype`: TRL's asynchronous configuration has a `dtype` of its own (the model's
    precision, `--dtype`), which the trainer loads the model in.
    """

    dtype: str | None = field(default=None, init=False)


def embedded_prompts(seed: int):
    """The embedded task's training prompts: the arithmetic questions in GSM8K's format, one-shot (a `DatasetDict`
    with a `train` split)."""
    from datasets import DatasetDict

    from trl_topr.tasks import arithmetic_problems, few_shot_prompts

    problems = arithmetic_problems(seed)
    return DatasetDict(train=few_shot_prompts(problems[1:160], problems[:1]))


def main(script_args, training_args, model_args, dataset_args):
    """
    Train with [`~trl_topr.TOPRAsyncGRPOTrainer`] as TRL's GRPO script trains with `GRPOTrainer`: the dataset (or the
    embedded task), the reward functions, the model options, then train, save and publish.

    Args:
        script_args (`trl.scripts.grpo.GRPOScriptArguments`):
            The dataset and the reward functions.
        training_args ([`~trl_topr.TOPRAsyncGRPOConfig`]):
            TRL's asynchronous GRPO options and TOPR's.
        model_args ([`AsyncModelConfig`]):
            The model.
        dataset_args ([`~trl.DatasetMixtureConfig`]):
            A mixture of datasets.

    Returns:
        [`~trl_topr.TOPRAsyncGRPOTrainer`]: the trainer, trained and saved.
    """
    from trl import get_peft_config

    from trl_topr import TOPRAsyncGRPOTrainer, gsm8k_reward
    from trl_topr.scripts.grpo import load_datasets, reward_functions
    from trl_topr.scripts.utils import model_init_kwargs, resolve_model

    embedded = not (dataset_args.datasets or script_args.dataset_name)
    dataset = embedded_prompts(training_args.seed) if embedded else load_datasets(script_args, dataset_args)
    reward_funcs = reward_functions(script_args) or ([gsm8k_reward] if embedded else [])
    options = model_init_kwargs(model_args, trust_remote_code=training_args.trust_remote_code)
    options.pop("attn_implementation")  # TRL's asynchronous trainer packs samples with its own attention
    options.pop("dtype")  # the configuration's (`--dtype`)
    training_args.model_init_kwargs = {**options, **(training_args.model_init_kwargs or {})}
    trainer = TOPRAsyncGRPOTrainer(
        resolve_model(model_args.model_name_or_path),
        reward_funcs,
        training_args,
        dataset[script_args.dataset_train_split],
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


def make_parser(prog: str | None = None):
    """
    TRL's GRPO script's parser with [`~trl_topr.TOPRAsyncGRPOConfig`] as the training configuration.

    Args:
        prog (`str`, *optional*):
            Program name shown in the usage, e.g. `"trl-topr async-grpo"`.

    Returns:
        [`~trl.TrlParser`]: the parser.
    """
    from trl import DatasetMixtureConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    from trl_topr import TOPRAsyncGRPOConfig

    return TrlParser(
        (GRPOScriptArguments, TOPRAsyncGRPOConfig, AsyncModelConfig, DatasetMixtureConfig),
        prog=prog,
        description="Asynchronous TOPR: TRL's asynchronous GRPO trainer with TOPR's loss, stale samples kept.",
    )


if __name__ == "__main__":
    show_messages()  # the precision the configuration picked, and why
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
