"""
Helpers shared by the `trl-topr` scripts: the default model, dataset loading and saving, dotted-path imports, the
prompts arguments of `trl-topr sample` and `trl-topr eval`, and the library's messages.
"""

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_topr.embedded import smollm2_path  # noqa: F401  (the scripts' default model)


FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
REWARD_MODULES = ("trl_topr.rewards",)  # where a bare function name (no dot) is looked up


def _is_saved_to_disk(folder: Path) -> bool:
    return (folder / "dataset_dict.json").exists() or (folder / "state.json").exists()


def load_local_or_hub_dataset(name: str, config: str | None = None, split: str | None = None, streaming: bool = False):
    """
    Load a dataset from the Hub, a local folder or a local data file.

    - A `.jsonl`, `.json`, `.csv` or `.parquet` file is a single split: `split` may only slice it (`"train[:100]"`
      and `"test[:100]"` both take the file's first 100 rows); the split's name is ignored.
    - A folder written by [`~datasets.Dataset.save_to_disk`] (such as the output of `trl-topr sample`) is loaded with
      [`~datasets.load_from_disk`]; a folder of data files, or a Hub id, with [`~datasets.load_dataset`].

    Args:
        name (`str`):
            Hub id (e.g. `"openai/gsm8k"`), local folder or data file.
        config (`str`, *optional*):
            Configuration name of a Hub dataset (the `name` argument of [`~datasets.load_dataset`], e.g. `"main"`).
        split (`str`, *optional*):
            Split to return, with [`~datasets.load_dataset`]'s slicing syntax (`"train[:256]"`). When `None`, every
            split is returned, in a [`~datasets.DatasetDict`].
        streaming (`bool`, *optional*, defaults to `False`):
            Stream a Hub dataset or a folder of data files.

    Returns:
        [`~datasets.Dataset`] or [`~datasets.DatasetDict`]: the split when `split` is given, else all the splits.

    Example:
    ```python
    >>> import tempfile
    >>> from pathlib import Path
    >>> from trl_topr.scripts.utils import load_local_or_hub_dataset

    >>> path = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    >>> _ = path.write_text('{"prompt": "What is 2 + 3?"}\\n{"prompt": "What is 7 * 8?"}\\n')
    >>> load_local_or_hub_dataset(str(path))
    DatasetDict({
        train: Dataset({
            features: ['prompt'],
            num_rows: 2
        })
    })
    >>> load_local_or_hub_dataset(str(path), split="test[:1]").to_list()
    [{'prompt': 'What is 2 + 3?'}]

    ```
    """
    from datasets import Dataset, DatasetDict, ReadInstruction, concatenate_datasets, load_dataset, load_from_disk

    path = Path(name)
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ValueError(f"Unsupported data file {name}: expected one of {', '.join(FILE_BUILDERS)}.")
        if split is not None:
            split = "train" + split[split.index("[") :] if "[" in split else "train"
        return load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path), split=split, streaming=streaming)
    if path.is_dir() and _is_saved_to_disk(path):
        dataset = load_from_disk(str(path))
        if isinstance(dataset, Dataset):
            dataset = DatasetDict(train=dataset)
        if split is None:
            return dataset
        # the split syntax of `load_dataset`, slices included ("train[:100]", "train[10%:]+test")
        parts = ReadInstruction.from_spec(split).to_absolute({key: len(value) for key, value in dataset.items()})
        selected = [dataset[part.splitname].select(range(part.from_, part.to)) for part in parts]
        return selected[0] if len(selected) == 1 else concatenate_datasets(selected)
    return load_dataset(name, name=config, split=split, streaming=streaming)


def check_dataset_path(path: str) -> str:
    """
    Check that [`save_dataset`] can write to `path` (before the work whose result it saves).

    Args:
        path (`str`):
            Output file or folder.

    Returns:
        `str`: its extension.

    Raises:
        `ValueError`: for a CSV file.
    """
    suffix = Path(path).suffix
    if suffix == ".csv":
        raise ValueError("CSV cannot hold lists (behavior_logps, messages): write a .jsonl, .json or .parquet file.")
    return suffix


