"""megapo's algorithm library: objectives, advantage estimators, mismatch corrections, loss
aggregation, KL estimators and length shaping, each registered by name (registry.py) with its
granularity, formula and paper. `megapo objectives` lists them."""

from megapo.algorithms.advantages import compute_advantages
from megapo.algorithms.corrections import correction_weights, mismatch_metrics
from megapo.algorithms.kl import kl_penalty
from megapo.algorithms.loss import policy_loss
from megapo.algorithms.registry import Entry, entries, get
from megapo.algorithms.length import shape_rewards

__all__ = [
    "Entry", "compute_advantages", "correction_weights", "entries", "get", "kl_penalty",
    "mismatch_metrics", "policy_loss", "shape_rewards",
]
