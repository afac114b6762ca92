"""
The `trl-topr` command, in the style of the `trl` CLI: each subcommand launches a script of `trl_topr.scripts` through
`accelerate launch`.

```bash
trl-topr train  [--model_name_or_path ...] [--dataset_name ...] [TOPRConfig, ModelConfig options] [launch options]
trl-topr sample --dataset_name ... --reward_funcs ... --output_path ... [sampling options] [launch options]
trl-topr eval   --dataset_name ... [--correct_func ...] [--answer_func ...] [sampling options] [launch options]
trl-topr grpo   --dataset_name ... --reward_funcs ... [TOPRGRPOConfig, ModelConfig options] [launch options]
trl-topr async-grpo [--dataset_name ... --reward_funcs ...] [TOPRAsyncGRPOConfig, ModelConfig options] [launch options]
```

The arguments the script does not know are `accelerate launch` options (`--num_processes 8`, `--mixed_precision bf16`,
`--config_file ...`), as is `--accelerate_config NAME`, a file or one of the configurations shipped with TRL
(`zero2`, `zero3`, `fsdp2`, `multi_gpu`, ...). A YAML file given with `--config` may hold both kinds.
"""

import importlib
import subprocess
import sys
from argparse import ArgumentParser
from collections.abc import Callable
from typing import Any


COMMANDS = {
    "train": ("trl_topr.scripts.train", "Train a model with offline TOPR on a dataset of scored completions"),
    "sample": ("trl_topr.scripts.sample", "Sample a TOPR dataset: completions, rewards and behavior log-probs"),
    "eval": ("trl_topr.scripts.eval", "Evaluate a policy: pass@1, maj@k and invalid rate, as JSON"),
    "grpo": ("trl_topr.scripts.grpo", "Online TOPR: TRL's GRPO script with TOPR's loss (as `trl grpo`)"),
    "async-grpo": ("trl_topr.scripts.async_grpo", "Asynchronous TOPR: TRL's async GRPO trainer with TOPR's loss"),
}


def _build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="trl-topr",
        description="Tapered Off-Policy REINFORCE (TOPR) for TRL. `trl-topr COMMAND --help` lists its options.",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(help="available commands", dest="command")
    for name, (_, help_text) in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)  # the script's own parser handles --help
    return parser


def _subtract_subsequence(tokens: list[str], subsequence: list[str]) -> list[str]:
    """`tokens` without the ordered `subsequence` (as TRL's CLI separates launch from script arguments)."""
    remaining, result = iter(subsequence), []
    current = next(remaining, None)
    for token in tokens:
        if current is not None and token == current:
            current = next(remaining, None)
        else:
            result.append(token)
    return result


def launch_script(
    module: str,
    launch_args: list[str],
    script_args: list[str],
    *,
    launch_command_fn: Callable[[Any], None] | None = None,
    launch_parser_fn: Callable[[], Any] | None = None,
) -> None:
    """
    Launch a script module through `accelerate launch -m`, as TRL's CLI launches its scripts.

    Args:
        module (`str`):
            Module of the script, e.g. `"trl_topr.scripts.train"`.
        launch_args (`list[str]`):
            Arguments of `accelerate launch`, e.g. `["--num_processes", "8"]`.
        script_args (`list[str]`):
            Arguments of the script.
        launch_command_fn (`Callable[[Any], None]`, *optional*):
            Runs the parsed launch arguments. Defaults to `accelerate.commands.launch.launch_command`.
        launch_parser_fn (`Callable[[], Any]`, *optional*):
            Builds the launch parser. Defaults to `accelerate.commands.launch.launch_command_parser`.

    Example:
    ```python
    from trl_topr.cli import launch_script

    # accelerate launch --num_processes 2 -m trl_topr.scripts.eval --dataset_name held_out.jsonl
    launch_script("trl_topr.scripts.eval", ["--num_processes", "2"], ["--dataset_name", "held_out.jsonl"])
    ```
    """
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command_fn = launch_command_fn or launch_command
    launch_parser_fn = launch_parser_fn or launch_command_parser
    accelerate_args = launch_parser_fn().parse_args([*launch_args, "--module", module, *script_args])
    launch_command_fn(accelerate_args)


def main(argv: list[str] | None = None) -> int:
    """
    Run the `trl-topr` command.

    Args:
        argv (`list[str]`, *optional*):
            Command-line arguments without the program name; defaults to `sys.argv[1:]`.

    Returns:
        `int`: the exit status, that of the launched script (0 on success).

    Example:
    ```python
    from trl_topr.cli import main

    main(["eval", "--model_name_or_path", "outputs/topr-smollm2-arith", "--dataset_name", "held_out.jsonl"])
    ```
    """
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0

    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    module_name = COMMANDS[args.command][0]
    script_parser = importlib.import_module(module_name).make_parser(prog=f"trl-topr {args.command}")
    all_args = argv[argv.index(args.command) + 1 :]
    # Handles --help (and exits). What neither the script nor its --config file knows goes to `accelerate launch`.
    *_, config_remaining, cli_remaining = script_parser.parse_args_and_config(
        all_args, return_remaining_strings=True, separate_remaining_strings=True
    )
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _subtract_subsequence(all_args, cli_remaining)
    try:
        launch_script(module_name, launch_args, script_args)
    except subprocess.CalledProcessError as error:  # the script printed its own traceback
        return error.returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
