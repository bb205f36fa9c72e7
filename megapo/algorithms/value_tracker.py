"""SPO: Xu & Ding 2025, Single-stream Policy Optimization (arXiv:2509.13232).

Group-free advantages: each prompt's baseline is a persistent, KL-adaptive value tracker instead of its group's
mean, and the advantages are normalised across the whole batch (abstract). The tracker (`ValueTracker`) lives with
the trainer across steps and is kept in the checkpoint (TrainerState.extra["value_tracker"], like cumulative_std's
running statistics), so a resumed run gives the advantages the uninterrupted one would.

    algorithm: {advantage: spo, advantage_options: {kl_per_step: 0.01}}    # rollout.n_samples may be 1

The paper's third piece, prioritised prompt sampling from the tracker (`priority_weights`), is the data order
`megapo.trainer.data.PrioritizedPromptSource`, turned on by the spo options:

    algorithm: {advantage: spo, advantage_options: {prioritized_sampling: true, sampling_candidates: 4}}

Each draw takes `sampling_candidates` × data.prompts_per_step candidates from the seeded per-epoch shuffle and keeps
data.prompts_per_step of them, drawn without replacement with probability ∝ √(v̂(1 − v̂)) + ε (ε = sampling_eps,
0.05 as in the authors' public code), from an RNG seeded by (train.seed, the draw's number): deterministic, and a
resumed run (cursor and draw count in the checkpoint's data cursor, the tracker in its extra) draws what the
unstopped one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import register

PAPER = "Xu & Ding 2025, Single-stream Policy Optimization (arXiv:2509.13232), SPO"
STATE_KEY = "value_tracker"  # its TrainerState.extra entry


def _number(key: str, value, low: float, high: float, *, open_low: bool = False) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if open_low else value >= low) and value <= high)
    if not ok:
        raise ValueError(f"{key}: must be a finite number in {'(' if open_low else '['}{low}, {high}], got {value!r}")


@dataclass
class SPOOptions:
    prior: float = 0.5  # v̂ of a prompt not seen yet (assumption)
    prior_count: float = 2.0  # n_0: pseudo-samples behind the prior, α_0 + β_0 (assumption)
    kl_per_step: float = 0.01  # D per trainer step between two visits (assumption: the move is not measured)
    d_half: float = 0.1  # D at which the tracker's memory halves: ρ = 2^{-D/d_half}
    rho_min: float = 0.875  # ρ's bounds (assumption: the defaults)
    rho_max: float = 0.96
    eps: float = 1e-6  # the batch normalisation's floor on the std
    # prioritised prompt sampling (the data order, megapo.trainer.data.PrioritizedPromptSource)
    prioritized_sampling: bool = False
    sampling_candidates: int = 4  # candidates per prompt drawn: this × data.prompts_per_step (assumption: 4)
    sampling_eps: float = 0.05  # ε of the weight √(v̂(1 − v̂)) + ε (the authors' public code: 0.05)

    def __post_init__(self):
        _number("prior", self.prior, 0.0, 1.0)
        _number("prior_count", self.prior_count, 0.0, math.inf, open_low=True)
        _number("kl_per_step", self.kl_per_step, 0.0, math.inf)
        _number("d_half", self.d_half, 0.0, math.inf, open_low=True)
        _number("rho_min", self.rho_min, 0.0, 1.0)
        _number("rho_max", self.rho_max, 0.0, 1.0)
        _number("eps", self.eps, 0.0, math.inf, open_low=True)
        if not isinstance(self.prioritized_sampling, bool):
            raise ValueError(f"prioritized_sampling: expected true or false, got {self.prioritized_sampling!r}")
        if isinstance(self.sampling_candidates, bool) or not isinstance(self.sampling_candidates, int) \
                or self.sampling_candidates < 1:
            raise ValueError(f"sampling_candidates: must be an integer >= 1, got {self.sampling_candidates!r}")
        _number("sampling_eps", self.sampling_eps, 0.0, math.inf, open_low=True)
        if self.rho_max < self.rho_min:
            raise ValueError(f"rho_max: must be >= rho_min ({self.rho_min!r}), got {self.rho_max!r}")


class ValueTracker:
    """Per prompt key: a Beta(α, β) estimate of its success rate, v̂ = α/(α+β), and the trainer step it was last
    seen at. `state_dict()` is JSON (the trainer checkpoint keeps it)."""

    def __init__(self, state: dict | None = None):
        self.values: dict[str, list[float]] = {}  # key -> [α, β, last step]
        if state:
            self.load_state_dict(state)

    def value(self, key: str, o: SPOOptions) -> float:
        if key not in self.values:
            return o.prior
        alpha, beta, _ = self.values[key]
        return alpha / (alpha + beta)

    def rho(self, key: str, step: int, o: SPOOptions) -> float:
        """ρ(x) = clip(2^{-D(x)/d_half}, ρ_min, ρ_max), D(x) = kl_per_step · (step − x's last step)."""
        drift = o.kl_per_step * max(step - self.values[key][2], 0)
        return min(max(2.0 ** (-drift / o.d_half), o.rho_min), o.rho_max)

    def update(self, key: str, rewards: list[float], step: int, o: SPOOptions) -> None:
        """α ← ρα + Σ r, β ← ρβ + Σ (1 − r) over this visit's rewards (a first visit starts from the prior:
        α_0 = prior·n_0, β_0 = (1 − prior)·n_0)."""
        if key in self.values:
            rho = self.rho(key, step, o)
            alpha, beta = rho * self.values[key][0], rho * self.values[key][1]
        else:
            alpha, beta = o.prior * o.prior_count, (1 - o.prior) * o.prior_count
        self.values[key] = [alpha + sum(rewards), beta + sum(1 - r for r in rewards), float(step)]

    def priorities(self, keys: list[str], o: SPOOptions, floor: float | None = None) -> Tensor:
        """Prioritised sampling probabilities, normalised: p(x) ∝ √(v̂(x)(1 − v̂(x))) + ε (ε = `floor`, else
        o.sampling_eps): the prompts the policy neither always solves nor always fails get drawn most."""
        w = priority_weights([self.value(k, o) for k in keys], o.sampling_eps if floor is None else floor)
        return w / w.sum()

    def state_dict(self) -> dict:
        return {k: list(v) for k, v in self.values.items()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if not (isinstance(value, list) and len(value) == 3 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
                    and value[0] >= 0 and value[1] >= 0 and value[0] + value[1] > 0):
                raise ValueError(f"{STATE_KEY}[{key!r}]: expected [α >= 0, β >= 0, last step], got {value!r}")
        self.values = {k: [float(x) for x in v] for k, v in state.items()}


def priority_weights(values: list[float], eps: float) -> Tensor:
    """w(x) = √(v̂(x)(1 − v̂(x))) + ε per value v̂ in [0, 1] (float64): SPO's prioritised-sampling weight (the
    authors' public code: ε = 0.05)."""
    v = torch.tensor(values, dtype=torch.float64)
    return torch.sqrt((v * (1 - v)).clamp(min=0)) + eps


def _normalise(adv: Tensor, eps: float) -> Tensor:
    return (adv - adv.mean()) / (adv.std(unbiased=False) + eps)


@register("spo", "advantage", "batch", PAPER, SPOOptions)
def spo(rewards: Tensor, o: SPOOptions, lengths: Tensor | None = None) -> Tensor:
    """A_i = r_i − v̂(x_i), v̂(x) the prompt's value tracker before this step's update (a Beta(α, β) success
    rate: v̂ = α/(α+β), per visit α ← ρα + Σ r, β ← ρβ + Σ(1 − r), ρ(x) = clip(2^{-D(x)/d_half}, ρ_min, ρ_max)
    KL-adaptive: the further the policy moved since x's last visit, the more it forgets); then across the whole
    batch Ã_i = (A_i − mean_B A)/(std_B A + eps). No group: rollout.n_samples may be 1. Stateless here (every
    prompt at its prior v̂ = prior); the trainer keeps the tracker across steps and in its checkpoint
    (value_tracker.spo_advantages).
    With prioritized_sampling the data order draws each step's prompts from sampling_candidates × prompts_per_step
    shuffled candidates without replacement, P(x) ∝ √(v̂(x)(1 − v̂(x))) + sampling_eps (trainer.data.
    PrioritizedPromptSource; RNG seeded by train.seed and the draw's number).
    assumption: rewards lie in [0, 1] (a success rate); D(x) = kl_per_step × the trainer steps since x's last visit
    (the policy's KL move between visits is not measured); the batch normalisation centres as well as scales; the
    prior, n_0, d_half and ρ's bounds are this library's defaults; the prioritised draw picks from a candidate window
    of the seeded shuffle (the public code re-weights a data-loader batch), without replacement."""
    _check_rewards(rewards.reshape(-1).tolist())
    return _normalise((rewards.to(torch.float64) - o.prior).reshape(-1), o.eps).reshape(rewards.shape)


def _check_rewards(flat: list[float]) -> None:
    bad = [r for r in flat if not (0.0 <= r <= 1.0)]
    if bad:
        raise ValueError(f"rewards: spo's value tracker is a success rate; rewards must lie in [0, 1], got {bad[0]!r}")


def spo_advantages(rewards: list[list[float]], keys: list[str], tracker: ValueTracker, step: int,
                   **options) -> list[Tensor]:
    """SPO's advantages of one step's groups (`rewards[i]`: the samples of prompt `keys[i]`, any number each),
    with the running `tracker`, which is then updated (baselines are all read before any update; updates in
    group order). Returns one float64 tensor per group."""
    o = SPOOptions(**options)
    if len(keys) != len(rewards):
        raise ValueError(f"keys: {len(keys)} for {len(rewards)} groups")
    flat = [float(r) for g in rewards for r in g]
    _check_rewards(flat)
    baselines = [tracker.value(k, o) for k in keys]
    adv = torch.tensor([r - b for g, b in zip(rewards, baselines) for r in g], dtype=torch.float64)
    adv = _normalise(adv, o.eps) if adv.numel() else adv
    for key, g in zip(keys, rewards):
        tracker.update(key, [float(r) for r in g], step, o)
    return list(torch.split(adv, [len(g) for g in rewards]))
