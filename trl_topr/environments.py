"""Environments, as TRL's GRPO trainer takes them (`environment_factory`), for sampling and evaluation.

An environment is an object with a `reset` method and tool methods, made by a factory (a class, or any callable that
returns one). Each trajectory gets an instance of its own, reset with its prompt's row before it is generated, and the
policy may call the instance's public methods as tools, so that its calls change that trajectory's state only.
`reset` may return text, appended to the prompt's last message; a `get_reward()` method, where the environment has
one, scores each finished trajectory from the instance's state. Instances are made once and reset for each
trajectory: a pool grows to the most trajectories that run at once. With several processes, the environments' steps
(`reset`, the tool calls, `get_reward`) run on the main process, and every process goes on from their results.

A dict of factories gives each prompt the environment its row names in its `environment` column, and shows that
prompt only that environment's tools.
"""

import inspect
from collections.abc import Callable
from typing import Any

from .distributed import on_main_process


ENVIRONMENT = "environment"  # the column that names a row's environment, with a dict of factories
EnvironmentFactory = Callable[[], Any] | dict[str, Callable[[], Any]]


class Environments:
    """
    The environments of TRL GRPO's `environment_factory`, for [`~trl_topr.sample_completions`],
    [`~trl_topr.evaluation.evaluate_policy`] and [`~trl_topr.run_topr_loop`]: one instance per trajectory, reset with
    its prompt's row, whose public methods are the trajectory's tools.

    Args:
        environment_factory (`Callable` or `dict[str, Callable]`):
            Makes an environment: an object with a `reset(**row)` method (returning `None`, or text appended to the
            prompt's last message), public methods the policy may call as tools (type hints and a docstring
            describing their arguments, as for any tool), and optionally `get_reward()` (a float scoring the finished
            trajectory). A dict names several: each row then names its own in an `environment` column.
        tools (`list[Callable]`, *optional*):
            Tools shown beside every environment's methods.

    Raises:
        `ValueError`: for an environment without `reset`.

    Example:
    ```python
    >>> class Counter:
    ...     def reset(self, **row):
    ...         self.count = 0
    ...
    ...     def increment(self, step: int) -> int:
    ...         \"\"\"
    ...         Add to the counter.
    ...
    ...         Args:
    ...             step: How much to add.
    ...         \"\"\"
    ...         self.count += step
    ...         return self.count
    ...
    ...     def get_reward(self) -> float:
    ...         return float(self.count)

    >>> environments = Environments(Counter)
    >>> [tool.__name__ for tool in environments.tools()]
    ['increment']

    ```
    """

    def __init__(self, environment_factory: EnvironmentFactory, tools: list[Callable] | None = None):
        self.named = isinstance(environment_factory, dict)
        self.factories = dict(environment_factory) if self.named else {None: environment_factory}
        self.standalone = list(tools or [])
        self.pools = {name: [_checked(factory(), name)] for name, factory in self.factories.items()}
        probes = [pool[0] for pool in self.pools.values()]
        self.rewarded = list(dict.fromkeys(type(probe) for probe in probes if _has(probe, "get_reward")))

    def tools(self, name: str | None = None) -> list[Callable]:
        """
        The tools a prompt of environment `name` is shown: the standalone tools and the environment's methods.

        Args:
            name (`str`, *optional*):
                The environment's name in a dict of factories; `None` for a single factory.

        Returns:
            `list[Callable]`: the tools (the methods bound to the environment's first instance).
        """
        return self.standalone + _methods(self.pools[name][0])

    def names(self, rows: list[dict]) -> list[str | None]:
        """
        Each row's environment: `None` each with a single factory, else the row's `environment` column.

        Args:
            rows (`list[dict]`):
                The prompts' rows.

        Returns:
            `list[str | None]`: one name per row.

        Raises:
            `ValueError`: naming the row whose `environment` is missing or not among the factories.
        """
        if not self.named:
            return [None] * len(rows)
        for index, row in enumerate(rows):
            if row.get(ENVIRONMENT) not in self.factories:
                raise ValueError(
                    f"Column '{ENVIRONMENT}', row {index}: {row.get(ENVIRONMENT)!r} is not among the environments of "
                    f"`environment_factory` ({list(self.factories)})."
                )
        return [row[ENVIRONMENT] for row in rows]

    def start(self, prompts: list, rows: list[dict], repeats: int) -> tuple[list[Any], list, list[list[Callable]]]:
        """
        Draw and reset one instance per trajectory, `repeats` per prompt (prompt-major), as TRL's GRPO trainer does:
        each is reset with its row (without the `environment` column of a dict of factories), and text its `reset`
        returns is appended to the prompt's last message.

        Args:
            prompts (`list`):
                The prompts: lists of messages.
            rows (`list[dict]`):
                Their rows (what `reset` receives).
            repeats (`int`):
                The trajectories per prompt.

        Returns:
            `tuple[list, list, list[list[Callable]]]`: per trajectory, its instance, its prompt and its tools (the
            standalone tools and the instance's methods).
        """
        names = [name for name in self.names(rows) for _ in range(repeats)]
        drawn: dict = {}
        instances = []
        for name in names:
            pool, index = self.pools[name], drawn.get(name, 0)
            if index == len(pool):
                pool.append(_checked(self.factories[name](), name))
            instances.append(pool[index])
            drawn[name] = index + 1
        resets = [
            (instance, {k: v for k, v in rows[i // repeats].items() if not (self.named and k == ENVIRONMENT)})
            for i, instance in enumerate(instances)
        ]
        # every process holds instances, but the main process's take the steps (resets, tool calls, rewards)
        observations = on_main_process(lambda: [instance.reset(**row) for instance, row in resets])
        started = [_observed(prompts[i // repeats], seen) for i, seen in enumerate(observations)]
        return instances, started, [self.standalone + _methods(instance) for instance in instances]

    def expand(self, dataset, repeats: int) -> tuple[Any, list[list[Callable]], list[Any]]:
        """
        One row per trajectory, `repeats` per prompt (prompt-major), each prompt as its instance's `reset` left it
        (see [`start`]).

        Args:
            dataset ([`~datasets.Dataset`]):
                The prompts (`prompt` column) and their rows.
            repeats (`int`):
                The trajectories per prompt.

        Returns:
            `tuple[Dataset, list[list[Callable]], list]`: the rows, each row's tools, and its instance.
        """
        rows = dataset.to_list()
        instances, prompts, tools = self.start([row["prompt"] for row in rows], rows, repeats)
        expanded = dataset.select([i for i in range(len(dataset)) for _ in range(repeats)])
        return expanded.remove_columns("prompt").add_column("prompt", prompts), tools, instances

    def reward_funcs(self) -> dict[str, Callable]:
        """
        A reward function per environment class with `get_reward`, named after the class, as TRL's GRPO trainer adds
        them (weight 1): each scores the trajectories of its class with their instance's `get_reward()`, `None` for
        the others. They read the instances from the `environments` argument, which sampling passes to every reward
        function.

        Returns:
            `dict[str, Callable]`: the reward functions by name.
        """
        return {cls.__name__: _environment_reward(cls) for cls in self.rewarded}


def _environment_reward(cls: type) -> Callable:
    def reward(prompts, completions, environments, **kwargs):
        return [e.get_reward() if type(e) is cls else None for e in environments]

    reward.__name__ = cls.__name__
    return reward


def _observed(prompt: list, observation) -> list:
    # The prompt with `reset`'s text appended to its last message (rebuilt, the row left as it is)
    if observation is None:
        return prompt
    return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]


def _methods(instance) -> list[Callable]:
    # An environment's tools: its public methods but `reset` and `get_reward`, listed on the class as TRL does
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def _has(instance, name: str) -> bool:
    return any(member == name for member, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction))


def _checked(instance, name: str | None):
    if not _has(instance, "reset"):
        which = f"environment {name!r}" if name is not None else "environment"
        raise ValueError(
            f"The {which} of `environment_factory` ({type(instance).__name__}) must define a `reset` method."
        )
    return instance


def as_environments(
    environment_factory: "EnvironmentFactory | Environments | None", tools: list[Callable] | None = None
) -> "Environments | None":
    """
    `environment_factory` as [`Environments`] (a given `Environments` as it is, so that a loop keeps one pool over
    its rounds), or `None` without one.

    Args:
        environment_factory (`Callable`, `dict[str, Callable]` or [`Environments`], *optional*):
            TRL GRPO's `environment_factory`.
        tools (`list[Callable]`, *optional*):
            Tools shown beside the environments' methods.

    Returns:
        [`Environments`] or `None`.
    """
    if environment_factory is None or isinstance(environment_factory, Environments):
        return environment_factory
    return Environments(environment_factory, tools)
