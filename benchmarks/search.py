"""The iterative benchmark's learning-rate search: which rates an arm scores (`sweep`, `climb`), which wins
(`best_rate`), and what the protocol may still train (`plan`)."""

import math
import statistics

from arms import ARMS


LADDER = (1, 3)  # a decade's leading digits of the rates searched: 1e-5, 3e-5, 1e-4, ...
PAST_EDGE = 2  # the most rates a sweep follows its best past the grid's edge


def climb(rates: list[float], score, done, past_edge: int = PAST_EDGE) -> dict | None:
    """A learning-rate sweep: `score(rate)` of each rate in ascending order, stopping at the first rate that scores
    below a smaller one (past the peak, larger rates are not trained; those already `done` are still read). A best
    rate at an edge of the rates scored is not known to be the best: then the next rate past that edge is scored, up
    to `past_edge` rates beyond the grid. Returns {rate: score}, or None when `score` returns None (no time left to
    run that rate)."""
    scores, past_peak = {}, False
    for rate in sorted(rates):
        if past_peak and not done(rate):
            continue
        value = score(rate)
        if value is None:
            return None
        scores[rate] = value
        past_peak = past_peak or value < max(scores.values())
    for _ in range(past_edge if len(rates) > 1 else 0):
        best = best_rate(scores)
        if best not in (min(scores), max(scores)):
            break
        extra = beyond(best, up=best == max(scores))
        value = score(extra)
        if value is None:
            return None
        scores[extra] = value
    return scores


def bracket(start: float, score, most: int = 6, ladder: tuple[int, ...] = LADDER) -> dict | None:
    """A learning-rate search that ends with its best rate interior: `score(start)`, then the next rate down the
    ladder (1-3-10 by default; 1-2-5-10, steps of about 2, with `ladder=(1, 2, 5)`), and on past whichever edge of the
    rates scored holds the best (down first) until the best has a rate scored on each side of it, which by definition
    scores lower (ties go to the smaller rate). At most `most` rates. Returns {rate: score}, or None when `score`
    returns None (no time left to run that rate)."""
    scores = {}
    rate = start
    while len(scores) < most:
        value = score(rate)
        if value is None:
            return None
        scores[rate] = value
        best = best_rate(scores)
        if min(scores) < best < max(scores):
            break
        down = best == min(scores)  # the best at the lower edge: further down, else further up
        rate = beyond(min(scores) if down else max(scores), up=not down, ladder=ladder)
    return scores


def interior(scores: dict) -> bool:
    """Whether the best of the rates scored has a rate scored on each side of it."""
    return min(scores) < best_rate(scores) < max(scores)


def best_rate(scores: dict) -> float:
    return max(scores, key=lambda rate: (scores[rate], -rate))  # ties: the smaller rate


def beyond(rate: float, up: bool, ladder: tuple[int, ...] = LADDER) -> float:
    """The next rate past `rate` on a ladder of leading digits, each decade alike: 1-3-10 by default (..., 1e-5, 3e-5,
    1e-4, ...), 1-2-5-10 with `ladder=(1, 2, 5)` (..., 1e-4, 2e-4, 5e-4, 1e-3, ...)."""
    exponent = math.floor(math.log10(rate) + 1e-9)
    rungs = [digit * 10.0**power for power in (exponent - 1, exponent, exponent + 1) for digit in ladder]
    nearest = min(range(len(rungs)), key=lambda i: abs(math.log(rungs[i] / rate)))
    return float(f"{rungs[nearest + (1 if up else -1)]:.0e}")


def reference(setting: dict, method: str) -> str | None:
    """The arm whose best rate a reference arm runs at (the scale's `references`), or None for an arm swept itself."""
    return setting.get("references", {}).get(method)


def grid(setting: dict, method: str) -> list[float]:
    """The rates an arm's sweep starts from: the scale's `replay_lrs` for a replay arm, else its `lrs`."""
    return setting["replay_lrs"] if ARMS[method].replay else setting["lrs"]


def sweep(setting: dict, method: str, score, ledger) -> dict | None:
    """An arm's rate sweep. Where the scale names a `start_lr`, `bracket` from it. Otherwise `climb` the grid: the
    replay arms score every rate of their grid (the same-rate table) where the scale's `replay_every_rate` is true,
    the default; the others stop past the peak (rates already in the ledger are still read)."""
    if "start_lr" in setting:
        return bracket(setting["start_lr"], score)
    every = ARMS[method].replay and setting.get("replay_every_rate", True)
    return climb(
        grid(setting, method),
        score,
        lambda lr: every or all(ledger.get(method, lr, seed) is not None for seed in range(setting["sweep_seeds"])),
        past_edge=setting.get("past_edge", PAST_EDGE),
    )