def save_dataset(dataset, path: str) -> None:
    """
    Save a dataset as a `.jsonl`, `.json` or `.parquet` file, or else as a [`~datasets.Dataset.save_to_disk`] folder.

    Every format can be loaded back by [`load_local_or_hub_dataset`] and so passed to `trl-topr train --dataset_name`.
    CSV is refused: it cannot hold lists, such as the per-token `behavior_logps` or conversational prompts.

    Args:
        dataset ([`~datasets.Dataset`]):
            Dataset to save.
        path (`str`):
            Output file (by its extension) or folder (any other path). Parent folders are created.

    Example:
    ```python
    >>> import tempfile
    >>> from pathlib import Path
    >>> from datasets import Dataset
    >>> from trl_topr.scripts.utils import save_dataset

    >>> path = Path(tempfile.mkdtemp()) / "samples.jsonl"
    >>> save_dataset(Dataset.from_dict({"prompt": ["2 + 3 ="], "completion": [" 5"], "reward": [1.0]}), str(path))
    >>> path.read_text()
    '{"prompt":"2 + 3 =","completion":" 5","reward":1.0}\\n'

    ```
    """
    suffix = check_dataset_path(path)
    if Path(path).parent != Path():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".jsonl":
        dataset.to_json(path, lines=True, force_ascii=False)
    elif suffix == ".json":
        dataset.to_json(path, lines=False, force_ascii=False)
    elif suffix == ".parquet":
        dataset.to_parquet(path)
    else:
        dataset.save_to_disk(path)


def import_function(path: str) -> Callable:
    """
    Import a function from its dotted path, as TRL's GRPO script imports reward functions.

    The current directory is importable, so a function in `./my_rewards.py` is `my_rewards.my_reward`. A bare name
    (without a dot) is looked up in `trl_topr.rewards`.

    Args:
        path (`str`):
            Dotted path `package.module.function`, e.g. `"trl_topr.rewards.gsm8k_reward"`, or a bare name of
            `trl_topr.rewards`, e.g. `"gsm8k_invalid"`.

    Returns:
        `Callable`: the function.

    Example:
    ```python
    >>> from trl_topr.scripts.utils import import_function

    >>> import_function("trl_topr.rewards.extract_final_answer")("So 3 + 4 = 7. The answer is 7.")
    '7'
    >>> import_function("gsm8k_invalid").__module__
    'trl_topr.rewards'

    ```
    """
    candidates = [path.rsplit(".", 1)] if "." in path else [(module, path) for module in REWARD_MODULES]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module_name, attribute in candidates:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            raise ValueError(f"Could not import {path!r}: {error}.") from error
        if hasattr(module, attribute):
            function = getattr(module, attribute)
            if not callable(function):
                raise ValueError(f"{path!r} is not callable.")
            return function
    raise ValueError(
        f"Could not find {path!r}: expected a dotted path `module.function`, or a function of "
        f"{', '.join(REWARD_MODULES)}."
    )


