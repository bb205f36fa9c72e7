"""THR: the Token Hidden Reward (Deng, Ren, Li, Gong, Sutherland, Li and Thrampoulidis 2026, Token Hidden Reward:
Steering Exploration-Exploitation in Group Relative Deep Reinforcement Learning, arXiv:2510.03669).

A GRPO step on token (i, t) moves the last layer along Â_i·g_{i,t}·h_{i,t}ᵀ, g = e_y − π_old(·) the token's prediction
error and h its LM-head input; to first order that changes the log-likelihood of a correct response's token (j, k) by
η·Â_i·⟨g_{i,t}, g_{j,k}⟩·⟨h_{i,t}, h_{j,k}⟩. Summed over the group's correct responses this is the token's hidden
reward: positive where the update raises the correct responses' likelihood (exploitation), negative where it takes
probability mass from them (exploration). The same authors' earlier NTHR (Deng et al. 2025, On the Effect of Negative
Gradient in Group Relative Deep Reinforcement Optimization, arXiv:2505.18830) gives the score's vectorised form
s_t = g_tᵀ M⁺ h_t, M⁺ = Σ_{correct} g hᵀ, over the prompt's response vocabulary, and its threshold τ; THR's paper
reweights the advantages by the sign of the hidden reward with a scalar p (p > 0 exploitation, p < 0 exploration)
and trains on the dominant (high-influence) tokens.

This module holds the math on per-sample tensors; the stage thr (algorithm.stages) runs it after the old-log-prob pass
with one more learner forward on the routes the train steps replay, read twice at the response slots: the LM head's
input and π_old's log-probs of the batch's response vocabulary (Learner.response_hidden_logp_at).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import register


@dataclass
class THROptions:
    p: float = 0.5  # the reweighting's sign and strength: > 0 exploitation, < 0 exploration (assumed default)
    beta: float = 1.0  # τ = β·min over correct responses of their mean score (NTHR's threshold, β = 1)
    dominant_only: bool = False  # train on the dominant tokens only: the others' advantage 0 (the paper's THR-only)

    option_field = True  # refusals name the option's field (pipeline.parse_stages)

    def __post_init__(self):
        for name in ("p", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
        if not -1 <= self.p <= 1:
            raise ValueError(f"p: must be in [-1, 1] (1 + p·sign(THR) >= 0), got {self.p!r}")
        if not isinstance(self.dominant_only, bool):
            raise ValueError(f"dominant_only: must be true or false, got {self.dominant_only!r}")


def group_scores(tokens: list[Tensor], vocab_logp: list[Tensor], vocab: list[int], hidden: list[Tensor],
                 positive: list[bool], masks: list[Tensor]) -> tuple[list[Tensor], float]:
    """One prompt's group: s_t = g_tᵀ M⁺ h_t at every response token (0 where masked out) and τ₀ = min over the
    positive responses of their policy tokens' mean s. g_t = e_{y_t} − π_old(·) over V*, the ids that occur in the
    group's policy tokens (the other coordinates dropped, π_old not renormalised: NTHR's restriction), M⁺ =
    Σ_{positive responses' policy tokens} g hᵀ. `vocab_logp[i]`: [R_i, len(vocab)] log π_old at the ids `vocab`."""
    used = sorted({int(v) for y, m in zip(tokens, masks) for v in y[m].tolist()})
    column = {v: c for c, v in enumerate(vocab)}
    cols = torch.tensor([column[v] for v in used], dtype=torch.long)
    index = {v: c for c, v in enumerate(used)}
    errors = []
    for y, lp in zip(tokens, vocab_logp):
        g = -lp.double()[:, cols].exp()
        rows = [t for t, v in enumerate(y.tolist()) if v in index]
        g[rows, [index[int(y[t])] for t in rows]] += 1.0
        errors.append(g)
    width = hidden[0].shape[-1]
    m_pos = torch.zeros(len(used), width, dtype=torch.float64)
    for g, h, pos, m in zip(errors, hidden, positive, masks):
        if pos:
            m_pos += g[m].T @ h.double()[m]
    scores = [((g @ m_pos) * h.double()).sum(-1) * m for g, h, m in zip(errors, hidden, masks)]
    anchors = [float(s[m].mean()) for s, pos, m in zip(scores, positive, masks) if pos and m.any()]
    return scores, min(anchors) if anchors else 0.0


@register(
    "thr", "advantage_stage", "group",
    "Deng, Ren, Li, Gong, Sutherland, Li and Thrampoulidis 2026, Token Hidden Reward: Steering "
    "Exploration-Exploitation in Group Relative Deep Reinforcement Learning (arXiv:2510.03669); the score's "
    "vectorised form and threshold from the authors' NTHR (arXiv:2505.18830) (the stage thr: one more learner "
    "forward, read for the LM head's input and π_old over the batch's response vocabulary)",
    THROptions,
)
def thr_advantages(responses: list, advantages: list[float], vocab_logp: list[Tensor], vocab: list[int],
                   hidden: list[Tensor], group_size: int, masks: list | None, o: THROptions
                   ) -> tuple[list[Tensor], dict]:
    """Per prompt's group with both signs of advantage: THR_{i,t} = Â_i·s_{i,t}, s_{i,t} = Σ_{j: Â_j > 0} Σ_k
    ⟨g_{i,t}, g_{j,k}⟩⟨h_{i,t}, h_{j,k}⟩ (g = e_y − π_old over the group's response vocabulary V*, h the LM head's
    input; group_scores), the first-order change of the positive responses' log-likelihood a step on token (i, t)
    makes. τ = β·min_{j: Â_j > 0} mean_k s_{j,k}. A dominant token (|s_{i,t}| > τ) gets
    Â'_{i,t} = Â_i·(1 + p·sign(THR_{i,t})): p > 0 amplifies the tokens that raise the correct responses' likelihood and
    weakens those that lower it (exploitation), p < 0 the reverse (exploration); the others keep Â_i (0 with
    dominant_only, the paper's training on the dominant tokens only). Groups with one sign of advantage keep Â_i.
    Assumptions, marked: the reweighting's form 1 + p·sign(THR), its default p = 0.5, the dominance rule
    |s| > τ and the positive side as Â > 0 (for binary rewards: the correct responses) are read from the abstract
    and the NTHR paper, whose threshold τ and vocabulary restriction this uses; the paper's exact choices are not
    at hand. Returns the advantages (one float64 tensor per sample) and metrics thr/dominant_frac (the dominant share
    of the mixed groups' policy tokens) and thr/positive_frac (the share of those with THR > 0)."""
    n = len(responses)
    if not len(advantages) == len(vocab_logp) == len(hidden) == n:
        raise ValueError(f"vocab_logp: one per sample ({n}), got {len(advantages)} advantages, {len(vocab_logp)} "
                         f"vocab_logp and {len(hidden)} hidden")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or n % group_size:
        raise ValueError(f"group_size: must be an integer >= 1 dividing the {n} samples, got {group_size!r}")
    tokens = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in responses]
    keep = [torch.ones(len(y), dtype=torch.bool) if masks is None or masks[i] is None
            else torch.as_tensor(masks[i]).reshape(-1).bool() for i, y in enumerate(tokens)]
    for i, (y, lp, h, m) in enumerate(zip(tokens, vocab_logp, hidden, keep)):
        if lp.shape != (len(y), len(vocab)) or h.dim() != 2 or h.shape[0] != len(y) or m.numel() != len(y):
            raise ValueError(f"vocab_logp[{i}]: expected [{len(y)}, {len(vocab)}] with hidden [{len(y)}, h] and "
                             f"{len(y)} mask values")
    out = [torch.full((len(y),), float(a), dtype=torch.float64) for y, a in zip(tokens, advantages)]
    dominant = positive = counted = 0
    for lo in range(0, n, group_size):
        part = range(lo, lo + group_size)
        adv = [float(advantages[i]) for i in part]
        if not (any(a > 0 for a in adv) and any(a < 0 for a in adv)):
            continue
        scores, anchor = group_scores([tokens[i] for i in part], [vocab_logp[i] for i in part], vocab,
                                      [hidden[i] for i in part], [a > 0 for a in adv], [keep[i] for i in part])
        tau = o.beta * anchor
        for i, a, s in zip(part, adv, scores):
            thr = a * s
            big = (s.abs() > tau) & keep[i]
            scale = torch.where(big, 1 + o.p * torch.sign(thr), torch.full_like(s, 0.0 if o.dominant_only else 1.0))
            out[i] = a * torch.where(keep[i], scale, torch.ones_like(s))
            dominant += int(big.sum())
            positive += int((big & (thr > 0)).sum())
            counted += int(keep[i].sum())
    return out, {"thr/dominant_frac": dominant / counted if counted else 0.0,
                 "thr/positive_frac": positive / dominant if dominant else 0.0}
