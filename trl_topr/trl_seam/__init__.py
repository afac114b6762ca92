"""
The one place that reaches into TRL's internals: its private names, the module paths of its experimental trainers,
formulas it does not export, and the one swap TRL leaves no other way to make. Each is here with the reason, and
`tests/test_trl_seam.py` checks each against the installed TRL, failing with a message that names what changed.
`trl_seam.asynchronous` holds what concerns TRL's asynchronous trainer, imported only where that trainer is used (TRL
1.16 warns when its experimental package is imported).
"""

import contextlib

from trl import GRPOTrainer, SFTTrainer
from trl.data_utils import _tokenize as tokenize_like_trl  # noqa: F401  (what tokens.py tokenizes prompts with)
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer import grpo_trainer


# `tokenize_like_trl(processing_class, prompt, **chat_template_kwargs)`: TRL's tokenization of a prompt, text as is,
# messages with the chat template (tools, generation prompt), which its SFT and GRPO trainers apply: the one way to get
# the ids training sees. TRL does not export it.


@contextlib.contextmanager
def grpo_builds_vllm_with(generation_class: type):
    """
    Within the block, `GRPOTrainer` builds `generation_class` where it builds TRL's `VLLMGeneration`: it constructs
    its vLLM sampler inline in `__init__`, from the name its module imported, with no argument to pass another.

    Args:
        generation_class (`type`):
            A subclass of TRL's `VLLMGeneration`, with its constructor's signature.
    """
    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = generation_class
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


def trl_model_card(name: str, paper: dict, tags: list[str]):
    """
    A class decorator that declares what TRL's `create_model_card` reads of a trainer class to write its model card:
    the class attributes `_name`, `_paper` and `_tag_names`, private names each of TRL's trainers declares.

    Args:
        name (`str`):
            The trainer's name on the card (e.g. `"TOPR"`).
        paper (`dict`):
            The method's paper: `title`, `id` (its arXiv id) and `citation` (BibTeX).
        tags (`list[str]`):
            The tags of the card (and of a model pushed to the Hub).
    """

    def declare(cls: type) -> type:
        cls._name, cls._paper, cls._tag_names = name, paper, tags
        return cls

    return declare


class GRPOTrainerHooks(GRPOTrainer):
    """
    TRL's `GRPOTrainer` with the private steps the online trainer changes behind public hooks, so that TRL's private
    names stay in this module:

    - `scored_batch(output, rewards_per_func, inputs)`: what GRPO's `_generate_and_score_completions` returns for a
      generation batch, given with every process's rewards per reward function (its `_calculate_rewards`, which passes
      only the normalised advantages on); returns the batch the loss gets.
    - `policy_loss(model, inputs)`: the loss of a micro-batch, in place of GRPO's `_compute_loss`.
    - `per_token_logps_and_entropies(...)`: GRPO's forward (`_get_per_token_logps_and_entropies`), same arguments.
    """

    def scored_batch(self, output: dict, rewards_per_func, inputs) -> dict:
        """The batch the loss gets from a scored generation batch: GRPO's `output`, unchanged here."""
        return output

    def policy_loss(self, model, inputs):
        """The loss of a micro-batch: GRPO's, unless a subclass says otherwise."""
        return super()._compute_loss(model, inputs)

    def per_token_logps_and_entropies(self, *args, **kwargs):
        """GRPO's forward of a batch: the completion tokens' log-probs, their entropies and an auxiliary loss."""
        return self._get_per_token_logps_and_entropies(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        return self.scored_batch(super()._generate_and_score_completions(inputs), self._rewards_per_func, inputs)

    def _compute_loss(self, model, inputs):
        return self.policy_loss(model, inputs)


class SFTTrainerHooks(SFTTrainer):
    """
    TRL's `SFTTrainer` with the private steps the offline trainer changes behind public hooks:

    - `prepare_dataset(dataset, processing_class, args, dataset_name)`: a dataset's preparation (SFT's
      `_prepare_dataset`, for every dataset it is given), whose default is SFT's own, unpacked
      (`sft_prepare_dataset`);
    - `trained_columns()`: the columns a batch keeps (transformers' `_signature_columns`, which otherwise come from the
      model's `forward`);
    - `prepared_inputs(inputs)`: a batch moved to the device as training moves it (transformers' `_prepare_inputs`).
    """

    def prepare_dataset(self, dataset, processing_class, args, dataset_name: str):
        """A dataset prepared for training: SFT's preparation unless a subclass says otherwise."""
        return self.sft_prepare_dataset(dataset, processing_class, args, dataset_name)

    def sft_prepare_dataset(self, dataset, processing_class, args, dataset_name: str):
        """SFT's own preparation of a dataset (tokenization, chat template, `max_length`), unpacked."""
        return super()._prepare_dataset(dataset, processing_class, args, False, None, dataset_name)

    def trained_columns(self) -> list[str] | None:
        """The columns a batch keeps; `None`: transformers' choice (the model's `forward` arguments)."""
        return None

    def prepared_inputs(self, inputs: dict) -> dict:
        """A batch on the training device, as `Trainer` prepares it."""
        return self._prepare_inputs(inputs)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        return self.prepare_dataset(dataset, processing_class, args, dataset_name)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None and self.trained_columns() is not None:
            self._signature_columns = self.trained_columns()
        super()._set_signature_columns_if_needed()


class VLLMGenerationHooks(VLLMGeneration):
    """
    TRL's `VLLMGeneration` with the private parts trl-topr's engine changes behind public names:

    - `start_engine()`: what its constructor calls to connect to a server or start a colocated engine (TRL's
      `_init_vllm`), TRL's own unless a subclass says otherwise (`trl_start_engine`);
    - `weights_sleeping`: whether a colocated engine sleeps with its weights discarded (TRL's `_llm_weights_sleeping`);
    - `named_parameters_to_sync()`: the model's weights as TRL's sync sends them (TRL's `_iter_named_params`).
    """

    def start_engine(self):
        """Connect to the server, or start a colocated engine: TRL's way unless a subclass says otherwise."""
        return self.trl_start_engine()

    def trl_start_engine(self):
        """TRL's own start of the engine."""
        return super()._init_vllm()

    @property
    def weights_sleeping(self) -> bool:
        """Whether the colocated engine sleeps with its weights discarded (a sync or reload brings them back)."""
        return getattr(self, "_llm_weights_sleeping", False)

    @weights_sleeping.setter
    def weights_sleeping(self, value: bool) -> None:
        self._llm_weights_sleeping = value

    def named_parameters_to_sync(self):
        """The model's (name, weight) pairs, as TRL's weight sync sends them to the engine."""
        return self._iter_named_params()

    def _init_vllm(self):
        return self.start_engine()
