"""
Online TOPR with TRL's GRPO script: `trl grpo` with [`~trl_topr.TOPRGRPOTrainer`] and [`~trl_topr.TOPRGRPOConfig`] in
place of TRL's trainer and configuration. The script is TRL's own (`trl.scripts.grpo`): the same arguments, reward
functions (TRL's registry names or dotted paths), dataset loading, saving and publishing; TOPR adds its options
(`--loss_type`, `--target_positive_fraction`, `--group_baseline`, ...) and logs the precision it picked.

```bash
trl-topr grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \
    --reward_funcs accuracy_reward --target_positive_fraction 0.8 --output_dir Qwen2.5-0.5B-TOPR-online
```
Without the launcher: `python -m trl_topr.scripts.grpo ...`, or `accelerate launch -m trl_topr.scripts.grpo ...`.
"""

from trl_topr.scripts.utils import show_messages


def main(script_args, training_args, model_args, dataset_args) -> None:
    """
    Run TRL's GRPO script (`trl.scripts.grpo.main`) with [`~trl_topr.TOPRGRPOTrainer`] as its trainer.

    Args:
        script_args (`trl.scripts.grpo.GRPOScriptArguments`):
            The dataset and the reward functions.
        training_args ([`~trl_topr.TOPRGRPOConfig`]):
            TRL's GRPO options and TOPR's.
        model_args ([`~trl.ModelConfig`]):
            The model.
        dataset_args ([`~trl.DatasetMixtureConfig`]):
            A mixture of datasets, as TRL's scripts take it.
    """
    from unittest.mock import patch

    import trl
    from trl.scripts import grpo

    from trl_topr import TOPRGRPOTrainer

    with patch.object(trl, "GRPOTrainer", TOPRGRPOTrainer):  # the script imports its trainer from `trl`
        grpo.main(script_args, training_args, model_args, dataset_args)


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
