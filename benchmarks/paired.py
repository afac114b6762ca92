"""Paired comparisons of two arms of the iterative benchmark: the arms share each seed's starting point and the test
prompts, so their difference is taken seed by seed and prompt by prompt, and its 95% interval comes from a bootstrap
over the seeds and the test prompts together; beside it, a seed-level interval (Student's t over each seed's
difference, the prompts fixed), which few seeds leave wide. A reading says "above" or "below" only where both intervals
exclude 0, and "tied" where either does not.

Each reading is one test at 95%: among pairs that do not differ, about one reading in twenty says "above" or "below"
by chance, and the benchmarks read many pairs with no correction for that multiplicity."""

import functools
import math
import statistics
from dataclasses import dataclass


BOOTSTRAP_DRAWS = 10_000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Difference:
    """The difference of two arms on one measure (the first minus the second), paired by seed and test prompt.

    Args:
        estimate (`float`):
            The mean over seeds and prompts of the paired differences.
        low (`float`), high (`float`):
            The 95% percentile interval of the bootstrap over seeds and prompts.
        by_seed (`list[float]`):
            Each seed's difference (the mean over the prompts).
    """

    estimate: float
    low: float
    high: float
    by_seed: list[float]

    def seed_interval(self) -> tuple[float, float]:
        """The 95% t interval of the mean over the seeds of each seed's difference (the prompts fixed): the
        seed-level reading, which a few seeds leave wide, bounded to [-1, +1], the range a difference of two rates
        can take; (nan, nan) with fewer than two seeds."""
        low, high = seed_interval(self.by_seed)
        return (max(low, -1.0), min(high, 1.0)) if low == low else (low, high)  # nan stays nan

    @property
    def reading(self) -> str:
        """ "above" or "below" where both the bootstrap interval and the seed-level one exclude 0, else "tied"."""
        low, high = self.seed_interval()
        if self.low > 0 and low > 0:
            return "above"
        return "below" if self.high < 0 and high < 0 else "tied"

    @property
    def bootstrap_reading(self) -> str:
        """The bootstrap interval's reading alone: "above" or "below" where it excludes 0, else "tied"."""
        return "above" if self.low > 0 else "below" if self.high < 0 else "tied"

    def text(self) -> str:
        """ "+0.012 [+0.004, +0.021] (seeds [+0.001, +0.023])": the estimate, the bootstrap interval and the
        seed-level one."""
        low, high = self.seed_interval()
        return f"{self.estimate:+.3f} [{self.low:+.3f}, {self.high:+.3f}] (seeds [{low:+.3f}, {high:+.3f}])"


@functools.cache
def t_quantile(q: float, df: int) -> float:
    """The `q` quantile (q >= 0.5) of Student's t distribution with `df` degrees of freedom: bisection on its CDF, the
    density integrated by Simpson's rule (no statistics library needed); computed once per `q` and `df`."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, steps: int = 2000) -> float:  # for x >= 0
        h = x / steps
        inner = sum((4 if i % 2 else 2) * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(1, steps))
        return 0.5 + scale * h / 3 * (1 + (1 + x * x / df) ** (-(df + 1) / 2) + inner)

    low, high = 0.0, 1000.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < q else (low, middle)
    return (low + high) / 2


def seed_interval(values: list[float]) -> tuple[float, float]:
    """The 95% t interval of the mean of `values` (one per seed); (nan, nan) for fewer than two."""
    if len(values) < 2:
        return math.nan, math.nan
    half = t_quantile(0.5 + CONFIDENCE / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    mean = statistics.fmean(values)
    return mean - half, mean + half


def pass_at(samples: int, correct: int, at: int) -> float:
    """
    The unbiased estimate of pass@`at` from `samples` samples of a prompt, `correct` of them right: the chance that
    `at` of them drawn without replacement hold a right one, 1 - C(samples - correct, at) / C(samples, at) (Chen et
    al., 2021). At 1, the share right.
    """
    if at > samples:
        raise ValueError(f"pass@{at} needs at least {at} samples a prompt; the round drew {samples}")
    if at == 1:
        return correct / samples
    return 1.0 - math.comb(samples - correct, at) / math.comb(samples, at)


def prompt_scores(run: list[dict], rounds: list[int], k: int, at: int = 1) -> list[float]:
    """Each test prompt's sampled pass@`at` (`pass_at`, from the round's samples a prompt: `test/samples` where the
    round records it, else `k`), averaged over `rounds` of a run (one round: that round's)."""
    missing = [r for r in rounds if run[r].get("test/correct") is None]
    if missing:
        raise ValueError(f"rounds {missing} of the run have no per-prompt test outcomes (`test/correct`)")
    per_round = [[pass_at(run[r].get("test/samples", k), c, at) for c in run[r]["test/correct"]] for r in rounds]
    return [sum(scores) / len(rounds) for scores in zip(*per_round, strict=True)]


def paired_difference(
    first: list[list[dict]],
    second: list[list[dict]],
    rounds: list[int],
    k: int,
    draws: int = BOOTSTRAP_DRAWS,
    at: int = 1,
) -> Difference:
    """
    The difference of two arms' test sampled pass@1 (pass@`at`), averaged over `rounds` (the area over the tested
    rounds, or one round), paired by seed (the i-th run of each arm) and by test prompt, with a 95% bootstrap
    interval: each draw takes as many seeds and as many prompts as there are, with replacement, and averages the
    paired differences over them. The draws are seeded: the same runs give the same interval.
    """
    if len(first) != len(second) or not first:
        raise ValueError(f"paired runs needed: {len(first)} and {len(second)} seeds")
    table = [
        [a - b for a, b in zip(prompt_scores(x, rounds, k, at), prompt_scores(y, rounds, k, at), strict=True)]
        for x, y in zip(first, second, strict=True)
    ]
    return bootstrap(table, draws)


def arm_interval(runs: list[list[dict]], rounds: list[int], k: int, draws: int = BOOTSTRAP_DRAWS) -> Difference:
    """One arm's test sampled pass@1 averaged over `rounds`, with the same 95% bootstrap interval over its seeds and
    the test prompts (a `Difference` from 0: `by_seed` holds each seed's value)."""
    return bootstrap([prompt_scores(run, rounds, k) for run in runs], draws)


def bootstrap(table: list[list[float]], draws: int = BOOTSTRAP_DRAWS) -> Difference:
    """The mean of a seeds x prompts table with its 95% percentile interval: each of `draws` seeded draws takes as many
    seeds and as many prompts as there are, with replacement, and averages the table over them."""
    import numpy as np

    values = np.array(table, dtype=float)
    seeds, prompts = values.shape
    rng = np.random.default_rng(0)
    seed_counts = rng.multinomial(seeds, [1 / seeds] * seeds, size=draws)  # draws x seeds
    prompt_counts = rng.multinomial(prompts, [1 / prompts] * prompts, size=draws)  # draws x prompts
    drawn = ((seed_counts @ values) * prompt_counts).sum(axis=1) / (seeds * prompts)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(drawn, [tail, 1 - tail])
    return Difference(
        estimate=float(values.mean()),
        low=float(low),
        high=float(high),
        by_seed=[float(v) for v in values.mean(axis=1)],
    )