def bound(setting: dict) -> str:
    """How a scale's run count reads: "at least" for a bracket (it may extend), "at most" for a grid."""
    return "at least" if "start_lr" in setting else "at most"


def bracket_rates(setting: dict, method: str, ledger) -> list[float]:
    """The rates an arm's `bracket` has scored from the ledger (every sweep seed finished), and the one it scores
    next where it has not ended."""
    visited = []

    def score(lr: float) -> float | None:
        visited.append(lr)
        entries = [ledger.get(method, lr, seed) for seed in range(setting["sweep_seeds"])]
        return None if None in entries else statistics.fmean(e["validation"]["mean"] for e in entries)

    bracket(setting["start_lr"], score)
    return visited


def estimate(setting: dict, methods: list[str], ledger, skip=()) -> list[dict]:
    """The runs the protocol may train, arm by arm (every grid rate on the sweep seeds, then the other seeds at the
    best rate, and the rates past an edge where the scale follows them), with those already in the ledger and the
    estimated hours of the rest: each run at the mean seconds of the arm's finished runs, else of all finished runs,
    else the scale's `run_seconds` estimate. Seeds in `skip` (left to another call) are counted neither as runs nor as
    done. One dict per method: `method`, `rates` (in words), `runs` (at least, for a bracket; at most, for a grid),
    `done`, `minutes` (a run) and `hours` (to go)."""
    finished = [e["seconds"] for e in ledger.runs.values() if not e["resumed"]]
    default = statistics.fmean(finished) if finished else setting["run_seconds"]
    sweep = sum(seed not in skip for seed in range(setting["sweep_seeds"]))  # the sweep seeds this call trains
    others = sum(seed not in skip for seed in range(setting["sweep_seeds"], setting["seeds"]))  # at the best only
    arms = []
    for method in methods:
        done = sum(m == method and seed not in skip for m, _, seed in ledger.runs)
        if reference(setting, method):
            rates_text = f"at the best rate of {reference(setting, method)}, not swept"
            most = sweep + others
        elif "start_lr" in setting:  # a bracket: three rates at least (the best and one on each side)
            rates_text = f"a bracket from {setting['start_lr']:.0e}, down first, of 3 rates or more".replace(
                "e-0", "e-"
            )
            rates = max(3, len(bracket_rates(setting, method, ledger)))  # the rates it has run or runs next
            most = max(sweep * rates + others, done)
        else:
            rates = grid(setting, method)
            rates_text = f"rates {' '.join(f'{r:g}' for r in rates)}"
            most = sweep * (len(rates) + setting.get("past_edge", PAST_EDGE)) + others
        own = [e["seconds"] for (m, _, _), e in ledger.runs.items() if m == method and not e["resumed"]]
        each = statistics.fmean(own) if own else default
        hours = max(most - done, 0) * each / 3600
        arms.append(
            {"method": method, "rates": rates_text, "runs": most, "done": done, "minutes": each / 60, "hours": hours}
        )
    return arms


def plan(setting: dict, methods: list[str], ledger, skip=()) -> str:
    """`estimate` in words, one line per method and one for all of them; `skip`: seeds left to another call."""
    arms = estimate(setting, methods, ledger, skip)
    lines = [
        f"{a['method']}: {a['rates']} on seeds 0-{setting['sweep_seeds'] - 1}, then seeds up to "
        f"{setting['seeds'] - 1} at the best: {bound(setting)} {a['runs']} runs, {a['done']} done, "
        f"{a['minutes']:.0f} min a run, {a['hours']:.1f} h to go"
        for a in arms
    ]
    if skip:
        lines.append(f"Seeds {' '.join(map(str, sorted(skip)))} left to another call (--skip_seeds): not counted")
    hours = sum(a["hours"] for a in arms)
    lines.append(
        f"In all: {bound(setting)} {sum(a['runs'] for a in arms)} runs, {hours:.1f} h to go on "
        f"one process; two processes with one thread each, --methods split between them: about {hours / 2:.1f} h"
    )
    return "\n".join(lines)
