"""SENT: Cao et al. 2025, Efficient Reinforcement Learning with Semantic and Token Entropy for LLM Reasoning
(arXiv:2512.04359). Two pieces, one at each level:

- the data: a semantic-entropy curriculum, the prompts ordered from low to high semantic entropy (easier to
  harder). A prompt's semantic entropy is the entropy of the distribution of its sampled responses over classes of
  equivalent answers: for megapo's verifiable tasks, equal extracted final answers (`semantic_entropy`).
  `curriculum_order` orders an epoch; the data order is megapo.trainer.data.CurriculumPromptSource
  (data.curriculum: semantic_entropy), which measures each prompt on the run's rollouts;
- the tokens: a KL regularisation on the low-entropy tokens, stronger on their high-covariance part, the stage

      algorithm: {stages: [{name: low_entropy_kl, kl_coef: 0.1, entropy_quantile: 0.8, cov_ratio: 0.0002}]}

  (`low_entropy_kl_weights`): per response token a KL coefficient c_t, which the loss multiplies the token's
  KL to π_old by (`old_kl_term`: c_t · |log π_θ(y_t) − log π_old(y_t)|, the KL-Cov penalty of Cui et al. 2025,
  The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models, arXiv:2505.22617), aggregated as
  the policy loss is. The coefficients are computed once on the whole train batch after the old-log-prob pass, so
  they do not depend on how the batch is split into mini-, micro-batches or DP shards.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from megapo.algorithms.registry import register

PAPER = ("Cao et al. 2025, Efficient Reinforcement Learning with Semantic and Token Entropy for LLM Reasoning "
         "(arXiv:2512.04359), SENT")
NO_ANSWER = "\x00no-answer"  # the class of the responses with no extractable answer


# ----------------------------------------------------------------------------- the curriculum


def answer_class(answer: str | None) -> str:
    """A response's equivalence class: its extracted answer without whitespace (None: the no-answer class).
    Assumption: equal normalised answer strings are equivalent (no NLI clustering: megapo's tasks are
    verifiable, their answers short)."""
    return NO_ANSWER if answer is None else "".join(str(answer).split())


def semantic_entropy(answers: Sequence[str | None]) -> float:
    """SE(x) = −Σ_c p(c) log p(c), p(c) = n_c / n: the share of x's n sampled responses whose answer is in class c
    (`answer_class`), natural log (the discrete estimator: each sample weighs 1/n). 0 when all agree."""
    if not answers:
        raise ValueError("answers: semantic entropy needs at least one sampled answer")
    counts = Counter(answer_class(a) for a in answers)
    n = len(answers)
    return 0.0 - sum((c / n) * math.log(c / n) for c in counts.values())  # 0.0 - : no -0.0


def curriculum_order(order: Sequence[int], entropies: dict[int, float]) -> list[int]:
    """`order` (an epoch's seeded shuffle of prompt indices) sorted from low to high semantic entropy, a stable
    sort: equal entropies keep the shuffle's order, and the prompts with no entropy measured yet come last, in the
    shuffle's order."""
    measured = [i for i in order if i in entropies]
    rest = [i for i in order if i not in entropies]
    return sorted(measured, key=lambda i: entropies[i]) + rest


# ----------------------------------------------------------------------------- the low-entropy-token KL


def _in_range(key: str, value, low: float, high: float, *, open_low: bool = False) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if open_low else value >= low) and value <= high)
    if not ok:
        raise ValueError(f"{key}: must be a finite number in {'(' if open_low else '['}{low}, {high}], got {value!r}")


@dataclass
class LowEntropyKLOptions:
    kl_coef: float = 0.1  # β: the KL coefficient of a low-entropy token (the public code's ppo_kl_coef: 0.1)
    entropy_quantile: float = 0.8  # the low-entropy tokens: the lowest this share of the batch by π_old's entropy
    cov_ratio: float = 0.0002  # the high-covariance part: this share of the low-entropy tokens (KL-Cov's default)
    high_cov_scale: float = 2.0  # its coefficient: β × this (the public code: 2)
    low_cov_scale: float = 1.0  # the same share of lowest covariance: β × this (the public code: 0.5)
    base_scale: float = 1.0  # the other low-entropy tokens: β × this (the public code: 0)
    option_field = True  # refusals name the option's field (pipeline._parse_one)

    def __post_init__(self):
        _in_range("kl_coef", self.kl_coef, 0.0, math.inf)
        _in_range("entropy_quantile", self.entropy_quantile, 0.0, 1.0, open_low=True)
        _in_range("cov_ratio", self.cov_ratio, 0.0, 1.0, open_low=True)
        for name in ("high_cov_scale", "low_cov_scale", "base_scale"):
            _in_range(name, getattr(self, name), 0.0, math.inf)


