"""megapo's algorithm library: objectives, advantage estimators, mismatch corrections, loss
aggregation, KL estimators and length shaping, each registered by name (registry.py) with its
granularity, formula and paper. `megapo objectives` lists them.

The names below are imported on first use (PEP 562): the run config's `algorithm` section
(megapo/algorithms/config.py) lives in this package, and reading a config must not import torch.
"""

import importlib

_HOMES = {
    "compute_advantages": "megapo.algorithms.advantages",
    "correction_weights": "megapo.algorithms.corrections",
    "mismatch_metrics": "megapo.algorithms.corrections",
    "kl_penalty": "megapo.algorithms.kl",
    "policy_loss": "megapo.algorithms.loss",
    "Entry": "megapo.algorithms.registry",
    "entries": "megapo.algorithms.registry",
    "get": "megapo.algorithms.registry",
    "shape_rewards": "megapo.algorithms.length",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
