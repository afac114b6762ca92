"""The sampling settings of one generation call, typed, in one object."""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """
    How to sample completions: what every generation engine receives, and what [`~trl_topr.run_topr_loop`] takes for
    its sampling and its evaluation.

    Args:
        num_samples (`int`, *optional*, defaults to `1`):
            Completions per prompt.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; 0 decodes greedily (one completion per prompt, repeated `num_samples` times).
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling threshold (1 disables it).
        top_k (`int`, *optional*, defaults to `0`):
            Top-k sampling, 0 to disable (transformers' own default is 50).
        max_new_tokens (`int`, *optional*, defaults to `256`):
            Maximum completion length.
        batch_size (`int`, *optional*, defaults to `16`):
            Prompts per `generate` call of transformers (each yields `num_samples` sequences); vLLM schedules its own
            batches. Also the batch size of the behavior log-prob computation.
        seed (`int`, *optional*):
            Seed of the sampling: prompt i of a call is sampled with `seed + i` (vLLM) or the process's share from
            `seed` + its first prompt's index (transformers), whatever the number of processes. `None` leaves the
            random state as it is.

    Example:
    ```python
    >>> from trl_topr.generation import SamplingSettings

    >>> settings = SamplingSettings(num_samples=16, top_k=500, max_new_tokens=512, seed=0)
    >>> settings.vllm_kwargs()
    {'n': 16, 'temperature': 1.0, 'top_p': 1.0, 'top_k': 500, 'max_tokens': 512, 'seed': 0}
    >>> settings.greedy().vllm_kwargs()["n"]
    1

    ```
    """

    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    batch_size: int = 16
    seed: int | None = None

    def __post_init__(self):
        checks = {
            "num_samples": self.num_samples >= 1,
            "temperature": self.temperature >= 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "max_new_tokens": self.max_new_tokens >= 1,
            "batch_size": self.batch_size >= 1,
        }
        wrong = [name for name, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(
                f"SamplingSettings: invalid {', '.join(f'{n}={getattr(self, n)!r}' for n in wrong)} "
                "(num_samples, max_new_tokens and batch_size >= 1; temperature >= 0; 0 < top_p <= 1; "
                "top_k >= 0, 0 disabling it)."
            )

    @property
    def is_greedy(self) -> bool:
        """Whether these settings decode greedily (`temperature=0`)."""
        return self.temperature == 0

    def greedy(self) -> "SamplingSettings":
        """The same settings, decoding greedily: one completion per prompt, no seed."""
        return dataclasses.replace(self, num_samples=1, temperature=0.0, seed=None)

    def replace(self, **changes: Any) -> "SamplingSettings":
        """A copy with `changes` (e.g. `seed=...`)."""
        return dataclasses.replace(self, **changes)

    def vllm_kwargs(self, seed: int | None = None) -> dict[str, Any]:
        """
        The arguments of `vllm.SamplingParams` for these settings (top-k 0 becomes vLLM's -1), with `seed` in place
        of `self.seed` when given.
        """
        greedy = self.is_greedy
        return {
            "n": 1 if greedy else self.num_samples,
            "temperature": self.temperature,
            "top_p": 1.0 if greedy else self.top_p,
            "top_k": -1 if greedy or self.top_k == 0 else self.top_k,
            "max_tokens": self.max_new_tokens,
            "seed": self.seed if seed is None else seed,
        }
