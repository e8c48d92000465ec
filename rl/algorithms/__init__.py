"""The RL algorithms a run can train with (--algorithm NAME): one object each, in a file of its own
(rl/algorithms/NAME.py), behind the interface of rl/algorithms/algorithm.py. This registry is the
one place that lists them; no other module asks which algorithm runs (tests/test_architecture.py).
Adding one: docs/architecture.md, "Add an algorithm"."""
from __future__ import annotations

import warnings

from rl.algorithms import dance_grpo, flow_dppo, flow_grpo, flow_grpo_fast, mixgrpo, nft
from rl.algorithms.algorithm import Algorithm, Cost, LossTerms

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    flow_grpo.FlowGRPO(),
    dance_grpo.DanceGRPO(),
    flow_grpo_fast.FlowGRPOFast(),
    mixgrpo.MixGRPO(),
    nft.NFT(),
    flow_dppo.FlowDPPO(),
)}
ALIASES = {"window": "flow_grpo_fast"}
"""old spellings, accepted with a warning"""
DEFAULT = next(iter(ALGORITHMS))
"""the algorithm of a run that names none: the first"""


def algorithm(name: str) -> Algorithm:
    """The named algorithm; an old spelling warns and gives the new one."""
    if name in ALIASES:
        warnings.warn(f"--algorithm {name} is now spelled --algorithm {ALIASES[name]}", stacklevel=2)
        name = ALIASES[name]
    if name not in ALGORITHMS:
        raise ValueError(f"unknown --algorithm {name!r}; choose one of {tuple(ALGORITHMS)}")
    return ALGORITHMS[name]


def names() -> tuple[str, ...]:
    return tuple(ALGORITHMS)


def describe() -> str:
    """--algorithm's help: every algorithm's line, and the old spellings."""
    old = ", ".join(f"{a} for {n}" for a, n in ALIASES.items())
    return "; ".join(f"{a.name} ({a.description})" for a in ALGORITHMS.values()) + f" (old spellings: {old})"


def flags(section: str) -> tuple[type, ...]:
    """The dataclasses of the algorithms' own flags in a config section ("rl", "sampling"), in
    registry order: config/schema.py's section inherits them."""
    return tuple(a.flags[section] for a in ALGORITHMS.values() if section in a.flags)


def _shown(value) -> str:
    return ":".join(map(str, value)) if isinstance(value, tuple) else str(value)


def check(cfg) -> None:
    """Every algorithm's flags against their ranges (a flag exists whatever the algorithm), what the
    run's algorithm asks of its flags, and no option of another algorithm set away from its default.
    Each error is a ValueError naming the flag and its value."""
    for a in ALGORITHMS.values():
        a.check_flags(cfg)
    chosen = algorithm(cfg.rl.algorithm)
    chosen.check(cfg)
    owners: dict[str, list[str]] = {}
    for a in ALGORITHMS.values():
        for option in a.read_options():
            owners.setdefault(option, []).append(a.name)
    for option, who in owners.items():
        section, name = option.split(".")
        values = getattr(cfg, section)
        value, default = getattr(values, name), getattr(type(values)(), name)
        if chosen.name not in who and value != default:
            users = ", ".join(f"--algorithm {n}" for n in who)
            raise ValueError(f"--{name.replace('_', '-')} {_shown(value)} is read by {users} only: use "
                             f"--algorithm {who[0]} (got {chosen.name!r})")


__all__ = ["ALGORITHMS", "ALIASES", "DEFAULT", "Algorithm", "Cost", "LossTerms", "algorithm", "check", "describe",
           "flags", "names"]
