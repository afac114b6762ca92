"""The interface every generation engine implements, and what they share: the split of prompts across processes, the
end-of-sequence cut (the token helpers are `trl_topr.tokens`')."""

import contextlib
import dataclasses
import time

from transformers import PreTrainedTokenizerBase

from ..distributed import map_across_processes
from .settings import SamplingSettings


@dataclasses.dataclass
class Generations:
    """
    What a generation engine returns for a list of prompts, prompt-major (the samples of prompt 0 first).

    Args:
        completion_ids (`list[list[int]]`):
            Each completion's token ids, up to and including the first end-of-sequence token.
        logprobs (`list[list[float]]`, *optional*):
            The engine's own log-prob of each completion token (vLLM's), `None` where the engine has none.
        tokens_per_s (`float`):
            Generated tokens per second of wall time, all processes together.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    tokens_per_s: float


class GenerationEngine:
    """
    A generation engine: completions of tokenized prompts under [`SamplingSettings`], weights taken from a saved
    folder, resources released by `close`. The engines: [`~trl_topr.generation.TransformersEngine`]
    (`model.generate`) and [`~trl_topr.generation.VLLMEngine`] (vLLM, colocated or a server);
    [`generation_engine`] builds the one a [`~trl_topr.TOPRLoopConfig`] asks for, by its name in
    [`~trl_topr.generation.ENGINES`]. A new engine subclasses this class in a module of its own, implements
    `from_config`, `_generate_share`, `load_weights` and, if it holds resources, `close`, and is added to `ENGINES`.

    Under several processes (`accelerate launch`), every process calls `generate` with all the prompts: each generates
    an equal share ([`~trl_topr.distributed.map_across_processes`]) and all get every completion, in prompt order. An
    engine is a context manager that closes on exit.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The tokenizer.
        eos_ids (`set[int]`):
            The token ids that end a completion.
    """

    def __init__(self, processing_class: PreTrainedTokenizerBase, eos_ids: set[int]):
        self.processing_class = processing_class
        self.eos_ids = set(eos_ids)

    @classmethod
    def from_config(
        cls,
        model,
        processing_class: PreTrainedTokenizerBase,
        args=None,
        *,
        bf16: bool | None = None,
        model_init_kwargs: dict | None = None,
        trust_remote_code: bool = False,
    ) -> "GenerationEngine":
        """
        The engine for `model`, set up as its options ask (what [`generation_engine`] calls, unpacking the
        configurations once).

        Args:
            model ([`~transformers.PreTrainedModel`]):
                The model whose weights the engine generates with.
            processing_class ([`~transformers.PreTrainedTokenizerBase`]):
                The tokenizer.
            args ([`~trl_topr.generation.arguments.VLLMArguments`], *optional*):
                The engine's options (e.g. a [`~trl_topr.TOPRLoopConfig`]); `None` for the engine's defaults.
            bf16 (`bool`, *optional*):
                Generate in bf16 (the training precision); `None`: the precision the hardware computes fastest.
            model_init_kwargs (`dict`, *optional*):
                `from_pretrained` options for loading weights from folders.
            trust_remote_code (`bool`, *optional*, defaults to `False`):
                Allow models defined in their own modeling files.

        Returns:
            [`GenerationEngine`]: the engine.
        """
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], settings: SamplingSettings, progress: bool = True) -> Generations:
        """
        Generate `settings.num_samples` completions of each tokenized prompt.

        Args:
            prompts (`list[list[int]]`):
                The prompts' token ids (see [`prompt_ids`]).
            settings ([`SamplingSettings`]):
                How to sample; greedy settings generate once per prompt and repeat the completion.
            progress (`bool`, *optional*, defaults to `True`):
                Show a progress bar (main process).

        Returns:
            [`Generations`]: `num_samples` completions per prompt, prompt-major, cut after their first end token.
        """
        start = time.perf_counter()

        def share_of(share: list, first: int) -> list:
            seed = None if settings.seed is None else settings.seed + first
            ids, logprobs = self._generate_share(share, settings.replace(seed=seed), progress)
            copies = 1 if settings.is_greedy else settings.num_samples
            logprobs = logprobs if logprobs is not None else [None] * len(ids)
            return [
                (ids[i * copies : (i + 1) * copies], logprobs[i * copies : (i + 1) * copies])
                for i in range(len(share))
            ]

        per_prompt = map_across_processes(prompts, share_of)
        repeats = settings.num_samples if settings.is_greedy else 1  # a greedy completion stands for every sample
        completion_ids, logprobs = [], []
        for ids, lps in per_prompt:
            for sample_ids, sample_lps in zip(ids * repeats, lps * repeats, strict=True):
                end = len(self.cut(sample_ids))
                completion_ids.append(list(sample_ids[:end]))
                logprobs.append(None if sample_lps is None else list(sample_lps[:end]))
        tokens = sum(map(len, completion_ids))
        logprobs = None if any(lp is None for lp in logprobs) else logprobs
        return Generations(completion_ids, logprobs, tokens / max(time.perf_counter() - start, 1e-9))

    def cut(self, ids: list[int]) -> list[int]:
        """`ids` up to and including their first end-of-sequence token (what follows is padding), or all of them."""
        end = next((i + 1 for i, t in enumerate(ids) if t in self.eos_ids), len(ids))
        return list(ids[:end])

    def _generate_share(
        self, prompts: list[list[int]], settings: SamplingSettings, progress: bool
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        # This process's share: one completion per prompt when greedy, else `num_samples`, prompt-major, with the
        # engine's log-probs or `None`. `settings.seed` is the share's (its first prompt's).
        raise NotImplementedError

    def load_weights(self, folder: str, model=None, training_engine=None) -> None:
        """
        Generate with the weights saved in `folder` from now on.

        Args:
            folder (`str`):
                Folder of a whole saved model with the engine's architecture (e.g. a loop round's folder).
            model ([`~transformers.PreTrainedModel`], *optional*):
                Those weights, already in memory: an engine that generates with a transformers model uses it rather
                than loading the folder again.
            training_engine (`deepspeed.DeepSpeedEngine`, *optional*):
                The DeepSpeed engine holding `model`, if any (see [`~trl_topr.distributed.full_weights`]).
        """
        raise NotImplementedError

    @contextlib.contextmanager
    def turns(self):
        """
        A block whose `generate` calls continue each other's sequences (a tool loop's turns: each call's sequences are
        earlier ones, generated, with more tokens appended). An engine may keep what spares the next call work (the
        transformers engine keeps the key/values), until the block ends; outside one it keeps nothing.
        """
        yield

    def release_weights(self) -> None:
        """
        Drop the engine's reference to a model given to `load_weights`, until the next `load_weights` (so that the
        caller can free it); an engine that holds its own copy of the weights (vLLM) keeps them.
        """

    def close(self) -> None:
        """Release the engine's resources (memory, processes)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