def _stable_lowest(values: Tensor, k: int) -> Tensor:
    """Positions of the k smallest of `values` (ties: the earlier position first)."""
    return torch.sort(values, stable=True).indices[:k]


@register("low_entropy_kl", "token_weight", "batch", PAPER, LowEntropyKLOptions)
def low_entropy_kl_weights(entropy: list[Tensor], old_logp: list[Tensor], advantages: list[Tensor],
                           o: LowEntropyKLOptions, masks: list[Tensor] | None = None) -> list[Tensor]:
    """Per response token a KL coefficient c_t (the loss adds Σ_t c_t · |log π_θ(y_t) − log π_old(y_t)|, aggregated
    as the policy loss is). Over the batch's N policy tokens: L = the max(1, ⌊N·entropy_quantile⌋) tokens of lowest
    π_old entropy H_t; on L, Cov_t = (A_t − mean_L A)·(log π_old(y_t) − mean_L log π_old); m = max(1, ⌊|L|·cov_ratio⌋);
    c_t = β·high_cov_scale on the m tokens of L of largest Cov_t, β·low_cov_scale on the m of smallest, β·base_scale
    on the rest of L, 0 off L. The curriculum of the same paper orders the prompts from low to high semantic
    entropy SE(x) = −Σ_c p(c) log p(c) over classes of equal extracted answers (data.curriculum: semantic_entropy).
    assumption: π_old's entropy and log-probs stand for the train forward's (equal at the first update: the public
    code computes both in the train step, per micro-batch; here once per train batch, so the weights do not depend
    on the split); ties in H or Cov go to the earlier token in batch order; a token in both covariance parts gets
    high_cov_scale; the penalty is |log r| (the public code's abs_kl); the base and low-covariance scales default
    to 1 (the abstract: KL on all low-entropy tokens; the public code's v2 uses 0 and 0.5); on the curriculum:
    answers are equivalent when equal after whitespace removal, the entropies are measured on the previous epoch's
    rollouts (epoch 0 is the seeded shuffle)."""
    lengths = [len(e) for e in entropy]
    flat_h = torch.cat([torch.as_tensor(e, dtype=torch.float64).reshape(-1) for e in entropy]) if entropy else \
        torch.zeros(0, dtype=torch.float64)
    flat_lp = torch.cat([torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in old_logp]) if old_logp else \
        flat_h
    flat_a = torch.cat([torch.as_tensor(a, dtype=torch.float64).reshape(-1).expand(n)
                        for a, n in zip(advantages, lengths)]) if advantages else flat_h
    valid = (torch.cat([torch.as_tensor(m).reshape(-1).bool() for m in masks]) if masks is not None
             else torch.ones_like(flat_h, dtype=torch.bool))
    coef = torch.zeros_like(flat_h)
    where = valid.nonzero().reshape(-1)
    if where.numel():
        low = torch.sort(where[_stable_lowest(flat_h[where], max(1, int(where.numel() * o.entropy_quantile)))]).values
        a, lp = flat_a[low], flat_lp[low]
        cov = (a - a.mean()) * (lp - lp.mean())
        m = max(1, int(low.numel() * o.cov_ratio))
        coef[low] = o.kl_coef * o.base_scale
        coef[low[_stable_lowest(cov, m)]] = o.kl_coef * o.low_cov_scale
        coef[low[_stable_lowest(-cov, m)]] = o.kl_coef * o.high_cov_scale
    return list(torch.split(coef, lengths))


def old_kl_term(logp: Tensor, old_logp: Tensor, kl_weight: Tensor) -> Tensor:
    """c_t · |log π_θ(y_t) − log π_old(y_t)| per token (the loss aggregates it as the policy loss)."""
    return kl_weight * (logp - old_logp).abs()
