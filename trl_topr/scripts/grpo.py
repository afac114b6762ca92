"""
Online TOPR with TRL's GRPO script: `trl grpo` with [`~trl_topr.TOPRGRPOTrainer`] and [`~trl_topr.TOPRGRPOConfig`] in
place of TRL's trainer and configuration. It does what TRL's script (`trl.scripts.grpo`) does, with TRL's public
pieces: the same arguments, reward functions (TRL's registry names or dotted paths), dataset loading, saving and
publishing; TOPR adds its options (`--loss_type`, `--target_positive_fraction`, `--group_baseline`, ...) and logs the
precision it picked.

```bash
trl-topr grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \
    --reward_funcs accuracy_reward --target_positive_fraction 0.8 --output_dir Qwen2.5-0.5B-TOPR-online
```
Without the launcher: `python -m trl_topr.scripts.grpo ...`, or `accelerate launch -m trl_topr.scripts.grpo ...`.
"""

from trl_topr.quiet import show_messages


def reward_functions(script_args) -> list:
    """
    The reward models and functions of TRL's GRPO script arguments, as TRL's script reads them: the reward model's id
    or path, then each of `reward_funcs`, a name of TRL's registry (`accuracy_reward`, `reasoning_accuracy_reward`,
    `think_format_reward`, `get_soft_overlong_punishment`) or a dotted path.

    Args:
        script_args (`trl.scripts.grpo.GRPOScriptArguments`):
            The script's arguments.

    Returns:
        `list`: the reward models' ids and the functions, in order.

    Raises:
        `ValueError`: naming a reward function that is neither in the registry nor a dotted path.
    """
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    from trl_topr.scripts.utils import import_function

    registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }
    funcs = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if name not in registry and "." not in name:
            raise ValueError(
                f"Could not load reward function {name!r}: expected one of {list(registry)} or a dotted path."
            )
        funcs.append(registry[name] if name in registry else import_function(name))
    return funcs


def load_datasets(script_args, dataset_args):
    """
    The splits TRL's GRPO script trains on: a mixture of datasets (`datasets:`, which wins, as in TRL) or
    `dataset_name`.

    Args:
        script_args (`trl.scripts.grpo.GRPOScriptArguments`):
            `dataset_name`, `dataset_config`, `dataset_streaming`.
        dataset_args ([`~trl.DatasetMixtureConfig`]):
            The mixture.

    Returns:
        [`~datasets.DatasetDict`]: the splits.

    Raises:
        `ValueError`: without either.
    """
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    raise ValueError("Either `datasets` or `dataset_name` must be provided.")


def main(script_args, training_args, model_args, dataset_args):
    """
    Train with [`~trl_topr.TOPRGRPOTrainer`] as TRL's GRPO script (`trl grpo`) trains with `GRPOTrainer`, from TRL's
    public pieces: the same arguments, reward functions, dataset loading (`dataset_name` or a mixture), model options,
    saving and publishing.

    Args:
        script_args (`trl.scripts.grpo.GRPOScriptArguments`):
            The dataset and the reward functions.
        training_args ([`~trl_topr.TOPRGRPOConfig`]):
            TRL's GRPO options and TOPR's.
        model_args ([`~trl.ModelConfig`]):
            The model.
        dataset_args ([`~trl.DatasetMixtureConfig`]):
            A mixture of datasets, as TRL's scripts take it.

    Returns:
        [`~trl_topr.TOPRGRPOTrainer`]: the trainer, trained and saved.
    """
    from trl import get_peft_config, get_quantization_config

    from trl_topr import TOPRGRPOTrainer
    from trl_topr.scripts.utils import model_init_kwargs

    reward_funcs = reward_functions(script_args)
    training_args.model_init_kwargs = {
        **model_init_kwargs(model_args, trust_remote_code=training_args.trust_remote_code),
        **(training_args.model_init_kwargs or {}),
    }
    dataset = load_datasets(script_args, dataset_args)
    trainer = TOPRGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()  # the trackers finished, the process group destroyed
    return trainer


def make_parser(prog: str | None = None):
    """
    TRL's GRPO parser with [`~trl_topr.TOPRGRPOConfig`] in place of `GRPOConfig`.

    Args:
        prog (`str`, *optional*):
            Program name shown in the usage, e.g. `"trl-topr grpo"`.

    Returns:
        [`~trl.TrlParser`]: the parser.
    """
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    from trl_topr import TOPRGRPOConfig

    return TrlParser(
        (GRPOScriptArguments, TOPRGRPOConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        description="Online TOPR: TRL's GRPO script with TOPR's loss.",
    )


if __name__ == "__main__":
    show_messages()  # the precision the configuration picked, and why
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
