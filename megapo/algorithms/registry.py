"""One registry of everything the algorithm library offers, by name.

An entry says what a name is (`kind`), what it acts on (`granularity`), where it comes from
(`paper`), its formula (the function's docstring) and its options (a dataclass whose fields are the
option names with their defaults). An objective also carries its paper's loss aggregation
(`loss_agg`, used when a caller or config leaves it "auto"); an advantage estimator the fewest
samples per prompt it is defined for (`min_group`: the one rule `compute_advantages` and the config
both ask). `megapo objectives` prints this table; `policy_loss` and `compute_advantages` look names
up here and refuse unknown names or options with a ValueError.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

KINDS = ("objective", "advantage", "advantage_stage", "token_weight", "correction", "aggregation", "kl",
         "length_reward", "group_filter")
GRANULARITIES = ("token", "sequence", "group", "batch")


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str
    granularity: str
    paper: str
    fn: Callable[..., Any] | None
    options: type | None = None  # a dataclass: its fields are the accepted options
    loss_agg: str | None = None  # objectives: the paper's aggregation (loss_agg="auto" picks it)
    min_group: int = 1  # advantage estimators: samples per prompt it needs

    @property
    def formula(self) -> str:
        doc = (self.fn.__doc__ if self.fn is not None else None) or ""
        return doc.strip()

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.options)] if self.options else []

    def make_options(self, given: dict[str, Any]) -> Any:
        """Build the options dataclass; unknown names raise ValueError naming them."""
        known = self.option_names()
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(
                f"options: unknown option(s) {unknown} for {self.kind} {self.name!r}; "
                f"known: {known or 'none'}"
            )
        if self.options is None:
            return None
        return self.options(**given)


_REGISTRY: dict[tuple[str, str], Entry] = {}
# Modules that register entries when imported; `entries()` imports them all.
_MODULES = (
    "megapo.algorithms.objectives",
    "megapo.algorithms.trust_region",
    "megapo.algorithms.ratio_gating",
    "megapo.algorithms.advantages",
    "megapo.algorithms.subgroup_advantages",
    "megapo.algorithms.corrections",
    "megapo.algorithms.aggregation",
    "megapo.algorithms.kl",
    "megapo.algorithms.length",
    "megapo.algorithms.step_length",
    "megapo.algorithms.blockwise",
    "megapo.algorithms.stages",
    "megapo.algorithms.token_credit",
    "megapo.algorithms.self_distill",
    "megapo.algorithms.entropy_credit",
    "megapo.algorithms.a3po",
    "megapo.algorithms.plackett_luce",
    "megapo.algorithms.value_tracker",
    "megapo.algorithms.semantic_entropy",
    "megapo.algorithms.otb",
    "megapo.algorithms.discriminative",
    "megapo.algorithms.attention_entropy",
    "megapo.algorithms.hidden_reward",
    "megapo.algorithms.multi_reward",
    "megapo.algorithms.distribution_centric",
    "megapo.algorithms.token_length",
    "megapo.algorithms.lopti",
    "megapo.algorithms.information",
    "megapo.algorithms.anytime",
    "megapo.algorithms.soup",
    "megapo.algorithms.duet",
    "megapo.algorithms.dast_preference",
)


def register(name: str, kind: str, granularity: str, paper: str, options: type | None = None, *,
             loss_agg: str | None = None, min_group: int = 1):
    """Decorator: register `fn` under (kind, name). Every objective names its paper's `loss_agg`;
    an advantage estimator that compares samples of a prompt sets `min_group`."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} not in {KINDS}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: {granularity!r} not in {GRANULARITIES}")
    if (kind == "objective") != (loss_agg is not None):
        raise ValueError(f"loss_agg: every objective names its default aggregation, nothing else does ({name!r})")
    if min_group != 1 and kind != "advantage":
        raise ValueError(f"min_group: only advantage estimators have one ({name!r})")

    def wrap(fn):
        key = (kind, name)
        if key in _REGISTRY and _REGISTRY[key].fn is not fn:
            raise ValueError(f"name: {kind} {name!r} registered twice")
        _REGISTRY[key] = Entry(name, kind, granularity, paper, fn, options, loss_agg, min_group)
        return fn

    return wrap


_loaded = False  # every module of _MODULES has registered (the loss looks entries up at every step)


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for module in _MODULES:
        importlib.import_module(module)
    _loaded = True


def entries(kind: str | None = None) -> list[Entry]:
    """All entries (of one kind), grouped by kind in KINDS order, then in registration order."""
    _load_all()
    chosen = [e for e in _REGISTRY.values() if kind is None or e.kind == kind]
    return sorted(chosen, key=lambda e: KINDS.index(e.kind))


def get(kind: str, name: str, argument: str = "name") -> Entry:
    """The entry; an unknown name raises ValueError naming `argument` and the choices."""
    _load_all()
    if not isinstance(name, str) or (kind, name) not in _REGISTRY:
        choices = [e.name for e in entries(kind)]
        raise ValueError(f"{argument}: unknown {kind} {name!r}; choose from {choices}")
    return _REGISTRY[(kind, name)]