@dataclass
class PromptArguments:
    """
    The prompts of `trl-topr sample` and `trl-topr eval` (their column is [`~trl_topr.TOPRConfig`]'s
    `prompt_column`, the model TRL's `ModelConfig`'s, the sampling [`~trl_topr.TOPRLoopConfig`]'s).

    Args:
        dataset_name (`str`):
            Prompts dataset: Hub id, local folder, or `.jsonl` / `.json` / `.csv` / `.parquet` file (see
            [`load_local_or_hub_dataset`]).
        dataset_config (`str`, *optional*):
            Configuration name of a Hub dataset (e.g. `"main"` for `openai/gsm8k`).
        dataset_split (`str`, *optional*, defaults to `"train"`):
            Split of the prompts, with slicing (`"train[:256]"`). `trl-topr eval` defaults to `"test"`. A single
            data file is one split, which this can only slice.
        conversational (`bool`, *optional*, defaults to `False`):
            Wrap text prompts in a user message, so that they are rendered with the chat template.
    """

    dataset_name: str = field(
        metadata={"help": "Prompts dataset: Hub id, local folder, or .jsonl/.json/.csv/.parquet file."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of a Hub dataset."})
    dataset_split: str = field(
        default="train",
        metadata={"help": "Split of the prompts, with slicing (`train[:256]`). A data file is one split (sliced)."},
    )
    conversational: bool = field(
        default=False, metadata={"help": "Wrap text prompts in a user message (rendered with the chat template)."}
    )


# What `trl-topr sample` and `eval` change in the defaults of the configurations they parse: the model loads in float32
# (TRL's `ModelConfig` says "auto"), and the sampling configuration writes nothing (`output_dir` is unused)
SAMPLING_SCRIPT_DEFAULTS = {"dtype": "float32", "report_to": "none"}


def load_prompts(args: PromptArguments, prompt_column: str = "prompt"):
    """
    Load the prompts of [`PromptArguments`]: the split, its prompt column renamed `prompt` (text prompts wrapped in a
    user message with `conversational`).

    Args:
        args ([`PromptArguments`]):
            The script's arguments.
        prompt_column (`str`, *optional*, defaults to `"prompt"`):
            Column of the prompts (text or messages; [`~trl_topr.TOPRConfig`]'s `prompt_column`). The other columns
            (e.g. `answer`) are passed to the reward functions.

    Returns:
        [`~datasets.Dataset`]: the prompts, in a `prompt` column, with the dataset's other columns.
    """
    dataset = load_local_or_hub_dataset(args.dataset_name, args.dataset_config, split=args.dataset_split)
    if prompt_column not in dataset.column_names:
        raise ValueError(f"No prompt column '{prompt_column}' in {args.dataset_name}: {dataset.column_names}.")
    if prompt_column != "prompt":
        if "prompt" in dataset.column_names:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(prompt_column, "prompt")
    if args.conversational:
        dataset = dataset.map(
            lambda row: {
                "prompt": [{"role": "user", "content": row["prompt"]}]
                if isinstance(row["prompt"], str)
                else row["prompt"]
            }
        )
    return dataset


def model_init_kwargs(
    args, *, trust_remote_code: bool | None = None, device_per_process: bool = False
) -> dict[str, Any]:
    """
    Keyword arguments of `from_pretrained` from a script's model options, as TRL's scripts build them: the one builder
    of the CLI and the recipes.

    Args:
        args ([`~trl.ModelConfig`]):
            The model options: `model_revision`, `attn_implementation`, `dtype` (and `trust_remote_code`, which TRL's
            `ModelConfig` leaves to the training arguments).
        trust_remote_code (`bool`, *optional*):
            Overrides `args.trust_remote_code` (e.g. a [`~trl_topr.TOPRConfig`]'s).
        device_per_process (`bool`, *optional*, defaults to `False`):
            Under several GPU processes, load each process's copy on its own device (`device_map`), for a script
            that uses the model outside a trainer. A trainer places the model itself.

    Returns:
        `dict[str, Any]`: `revision`, `trust_remote_code`, `attn_implementation`, `dtype` and, with
        `device_per_process` under several GPU processes, `device_map`.
    """
    from accelerate import PartialState

    kwargs = {
        "revision": args.model_revision,
        "trust_remote_code": getattr(args, "trust_remote_code", False)
        if trust_remote_code is None
        else trust_remote_code,
        "attn_implementation": args.attn_implementation,
        "dtype": args.dtype,
    }
    state = PartialState()
    if device_per_process and state.num_processes > 1 and state.device.type != "cpu":
        kwargs["device_map"] = {"": state.device}
    return kwargs


def set_model_init_kwargs(training_args, model_args) -> None:
    """
    Load the models of a training script with TRL's `ModelConfig` options (`--dtype`, `--attn_implementation`...),
    under what `training_args.model_init_kwargs` sets explicitly, in place.

    Args:
        training_args ([`~trl_topr.TOPRConfig`]):
            The training arguments (their `trust_remote_code` is used).
        model_args ([`~trl.ModelConfig`]):
            The model options.
    """
    init_kwargs = model_init_kwargs(model_args, trust_remote_code=training_args.trust_remote_code)
    training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}


def resolve_model(model_name_or_path: str | None) -> str:
    """
    The model to load: `model_name_or_path`, or the default SmolLM2-135M-Instruct (converted once, by the main
    process, see [`~trl_topr.embedded.smollm2_path`]).

    Args:
        model_name_or_path (`str`, *optional*):
            Model id or path given by the user.

    Returns:
        `str`: a model id or path.
    """
    if model_name_or_path is not None:
        return model_name_or_path
    from ..distributed import on_main_process

    # converted once, by the main process, which every process then reads (or stops with, where it fails)
    return on_main_process(smollm2_path, step="converting the embedded SmolLM2-135M-Instruct")
