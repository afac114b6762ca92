"""The arms of the iterative benchmark, as data: how each method's runs train. `benchmarks/iterative.py` runs them;
a new arm is one entry of `ARMS` (see benchmarks/README.md)."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arm:
    """
    One method of the iterative benchmark.

    Args:
        name (`str`):
            Its name in the results (`+replay` ends the name of a replay arm, by convention).
        options (`dict`):
            The `TOPRConfig` fields of its training (`loss_type`, `target_positive_fraction`, ...); none for GRPO. The
            baseline is spelled out (`baseline: 0.0` for the paper's, a `target_positive_fraction` otherwise), so that
            a change of the library's defaults never changes what an arm trains: left unset, the loop would train
            TOPR with its own default target.
        replay (`bool`, *optional*, defaults to `False`):
            Every round also trains on the samples of the scale's `replay` rounds before it (off-policy); its rates
            sweep the scale's `replay_lrs`, every rate scored (the same-rate table).
        online (`bool`, *optional*, defaults to `False`):
            TRL's `GRPOTrainer` (online, one pass over the prompts a round) instead of `run_topr_loop`.
        curate (`str`, *optional*):
            A curation function of `trl_topr` applied to each round's samples (e.g. `"anna_karenina"`).
    """

    name: str
    options: dict = field(default_factory=dict)
    replay: bool = False
    online: bool = False
    curate: str | None = None


ARMS = {
    arm.name: arm
    for arm in [
        Arm("topr", {"loss_type": "topr", "baseline": 0.0}),
        Arm("topr_peff0.5", {"loss_type": "topr", "target_positive_fraction": 0.5}),
        Arm("topr_peff0.8", {"loss_type": "topr", "target_positive_fraction": 0.8}),
        Arm("positives_only", {"loss_type": "positives_only", "baseline": 0.0}),
        Arm("reinforce", {"loss_type": "reinforce", "baseline": 0.0}),
        Arm("topr_anna_karenina", {"loss_type": "topr", "baseline": 0.0}, curate="anna_karenina"),
        Arm("grpo", online=True),
        # the off-policy regime: every round also trains on the samples of the `replay` rounds before it
        Arm("topr+replay", {"loss_type": "topr", "baseline": 0.0}, replay=True),
        Arm("topr_peff0.2+replay", {"loss_type": "topr", "target_positive_fraction": 0.2}, replay=True),
        Arm("topr_peff0.5+replay", {"loss_type": "topr", "target_positive_fraction": 0.5}, replay=True),
        Arm("topr_peff0.8+replay", {"loss_type": "topr", "target_positive_fraction": 0.8}, replay=True),
        Arm("positives_only+replay", {"loss_type": "positives_only", "baseline": 0.0}, replay=True),
        Arm("reinforce+replay", {"loss_type": "reinforce", "baseline": 0.0}, replay=True),
        Arm("tis+replay", {"loss_type": "tis", "baseline": 0.0}, replay=True),
    ]
}
