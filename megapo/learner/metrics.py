"""How each `train_step` metric becomes one whole-batch value from its micro-batches on every DP rank.

Every metric a train step reduces is declared in REDUCTIONS with its reduction; a name not declared there is
refused (ValueError naming it), never guessed from its spelling. The learner copies each micro-batch's values to
the host once (MicroBatchMetrics), gathers them over DP ranks and calls `reduce_metrics`.

    parts = [MicroBatchMetrics(tokens=3, values={"pg_loss": 0.2, "ratio_max": 1.1}),
             MicroBatchMetrics(tokens=1, values={"pg_loss": 0.1, "ratio_max": 1.3})]
    reduce_metrics(parts)   # {"pg_loss": 0.3 (sum of shares), "ratio_max": 1.3}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Reduction(Enum):
    # Σ_i v_i: each micro-batch's value is its share of a batch total (a loss aggregated with the batch's
    # normaliser) or a count
    SUM = "sum"
    MIN = "min"  # min_i v_i
    MAX = "max"  # max_i v_i
    # Σ_i n_i·v_i / N: v_i a micro-batch's mean over its n_i policy tokens, N the batch's policy tokens (>= 1)
    TOKEN_MEAN = "token_mean"
    # Σ_i v_i / N: v_i a micro-batch's sum over its policy tokens
    TOKEN_SUM_MEAN = "token_sum_mean"
    # Σ_i c_i·v_i / Σ_i c_i: v_i a micro-batch's mean over c_i tokens of its own, c_i its value of the count metric
    # MEAN_OVER names (the mismatch metrics: the tokens whose engine log-prob is this step's)
    COUNT_MEAN = "count_mean"


# every metric the learner's train step reduces (its own, then policy_loss's: megapo/algorithms/loss.py,
# corrections.py); the trainer logs them as train/<name>
REDUCTIONS: dict[str, Reduction] = {
    "loss": Reduction.SUM,  # the full loss (objective + KL + entropy terms), this micro-batch's share
    "entropy": Reduction.TOKEN_SUM_MEAN,  # π_θ's entropy per policy token (the learner's; policy_loss's is not kept)
    "response_tokens": Reduction.SUM,  # every response token, observation tokens included
    "pg_loss": Reduction.SUM,  # the objective's term, this micro-batch's share
    "low_entropy_kl": Reduction.SUM,  # stage low_entropy_kl's KL-to-π_old term, this micro-batch's share
    "kl": Reduction.TOKEN_MEAN,  # the KL estimate to π_ref per policy token
    "ratio_mean": Reduction.TOKEN_MEAN,  # π_θ/π_old (the objective's ratio) per policy token
    "ratio_min": Reduction.MIN,
    "ratio_max": Reduction.MAX,
    "clipfrac_low": Reduction.TOKEN_MEAN,  # share of policy tokens clipped at the lower bound
    "clipfrac_high": Reduction.TOKEN_MEAN,  # ... at the upper bound
    "clipfrac_dual": Reduction.TOKEN_MEAN,  # ... by the dual clip
    "token_weight_mean": Reduction.TOKEN_MEAN,  # a token stage's weights (sample token_weight)
    "correction_weight_mean": Reduction.TOKEN_MEAN,  # the mismatch correction's weights
    "correction_masked_frac": Reduction.TOKEN_MEAN,  # share of policy tokens the correction zeroes
    # engine μ vs π_old (corrections.mismatch_from_batch) over the policy tokens this step's engine sampled (all of
    # them, or stage soup's continuations): mismatch_tokens of them
    "mismatch_tokens": Reduction.SUM,
    "mismatch_k1": Reduction.COUNT_MEAN,
    "mismatch_k3": Reduction.COUNT_MEAN,
    "mismatch_chi2": Reduction.COUNT_MEAN,  # (each micro-batch's χ², weighted by its mismatch_tokens)
    "mismatch_ess": Reduction.COUNT_MEAN,  # (each micro-batch's effective sample size fraction, weighted alike)
    "mismatch_max_abs_dlogp": Reduction.MAX,  # max |log π_old - log μ|
    # the first teacher's top-k forward KL per policy token (megapo/algorithms/topk_distill.py: each micro-batch's
    # sum over its policy tokens); with several teachers also distill/topk_forward_kl/<j> (INDEXED below)
    "distill/topk_forward_kl": Reduction.TOKEN_SUM_MEAN,
}
# metrics declared once for a family of names "<name>/<j>", j = 0, 1, ... (one per teacher), reduced as <name>
INDEXED = ("distill/topk_forward_kl",)
# a COUNT_MEAN metric -> the count metric weighting it
MEAN_OVER = {name: "mismatch_tokens" for name in ("mismatch_k1", "mismatch_k3", "mismatch_chi2", "mismatch_ess")}


@dataclass
class MicroBatchMetrics:
    """One micro-batch's metrics on the host."""

    tokens: int  # its policy tokens (loss_mask 1): the weight of its token means
    values: dict[str, float] = field(default_factory=dict)  # metric name (a REDUCTIONS key) -> its value


def reduce_metrics(parts: list[MicroBatchMetrics]) -> dict[str, float]:
    """Whole-batch metrics from every micro-batch of every DP rank, each by its declared reduction, in the order
    the names first appear; N (TOKEN_MEAN, TOKEN_SUM_MEAN) counts the policy tokens of all `parts`."""
    tokens = sum(p.tokens for p in parts)
    names = list(dict.fromkeys(name for p in parts for name in p.values))
    return {name: _reduce_one(name, parts, tokens) for name in names}


def _reduce_one(name: str, parts: list[MicroBatchMetrics], tokens: int) -> float:
    how = reduction(name)
    if how is Reduction.COUNT_MEAN:  # each value weighted by its micro-batch's own count
        pairs = [(p.values[MEAN_OVER[name]], p.values[name]) for p in parts if name in p.values]
        return sum(c * v for c, v in pairs) / max(sum(c for c, _ in pairs), 1)
    return _reduce(how, [(p.tokens, p.values[name]) for p in parts if name in p.values], tokens)


def reduction(name: str) -> Reduction:
    """The declared reduction of metric `name` (ValueError naming it when it has none)."""
    base, _, index = name.rpartition("/")
    if name not in REDUCTIONS and base in INDEXED and index.isdigit():
        return REDUCTIONS[base]
    if name not in REDUCTIONS:
        raise ValueError(f"metrics: {name!r} has no declared reduction (megapo/learner/metrics.py REDUCTIONS)")
    return REDUCTIONS[name]


def _reduce(how: Reduction, values: list[tuple[int, float]], tokens: int) -> float:
    """One metric's (policy tokens, value) of each micro-batch holding it -> the batch's value."""
    if how is Reduction.SUM:
        return sum(v for _, v in values)
    if how is Reduction.MIN:
        return min(v for _, v in values)
    if how is Reduction.MAX:
        return max(v for _, v in values)
    if how is Reduction.TOKEN_MEAN:
        return sum(n * v for n, v in values) / max(tokens, 1)
    return sum(v for _, v in values) / max(tokens, 1)
