import contextlib
import copy
import json
import os
import textwrap
from collections import defaultdict
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, gather_object
from datasets import Dataset, concatenate_datasets, is_caching_enabled
from datasets.fingerprint import Hasher
from transformers import (
    AutoConfig,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import SFTTrainer
from trl.trainer.utils import get_config_model_id

from .baseline import topr_baseline
from .config import TOPRConfig
from .data import (
    BEHAVIOR_LOGPS,
    COMPLETION_IDS,
    PROMPT_IDS,
    REWARD,
    TOOL_MASK,
    DataCollatorForTOPR,
    TOPRDataError,
    check_and_truncate_tokens,
    validate_and_standardize,
)
from .distributed import NamesTheStep, on_main_process, together, weights_fingerprint
from .logprobs import (
    LogpsSettings,
    behavior_logps,
    check_sequences_kept_apart,
    compiles_per_length,
    completion_logps,
    completion_row,
    completion_rows,
    logps_settings,
)
from .loss import combine_metrics, topr_loss
from .precision import FlushesDenormals
from .tokens import end_of_sequence_ids, text_tokenizer
from .trajectories import with_trajectory_ids
from .trl_seam import SFTTrainerHooks, trl_model_card


logger = get_logger(__name__)


@contextlib.contextmanager
def _as_sft_sees_it(args: TOPRConfig):
    # `SFTTrainer.__init__` validates `args.loss_type` against its own nll/dft values, while TOPR's `loss_type` names
    # the TOPR weighting; and with `padding_free` it refuses a `max_length` it would not enforce, while TOPR truncates
    # every row itself (`check_and_truncate_tokens`) and brings its own collator. SFT's machinery (tokenization, PEFT,
    # fused LM head) is built with its plain NLL, padded setting, and TOPR's values are restored right after.
    loss_type, padding_free = args.loss_type, args.padding_free
    args.loss_type, args.padding_free = "nll", False
    try:
        yield
    finally:
        args.loss_type, args.padding_free = loss_type, padding_free


def _generation_config(model: str) -> GenerationConfig | None:
    # The generation config of a model id or folder; `None` for a model without one (its tokenizer's EOS then ends a
    # trajectory's turns)
    try:
        return GenerationConfig.from_pretrained(model)
    except OSError:
        return None


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """
    The latest checkpoint of `output_dir` written to its end: `trainer_state.json` is the last file a checkpoint
    writes, so a folder without one that names its step is left half-written (by a killed run) and skipped.

    Args:
        output_dir (`str`):
            A trainer's output folder.

    Returns:
        `str` or `None`: the checkpoint folder, or `None` where there is none.
    """
    folders = sorted(
        Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"),
        key=lambda p: int(p.name.rsplit("-", 1)[1]) if p.name.rsplit("-", 1)[1].isdigit() else -1,
    )
    for folder in reversed(folders):
        try:
            state = json.loads((folder / "trainer_state.json").read_text())
        except (OSError, ValueError):
            logger.warning(f"Skipping the incomplete checkpoint {folder}.")
            continue
        if f"{PREFIX_CHECKPOINT_DIR}-{state.get('global_step')}" == folder.name:
            return str(folder)
    return None


def base_model_name(config) -> str:
    """
    The name of a model, as the card of a model fine-tuned from it names its base: where its weights were converted
    from (e.g. a GGUF file, see [`~trl_topr.embedded.smollm2_path`]), else the Hub id or local folder it was loaded
    from, else its architecture.

    Args:
        config ([`~transformers.PretrainedConfig`]):
            The model's configuration (`model.config`, also for a PEFT model).

    Returns:
        `str`: the name.
    """
    return (
        getattr(config, "converted_from", None)
        or get_config_model_id(config)
        or f"a {config.model_type} model built from its configuration"
    )


def save_model_card(trainer, output_dir: str) -> None:
    """
    Write a trainer's model card (TRL's `create_model_card`: its tags, name and paper) to `output_dir`, on the main
    process: what the TOPR trainers' `save_model` adds to TRL's, which writes a card only to `args.output_dir`.

    Args:
        trainer ([`~transformers.Trainer`]):
            A TRL trainer.
        output_dir (`str`):
            The folder the model was saved to.
    """
    if not trainer.is_world_process_zero():
        return
    args = trainer.args
    model_name = args.hub_model_id.split("/")[-1] if args.hub_model_id else Path(output_dir).name
    card_dir, args.output_dir = args.output_dir, output_dir  # `create_model_card` writes to `args.output_dir`
    try:
        trainer.create_model_card(model_name=model_name)
    finally:
        args.output_dir = card_dir


def completions_in_step(accelerator, args, batch_samples: list[dict], device: torch.device) -> torch.Tensor:
    """
    The completions of an optimizer step's micro-batches (their `rewards`, one per completion, padding-free rows
    included), summed over the processes with `args.average_tokens_across_devices`: what TOPR's sequence means are
    over.

    Args:
        accelerator (`~accelerate.Accelerator`):
            The trainer's accelerator.
        args ([`TOPRArguments`]):
            The configuration (`average_tokens_across_devices`, `world_size`).
        batch_samples (`list[dict]`):
            The step's micro-batches on this process.
        device (`torch.device`):
            Where the count goes.

    Returns:
        `torch.Tensor`: the count, a float scalar.
    """
    count = torch.tensor(float(sum(batch["rewards"].numel() for batch in batch_samples)), device=device)
    if args.average_tokens_across_devices and args.world_size > 1:
        count = accelerator.gather(count).sum()
    return count


def record_metrics(accelerator, store: dict[str, list[float]], metrics: dict[str, torch.Tensor]) -> None:
    """
    Append every process's values of a micro-batch's metrics (as returned by [`topr_loss`]) to `store`, for
    [`~trl_topr.loss.combine_metrics`] to combine at logging time.

    Args:
        accelerator ([`~accelerate.Accelerator`]):
            The trainer's accelerator, whose processes all call this.
        store (`dict[str, list[float]]`):
            Lists of values per metric name, appended to.
        metrics (`dict[str, torch.Tensor]`):
            Scalar metrics of this process's micro-batch.
    """
    # One gather for all the metrics. (Not `gather_for_metrics`, which trims what it takes for duplicated samples at
    # the end of an epoch.)
    names = list(metrics)
    gathered = accelerator.gather(torch.stack([metrics[n].float() for n in names])[None])
    for name, column in zip(names, gathered.view(-1, len(names)).T.cpu(), strict=True):
        store[name].extend(column.tolist())


def with_logged_metrics(logs: dict[str, float], store: dict[str, dict[str, list[float]]], training: bool) -> dict:
    """
    `logs` with TOPR's metrics of the logging interval added, combined exactly ([`~trl_topr.loss.combine_metrics`]:
    weighted by their counts, however the batches were split across processes and steps), `eval_`-prefixed in
    evaluation; the interval's store is emptied. What both trainers' `log` do.

    Args:
        logs (`dict[str, float]`):
            The trainer's logs, updated in place.
        store (`dict[str, dict[str, list[float]]]`):
            The values recorded by [`record_metrics`], by mode (`"train"`, `"eval"`).
        training (`bool`):
            Whether the model is training (else evaluating).

    Returns:
        `dict[str, float]`: `logs`.
    """
    mode = "train" if training else "eval"
    prefix = "eval_" if mode == "eval" else ""
    logs.update({prefix + name: value for name, value in combine_metrics(store[mode]).items()})
    store[mode].clear()
    return logs


class CardOnSave:
    """What every TOPR trainer adds to its TRL trainer (first among the bases, ahead of it): TOPR's model card (TRL's
    card with the trainer's tags, name and the TOPR citation, naming a base model TRL cannot link), written wherever
    the model is saved."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """
        Save the model (or the PEFT adapter) and its tokenizer to `output_dir`, with a model card naming TOPR.

        Args:
            output_dir (`str`, *optional*):
                Folder to save to. Defaults to `args.output_dir`.
        """
        super().save_model(output_dir, _internal_call)
        if not _internal_call:  # checkpoints and `push_to_hub` write their own card
            save_model_card(self, output_dir or self.args.output_dir)

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ):
        """
        Write the model card to `args.output_dir`: TRL's card (tags `trl` and `topr`, the TOPR citation), naming the
        base model where TRL's card can only link a Hub id: a local folder, or a GGUF file converted by trl-topr.

        Args:
            model_name (`str`, *optional*):
                Name of the model.
            dataset_name (`str`, *optional*):
                Name of the dataset used for training.
            tags (`str` or `list[str]`, *optional*):
                Tags of the card, besides `trl` and `topr`.
        """
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        path = Path(self.args.output_dir) / "README.md"
        text = path.read_text()
        # TRL renders a base model it cannot link (not a Hub id) as "None", and a model not pushed as `model="None"`.
        base = base_model_name(self.accelerator.unwrap_model(self.model).config)
        text = text.replace("[None](https://huggingface.co/None)", f"`{base}`")
        text = text.replace('model="None"', f'model="{self.hub_model_id or self.args.output_dir}"')
        path.write_text(text)


# The paper every TOPR trainer's model card cites
TOPR_PAPER = {
    "title": "Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for LLMs",
    "id": "2503.14286",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{leroux2025topr,
            title        = {{Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for LLMs}},
            author       = {Nicolas Le Roux and Marc G. Bellemare and Jonathan Lebensold and Arnaud Bergeron and
                            Joshua Greaves and Alex Fr{\\'e}chette and Carolyne Pelletier and
                            Eric Thibodeau-Laufer and S{\\'a}ndor Toth and Sam Work},
            year         = 2025,
            eprint       = {arXiv:2503.14286},
        }"""),
}


