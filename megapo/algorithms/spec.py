"""`LossSpec`: what a run's loss is, as one checked value that travels trainer → learner → `policy_loss`.

    spec = LossSpec("ppo", "token-mean", objective_options={"eps_high": 0.28}, correction="tis")
    spec = LossSpec.of("ppo", "token-mean", eps_high=0.28, correction="tis")   # the same, from flat options

Everything fixed for a run lives here (objective and its options, aggregation, mismatch correction, KL and
entropy terms); the per-token inputs (ref_logp, entropy, token_weight, ...) and the batch-global counts are
data, passed to `policy_loss` with each call. A spec is checked when it is built (every name looked up in
megapo.algorithms' registry, every option through its entry's dataclass): a bad one raises LossSpecError, a
ValueError whose message starts with the argument it names and whose `field` is the spec field, which
RunConfig.loss_spec maps to the config field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from megapo.algorithms.aggregation import AUTO
from megapo.algorithms.registry import get


@dataclass(frozen=True)
class LossSpec:
    """One run's loss, checked when built (a bad field: LossSpecError, a ValueError naming it)."""

    # the policy-gradient objective, a registered name (`megapo objectives --kind objective`)
    objective: str
    # the loss aggregation name, or "auto": the objective's registered (paper) aggregation
    loss_agg: str = AUTO
    # the objective's own options (its registry entry's dataclass fields: eps_low, eps_high, dual_clip, ...)
    objective_options: dict[str, Any] = field(default_factory=dict)
    # the mismatch correction applied to the per-token loss (a registered correction name), or None
    correction: str | None = None
    # the correction's options (its entry's dataclass fields); only with a correction
    correction_options: dict[str, Any] = field(default_factory=dict)
    # weight of the KL-to-π_ref loss term (0: none; non-zero needs ref_logp in every policy_loss call)
    kl_coef: float = 0.0
    # the KL estimator of that term and of the `kl` metric: a registered kl name (k1, k2, k3)
    kl_estimator: str = "k3"
    # weight of the entropy bonus (0: none; non-zero needs the differentiable entropy in every call)
    entropy_coef: float = 0.0
    # loss_agg seq-mean-token-sum-norm's constant length (positive), else None
    max_len: float | None = None
    # β_j of each teacher of algorithm.distill.mode topk_forward_kl (megapo/algorithms/topk_distill.py), in the
    # order of their blocks in sample.teacher_topk_*; () none. The learner adds that term (it needs log π_θ at the
    # teachers' ids from the vocabulary-parallel logits); policy_loss ignores it
    distill_topk: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("objective_options", "correction_options"):  # copies: a caller's dict changed later stays out
            given = getattr(self, name)
            if given is not None and not isinstance(given, dict):
                raise LossSpecError(name, f"{name}: expected a dict, got {type(given).__name__}")
            object.__setattr__(self, name, dict(given or {}))
        _checked("objective", lambda: get("objective", self.objective, argument="objective"))
        _checked("objective_options", self.objective_config)
        _checked("loss_agg", self._check_loss_agg)
        _checked("correction", lambda: self.correction is None or get("correction", self.correction,
                                                                          argument="correction"))
        _checked("correction_options", self._check_correction_options)
        object.__setattr__(self, "kl_coef", _checked("kl_coef", lambda: _finite("kl_coef", self.kl_coef)))
        object.__setattr__(self, "entropy_coef", _checked("entropy_coef",
                                                          lambda: _finite("entropy_coef", self.entropy_coef)))
        _checked("kl_estimator", self._check_kl_estimator)
        if self.max_len is not None:
            _checked("max_len", lambda: _positive("max_len", self.max_len))
        object.__setattr__(self, "distill_topk", _checked("distill_topk", lambda: _coefs(self.distill_topk)))

    @classmethod
    def of(cls, objective: str, loss_agg: str = AUTO, **options: Any) -> LossSpec:
        """A spec from flat keyword options, as `policy_loss(name, ..., **options)` takes them: the LossSpec
        field names (correction, kl_coef, ...) set those fields, every other name is an objective option."""
        common = {k: v for k, v in options.items() if k in FLAT_OPTIONS}
        return cls(objective, loss_agg, {k: v for k, v in options.items() if k not in FLAT_OPTIONS}, **common)

    def at_step(self, step: int) -> LossSpec:
        """The spec trainer step `step` trains with. The one per-step exception to a run-fixed spec: an objective
        whose options carry a schedule over steps (its options dataclass has options_at(step): holder's annealed p)
        gets those options resolved at `step` (holder: p = p_t, schedule = constant); any other spec is itself."""
        resolve = getattr(self.objective_config(), "options_at", None)
        changes = resolve(int(step)) if resolve is not None else {}
        if not changes:
            return self
        return replace(self, objective_options={**self.objective_options, **changes})

    def objective_config(self) -> Any:
        """The objective's options dataclass (a fresh one per call)."""
        return get("objective", self.objective, argument="objective").make_options(dict(self.objective_options))

    def _check_loss_agg(self) -> None:
        if self.loss_agg != AUTO:
            get("aggregation", self.loss_agg, argument="loss_agg")

    def _check_correction_options(self) -> None:
        if self.correction is None:
            if self.correction_options:
                raise ValueError("correction_options: given without a correction")
            return
        get("correction", self.correction).make_options(dict(self.correction_options))

    def _check_kl_estimator(self) -> None:
        if self.kl_estimator == "entropy":
            raise ValueError("kl_estimator: 'entropy' is not a KL estimator; choose k1, k2 or k3")
        get("kl", self.kl_estimator, argument="kl_estimator")


class LossSpecError(ValueError):
    """A LossSpec refused: the message as the library words it (starting with the argument it names), and
    `field`, the LossSpec field it was checking (what RunConfig.loss_spec maps to a config field)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def _checked(field_name: str, check: Callable[[], Any]) -> Any:
    """check()'s result; its ValueError / TypeError raised again as a LossSpecError of `field_name`."""
    try:
        return check()
    except LossSpecError:
        raise
    except (ValueError, TypeError) as exc:
        raise LossSpecError(field_name, str(exc)) from None


def as_loss_spec(loss: LossSpec | str, loss_agg: str | None = None, options: dict | None = None,
                 default_agg: str = AUTO) -> LossSpec:
    """`loss` itself when it is a LossSpec (then `loss_agg` and `options` must be absent: ValueError naming them),
    else LossSpec.of(loss, loss_agg or `default_agg`, **options): how the learner and policy_loss take either."""
    options = options or {}
    if isinstance(loss, LossSpec):
        if loss_agg is not None or options:
            given = ["loss_agg"] * (loss_agg is not None) + sorted(options)
            raise ValueError(f"options: {given} given with a LossSpec (set them in the spec)")
        return loss
    return LossSpec.of(loss, default_agg if loss_agg is None else loss_agg, **options)


# the fields a flat keyword option may set (LossSpec.of); any other option name is the objective's
FLAT_OPTIONS = tuple(f.name for f in fields(LossSpec) if f.name not in ("objective", "loss_agg", "objective_options"))


def _finite(name: str, value) -> float:
    """`value` as a float, refused (ValueError naming `name`) when it is not a finite number."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    return v


def _coefs(values) -> tuple[float, ...]:
    """distill_topk as a tuple of finite numbers >= 0."""
    out = tuple(_finite("distill_topk", v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"distill_topk: each coefficient must be >= 0, got {list(values)!r}")
    return out


def _positive(name: str, value) -> None:
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: must be a positive finite number, got {value!r}")
