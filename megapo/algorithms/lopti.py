"""Lopti, Low-Probability Token Isolation (Yang et al. 2025, Do Not Let Low-Probability Tokens Over-Dominate in RL
for LLMs): each policy update runs twice, first on the tokens π_old gave a probability below η, then on the rest.

    algorithm:
      stages:
        - {name: advantage_reweighting}   # optional: the paper's other half (AR + Lopti)
        - {name: lopti, eta: 0.5}

The stage (a token stage after the old-log-prob pass) marks each response token low (π_old(y_t) < η) or high
(`low_prob_masks`), once over the whole train batch; megapo.trainer.update.policy_updates then runs the optimizer
steps of the rollout batch twice, with token weights selecting the low tokens, then the high ones
(`split_weights`). Paper's code checked: zhyang2226/AR-Lopti (verl), ray_trainer.py: `update_actor` called twice
on the whole batch, the advantages zeroed outside the half, the loss mask (the normaliser) unchanged, KL and
entropy masked to the half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megapo.algorithms.registry import register

SCOPES = ("rollout", "mini_batch")

PAPER = ("Yang et al. 2025, Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs, Low-Probability Token "
         "Isolation (Lopti)")


@dataclass
class LoptiOptions:
    eta: float = 0.5  # [P] the probability threshold η: π_old(y_t) < η is a low-probability token
    scope: str = "rollout"  # rollout: every step on the low tokens, then every step on the high (the paper's code);
    #                         mini_batch: per mini-batch, its low step then its high step

    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    def __post_init__(self):
        e = self.eta
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or not 0 < e < 1:
            raise ValueError(f"eta: must be in (0, 1) (a probability threshold), got {e!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope: must be one of {', '.join(SCOPES)}, got {self.scope!r}")


@register("lopti", "token_weight", "token", PAPER, LoptiOptions)
def lopti(old_logp: Tensor, o: LoptiOptions) -> Tensor:
    """Low-Probability Token Isolation: low_t = [π_old(y_t) < η] (η = eta, default 0.5 [P]). Each update runs as two
    optimizer steps, the first on the loss restricted to the low tokens, L_low = L(w ⊙ low), then, from the weights
    it left, the second on the high ones, L_high = L(w ⊙ (1 − low)), both ratios against the same π_old. L(w) is
    the objective's loss with token weight w_t multiplying its per-token terms and the normaliser unchanged (every
    policy token of the mini-batch), so L_low + L_high = L: the paper code's masking (advantages zeroed outside the
    half, loss mask unchanged), for every loss_agg.
    scope=rollout (default, the paper's code): all updates_per_rollout × mini-batch steps on the low tokens, then all
    on the high; scope=mini_batch: each mini-batch's low step, then its high step. Assumption: the KL and entropy
    terms (kl_coef, entropy_coef) go with the second (high) step, over every token, once per mini-batch (the
    paper's code masks them to each half's tokens); a half with no token in a mini-batch takes no optimizer step
    (an Adam step on a zero gradient would still move the weights). Returns the low mask (bool) per token."""
    return torch.exp(old_logp) < o.eta


def low_prob_masks(old_logp: list, eta: float = 0.5) -> list[Tensor]:
    """`lopti` per sample: π_old's log-probs (one per response token) -> one bool tensor per sample, True where
    π_old(y_t) < eta."""
    o = LoptiOptions(eta=eta)
    return [lopti(torch.as_tensor(v, dtype=torch.float64).reshape(-1), o) for v in old_logp]


def split_weights(low: list[Tensor], token_weight: list | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """(low half, high half) token weights per sample: the samples' token weights (None: 1) times the low mask,
    and times its complement. The two add up to the weights given."""
    lows, highs = [], []
    for i, m in enumerate(low):
        w = torch.ones(m.numel(), dtype=torch.float64) if token_weight is None or token_weight[i] is None \
            else torch.as_tensor(token_weight[i], dtype=torch.float64).reshape(-1)
        lows.append(torch.where(m, w, torch.zeros_like(w)).tolist())
        highs.append(torch.where(m, torch.zeros_like(w), w).tolist())
    return lows, highs


def low_fraction(low: list[Tensor], loss_mask: list | None = None) -> float:
    """The share of the policy tokens (loss_mask 1; every response token without one) marked low."""
    flags = []
    for i, m in enumerate(low):
        keep = torch.ones_like(m) if loss_mask is None or loss_mask[i] is None \
            else torch.as_tensor(loss_mask[i]).reshape(-1).bool()
        flags.append(m[keep])
    flat = torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool)
    return float(flat.double().mean()) if flat.numel() else 0.0