@trl_model_card("TOPR", TOPR_PAPER, ["trl", "topr"])
class TOPRTrainer(NamesTheStep, FlushesDenormals, CardOnSave, SFTTrainerHooks):
    r"""
    Trainer for Tapered Off-Policy REINFORCE (TOPR), from [Tapered Off-Policy REINFORCE: Stable and efficient
    reinforcement learning for LLMs](https://huggingface.co/papers/2503.14286).

    Learns from completions with rewards, good and bad, sampled by any behavior policy mu: positives (`R - c >= 0`) get
    an SFT-like weight of 1, negatives the truncated importance ratio clip(pi/mu, 0, 1) of the whole sequence. No
    reference model, KL term or critic. Built on [`~trl.SFTTrainer`], whose tokenization, PEFT / quantization handling
    and fused LM-head log-probabilities it reuses; only the loss and the data contract are TOPR's.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from trl_topr import TOPRConfig, TOPRTrainer

    >>> dataset = Dataset.from_dict(
    ...     {
    ...         "prompt": ["2 + 2 =", "2 + 2 ="],
    ...         "completion": [" 4", " 5"],
    ...         "reward": [1.0, -1.0],
    ...     }
    ... )
    >>> trainer = TOPRTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", train_dataset=dataset)  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP

    ```

    Args:
        model (`str` or [`~transformers.PreTrainedModel`] or [`~peft.PeftModel`]):
            Model to train: a model id or path (loaded the TRL way with `args.model_init_kwargs` and, if given,
            `quantization_config`), a causal LM, or a PEFT model.
        args ([`TOPRConfig`], *optional*):
            Configuration. If `None`, a default [`TOPRConfig`] is used.
        train_dataset ([`~datasets.Dataset`]):
            Dataset with `prompt`, `completion`, `reward` (or a boolean `label`) and optionally `behavior_logps`
            columns, standard or conversational; see [`TOPRConfig`] for the column names. When `behavior_logps` is
            absent it is computed once, before training, with the initial policy.
        eval_dataset ([`~datasets.Dataset`] or `dict[str, Dataset]`, *optional*):
            Evaluation dataset(s), with the same columns. The evaluation loss is the TOPR loss.
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer. If `None`, it is loaded from the model's name.
        peft_config ([`~peft.PeftConfig`], *optional*):
            PEFT configuration used to wrap the model (e.g. [`~peft.LoraConfig`]).
        quantization_config ([`~transformers.BitsAndBytesConfig`], *optional*):
            Quantization used when loading the model from an id or path; with `peft_config`, QLoRA.
        callbacks (list of [`~transformers.TrainerCallback`], *optional*):
            Callbacks added to the default ones.
        optimizers (`tuple`, *optional*, defaults to `(None, None)`):
            Optimizer and scheduler (`torch.optim.Optimizer`, `torch.optim.lr_scheduler.LambdaLR`, each optional); by
            default AdamW and the scheduler set by `args`.
    """

    # `compute_loss` scales its loss for gradient accumulation itself.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model: "str | PreTrainedModel",
        args: TOPRConfig | TrainingArguments | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        peft_config=None,
        quantization_config=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
    ):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = TOPRConfig(f"{model_name.split('/')[-1]}-TOPR")
        elif not isinstance(args, TOPRConfig):
            dict_args = args.to_dict()
            dict_args["hub_token"] = args.hub_token  # to_dict hides the hub_token
            dict_args.pop("loss_type", None)  # an SFTConfig's nll/dft loss type has no TOPR meaning
            args = TOPRConfig(**dict_args)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required.")

        # The data contract is checked before any model is loaded, trained or saved.
        train_dataset = validate_and_standardize(train_dataset, args, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {name: validate_and_standardize(ds, args, name) for name, ds in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = validate_and_standardize(eval_dataset, args, "eval")

        # TOPR's baseline c, over the whole training set, identically on every process
        self.baseline = topr_baseline(
            train_dataset[REWARD], baseline=args.baseline, target_positive_fraction=args.target_positive_fraction
        )

        # The model's vocabulary, to check given token ids against, and the generation config whose stop ids end a
        # trajectory's turns (datasets are prepared before the model is set).
        if isinstance(model, str):
            self._vocab_size = AutoConfig.from_pretrained(model).get_text_config().vocab_size
            self._generation_config = on_main_process(  # read once: the processes must cut trajectories alike
                lambda: _generation_config(model), step="reading the model's generation config"
            )
        else:
            self._vocab_size = model.get_input_embeddings().num_embeddings
            self._generation_config = getattr(model, "generation_config", None)

        with _as_sft_sees_it(args):
            super().__init__(
                model=model,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
                quantization_config=quantization_config,
            )
        pad_token_id = text_tokenizer(self.processing_class).pad_token_id  # as SFT's own collator pads
        self.data_collator = DataCollatorForTOPR(
            pad_token_id=pad_token_id,
            padding_free=self.args.padding_free,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
            length_buckets=compiles_per_length(self.model),
        )
        self._topr_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}  # not SFT's `_metrics`
        if self.args.padding_free:  # before any forward of flattened rows: the precompute's, training's
            check_sequences_kept_apart(self.model, pad_token_id)

        # mu defaults to the initial policy: computed now, before any update and before a checkpoint is loaded.
        self.train_dataset = self.precompute_behavior_logps(self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {
                name: self.precompute_behavior_logps(ds, name) for name, ds in self.eval_dataset.items()
            }
        elif self.eval_dataset is not None:
            self.eval_dataset = self.precompute_behavior_logps(self.eval_dataset, "eval")

    def prepare_dataset(self, dataset, processing_class, args, dataset_name: str):
        """
        A dataset prepared for training: multi-turn trajectories cut into the policy's token ids, a sampler's own ids
        trained exactly, the rest tokenized by SFT's preparation, untruncated, then checked and truncated to
        `max_length` (every row checked at its index) and shuffled with `args.seed`.
        """
        if "input_ids" in dataset.column_names:  # already prepared
            return dataset
        # multi-turn messages: cut into the policy's token ids and the rest, as a sampler records them
        stop_ids = end_of_sequence_ids(self._generation_config, processing_class)  # where the sampler stops a turn
        dataset = with_trajectory_ids(dataset, processing_class, dataset_name, stop_ids)
        if PROMPT_IDS in dataset.column_names:  # the sampler's own ids: trained exactly, TRL sees tokenized data
            dataset = self._tokens_from_ids(dataset, dataset_name)
        # Tokenize with TRL's SFT preparation, untruncated, so that the checks below see every row at its index.
        untruncated = copy.copy(args)
        untruncated.max_length, untruncated.shuffle_dataset = None, False
        dataset = self.sft_prepare_dataset(dataset, processing_class, untruncated, dataset_name)
        dataset = check_and_truncate_tokens(dataset, args.max_length, dataset_name)
        return dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset

    def _tokens_from_ids(self, dataset: Dataset, dataset_name: str) -> Dataset:
        # input_ids = prompt + completion ids, labels on the completion only; nothing added, nothing re-tokenized.
        vocab_size = self._vocab_size
        for column in (PROMPT_IDS, COMPLETION_IDS):
            for row, ids in enumerate(dataset[column]):
                if ids and max(ids) >= vocab_size:
                    raise TOPRDataError(
                        f"{dataset_name} dataset, column '{column}', row {row}: token id {max(ids)} is outside the "
                        f"model's vocabulary ({vocab_size} tokens): the ids come from another tokenizer."
                    )

        def concatenate(example):
            return completion_row(example[PROMPT_IDS], example[COMPLETION_IDS], example.get(TOOL_MASK))

        return dataset.map(concatenate, desc=f"Taking the sampled token ids of the {dataset_name} dataset")

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """
        Train, as [`~transformers.Trainer.train`]. With `resume_from_checkpoint=True`, resume from the latest
        *complete* checkpoint of `args.output_dir`: a checkpoint folder left half-written by a killed run is skipped.

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*):
                A checkpoint folder, or `True` for the latest complete one in `args.output_dir`.
            **kwargs (`Any`):
                Other arguments of [`~transformers.Trainer.train`].

        Returns:
            [`~transformers.trainer_utils.TrainOutput`]: the training step count, loss and metrics.
        """
        if resume_from_checkpoint is True:  # chosen by the main process: every process resumes from the same step
            resume_from_checkpoint = on_main_process(self._latest_complete_checkpoint, step="choosing the checkpoint")
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _latest_complete_checkpoint(self) -> str:
        folder = latest_complete_checkpoint(self.args.output_dir)
        if folder is None:
            raise ValueError(f"No complete checkpoint to resume from in {self.args.output_dir}.")
        return folder

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """
        Evaluate the TOPR loss and metrics on `eval_dataset` (by default the one given at construction).

        A dataset passed here goes through the same checks and preparation as at construction; if it has no
        `behavior_logps`, they are computed with the model as it is now, so its ratios start at 1.

        Args:
            eval_dataset ([`~datasets.Dataset`] or `dict[str, Dataset]`, *optional*):
                Dataset(s) with the columns of the training set.
            ignore_keys (`list[str]`, *optional*):
                Ignored (the trainer produces no model outputs to filter).
            metric_key_prefix (`str`, *optional*, defaults to `"eval"`):
                Prefix of the returned metric names.

        Returns:
            `dict[str, float]`: the evaluation loss and metrics.
        """
        datasets = eval_dataset if isinstance(eval_dataset, dict) else {metric_key_prefix: eval_dataset}
        for name, dataset in datasets.items():
            if isinstance(dataset, Dataset) and "input_ids" not in dataset.column_names:  # not prepared yet
                dataset = validate_and_standardize(dataset, self.args, name)
                dataset = self.prepare_dataset(dataset, self.processing_class, self.args, name)
                datasets[name] = self.precompute_behavior_logps(dataset, name)
        if eval_dataset is not None and not isinstance(eval_dataset, (dict, str)):
            eval_dataset = datasets[metric_key_prefix]
        return super().evaluate(
            eval_dataset=eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )

    def trained_columns(self) -> list[str]:
        """The columns a batch keeps: the tokens, the labels, the reward and the behavior log-probs."""
        return ["input_ids", "labels", REWARD, BEHAVIOR_LOGPS]

    def logps_settings(self, batch_size: int | None = None) -> LogpsSettings:
        """
        How this trainer computes log pi, for [`~trl_topr.logprobs.behavior_logps`] to compute the same outside
        the loss: its padding id, precision (`accelerator.autocast()`), layout, training engine and activation
        checkpointing arguments (see [`~trl_topr.logprobs.logps_settings`]), for one call.

        Args:
            batch_size (`int`, *optional*):
                Rows per forward; defaults to `precompute_behavior_batch_size`, else `per_device_eval_batch_size`.

        Returns:
            [`~trl_topr.logprobs.LogpsSettings`]: the settings.
        """
        # the mixed precision training runs in, also before the model is wrapped by `accelerator.prepare`
        return logps_settings(
            self.args,
            self.processing_class,
            self.model.device,
            batch_size=batch_size,
            autocast=self.accelerator.autocast(),
            training_engine=getattr(self, "deepspeed", None),
        )

    @torch.no_grad()
    def precompute_behavior_logps(self, dataset: Dataset, name: str) -> Dataset:
        """
        The dataset with its `behavior_logps` column: as given, or computed with the model as it is now (on-policy
        data, mu = the model before training), one value per completion token; what the trainer does at construction
        to a dataset without the column.

        Args:
            dataset ([`~datasets.Dataset`]):
                Tokenized rows (`input_ids`, `labels`, ...), as the trainer holds them.
            name (`str`):
                The dataset's name, in the progress bar and errors (`"train"`, `"eval"`, ...).

        Returns:
            [`~datasets.Dataset`]: the dataset, with `behavior_logps`.
        """
        if BEHAVIOR_LOGPS in dataset.column_names:
            return dataset
        # Like TRL's reference log-prob precompute: cached next to a dataset read from files, keyed by the data and by
        # the model's whole weights *now* (they change with training), hashed the same way under every engine.
        cache_file = None
        if is_caching_enabled() and dataset.cache_files:
            key = (dataset._fingerprint, weights_fingerprint(self.model), "topr_behavior_logps")
            fingerprint = [Hasher.hash(key)]
            broadcast_object_list(fingerprint, from_process=0)
            cache_file = os.path.join(
                os.path.dirname(dataset.cache_files[0]["filename"]), f"cache-{fingerprint[0]}.arrow"
            )
            # read from the cache where every process finds it (a cache folder of each machine's own may hold it on
            # one and not another): each process then runs the same collectives
            if all(gather_object([os.path.exists(cache_file)])):
                logger.warning(f"Using cached behavior log-probs of the current weights for the {name} dataset.")
                return concatenate_datasets([dataset, Dataset.from_file(cache_file)], axis=1)

        logger.warning(
            f"The {name} dataset has no '{self.args.behavior_logps_column}' column: computing the behavior "
            "log-probs with the model as it is now (during construction, the initial policy: mu = the model as "
            "passed, before any update). Give them in the dataset when the completions were sampled by another model."
        )
        rows = dataset.select_columns(["input_ids", "labels"]).to_list()
        values = behavior_logps(self.model, rows, self.logps_settings())
        if cache_file is not None:  # every process holds the values; the main process writes them for later runs
            with together(f"writing the {name} dataset's behavior log-probs to the cache"):
                if self.accelerator.is_main_process:
                    Dataset.from_dict({BEHAVIOR_LOGPS: values}).map(
                        cache_file_name=cache_file, new_fingerprint=fingerprint[0]
                    )
        return dataset.add_column(BEHAVIOR_LOGPS, values)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """
        `Trainer`'s micro-batches of one optimizer step and what its loss is a mean over: their completion tokens
        (`loss_normalization="token_mean"`, `Trainer`'s own count) or their completions (the other normalizations),
        of every process with `average_tokens_across_devices`, so that no completion's weight depends on how the step
        is split into micro-batches and processes.
        """
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.args.loss_normalization != "token_mean":
            num_items_in_batch = completions_in_step(self.accelerator, self.args, batch_samples, device)
        return batch_samples, num_items_in_batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        per_token_logps, completion_mask, outputs = completion_logps(model, inputs)
        behavior_logps = inputs["behavior_logps"]
        if behavior_logps.dim() == 2:  # per-token values sit at their tokens' positions; log-probs are shifted by one
            behavior_logps, _ = completion_rows(behavior_logps[:, 1:], inputs)
        # In training, the mean is over the whole optimizer step's completions or tokens (`get_batch_samples`): the
        # update does not depend on how the step is split into micro-batches and processes, as in TRL's SFT.
        over_step = mode == "train" and num_items_in_batch is not None
        loss, metrics = topr_loss(
            per_token_logps,
            completion_mask,
            inputs["rewards"],
            behavior_logps,
            baseline=self.baseline,
            num_items_in_batch=num_items_in_batch if over_step else None,
            **self.args.loss_options(),
        )
        if mode == "train":  # `loss_is_scaled_for_ga`: the scaling for accumulation and processes is done here
            if over_step:
                if self.args.average_tokens_across_devices:  # the count spans every process, and DDP averages
                    loss = loss * self.accelerator.num_processes
            else:  # a direct call outside `Trainer.train`: a mean over this micro-batch, one of the configured ones
                loss = loss / self.args.gradient_accumulation_steps
        entropy, _ = completion_rows(outputs.entropy[:, 1 - inputs["input_ids"].size(1) :].detach(), inputs)
        metrics["entropy"] = torch.where(completion_mask, entropy, 0.0).sum() / completion_mask.sum().clamp(min=1)
        record_metrics(self.accelerator, self._topr_metrics[mode], metrics)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # The fused LM head builds no logits: evaluation reports the TOPR loss and the metrics.
        inputs = self.prepared_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TOPR's metrics in place of SFTTrainer's own; beside the baseline, the target it was derived from, so that
        # the trainer's state records what trained
        logs = with_logged_metrics(logs, self._topr_metrics, self.model.training)
        if "baseline" in logs and self.args.target_positive_fraction is not None:
            logs["target_positive_fraction"] = self.args.target_positive_fraction
        super(SFTTrainer, self).log(logs, start_time)
