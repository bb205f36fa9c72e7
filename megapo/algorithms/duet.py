"""DUET: Hu, Zhao, Xu and Jacoby 2026, DUET: Optimize Token-Budget Allocation for Reinforcement Learning with
Verifiable Rewards (arXiv:2605.08441). DUal-controlled tokEn allocaTion, a layer over GRPO with two controls under
one shared budget: (i) a lightweight pre-rollout surrogate of each prompt's informativeness sets how many rollouts
it receives; (ii) a marker-gated abort rule with importance reweighting sets when a rollout stops.

It is the group filter `duet` (data.group_filter: duet), because both of its halves act where megapo's group
filters act, on each sampling round of rank 0 (megapo.trainer.length_stage): the rollout asks it for each prompt's
rollout count before the engine runs (`Duet.allocate`, megapo.trainer.rollout.rollout_round draws prompt i n_i
times), and it judges each round's responses after the verifier (`Duet.select`, the abort rule; the kept
responses' importance weights go to Group.weights and from there into every token's loss weight,
TrainSample.token_weight). Its state (the surrogate's per-prompt Beta trackers, the step and round of its draws)
travels in the checkpoint with the length stage's (TrainerState.extra["length"]["group_filter"]), so a resumed
run allocates and aborts as the unstopped one.

    data: {group_filter: duet, group_filter_options: {budget_scale: 1.0, min_rollouts: 2}}
    data: {group_filter: duet, group_filter_options: {marker: "\\boxed{", horizon: 256, grace: 32, keep_prob: 0.05}}

What the paper's public material fixes (the abstract and its summaries): the abort is gated by domain answer
markers (boxed answers for math, a closing code fence for code, answer spans for short QA); a rollout with no
marker past the abort horizon plus a grace window is usually aborted but, with a small keep probability
(default 0.05; 0.01-0.20 tested), continued to its end with importance weighting; a rollout whose marker appears
is kept. The rest is ours, marked "Assumption:" below (no released code was found).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.length import GroupFilter
from megapo.algorithms.registry import register
from megapo.algorithms.value_tracker import SPOOptions, ValueTracker

PAPER = ("Hu, Zhao, Xu and Jacoby 2026, DUET: Optimize Token-Budget Allocation for Reinforcement Learning with "
         "Verifiable Rewards (arXiv:2605.08441), DUET")
NAME = "duet"


def _number(key: str, value, low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if open_low else value >= low) and (value < high if open_high else value <= high))
    if not ok:
        raise ValueError(f"{key}: must be a finite number in {'(' if open_low else '['}{low}, {high}"
                         f"{')' if open_high else ']'}, got {value!r}")


def _int(key: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key}: must be an integer >= {low}, got {value!r}")


@dataclass
class DuetOptions:
    option_field = True  # refusals name data.group_filter_options.<option> (config.check_length_methods)

    # (i) the allocation: total rollouts of a round = round(budget_scale × prompts × rollout.n_samples)
    budget_scale: float = 1.0  # 1: GRPO's budget, redistributed; 0.5: the paper's half-budget runs
    min_rollouts: int = 2  # the floor per prompt (Assumption: 2, the fewest a group comparison needs)
    eps: float = 0.01  # informativeness floor: u = v̂(1 − v̂) + eps (Assumption)
    prior: float = 0.5  # v̂ of a prompt not seen yet (Assumption)
    prior_count: float = 2.0  # pseudo-samples behind the prior (Assumption)
    decay: float = 0.9  # ρ: α, β ← ρα, ρβ at each visit before the new verdicts are added (Assumption)
    # (ii) the abort rule: off while marker is ""
    marker: str = ""  # the answer marker (the paper's math marker: "\\boxed{")
    horizon: int = 0  # H: tokens before the abort check (with grace G: the check at H + G tokens)
    grace: int = 0  # G
    keep_prob: float = 0.05  # q: a marker-less rollout past H + G continues with probability q (the paper's 0.05)

    def __post_init__(self):
        _number("budget_scale", self.budget_scale, 0.0, math.inf, open_low=True, open_high=True)
        _int("min_rollouts", self.min_rollouts, 1)
        _number("eps", self.eps, 0.0, math.inf, open_low=True, open_high=True)
        _number("prior", self.prior, 0.0, 1.0)
        _number("prior_count", self.prior_count, 0.0, math.inf, open_low=True, open_high=True)
        _number("decay", self.decay, 0.0, 1.0)
        if not isinstance(self.marker, str):
            raise ValueError(f"marker: must be a string (\"\": no abort), got {self.marker!r}")
        _int("horizon", self.horizon, 0)
        _int("grace", self.grace, 0)
        _number("keep_prob", self.keep_prob, 0.0, 1.0, open_low=True)
        if self.marker and self.horizon < 1:
            raise ValueError(f"horizon: the abort rule (marker {self.marker!r}) needs a horizon >= 1, "
                             f"got {self.horizon!r}")
        if not self.marker and (self.horizon or self.grace):
            raise ValueError("marker: horizon and grace are given but no marker (\"\" turns the abort off)")

    def abort_at(self) -> int | None:
        """H + G, where a rollout with no marker yet is judged; None: no abort rule."""
        return self.horizon + self.grace if self.marker else None

    def tracker_options(self) -> SPOOptions:
        """The surrogate as SPO's Beta tracker (value_tracker.ValueTracker) with a fixed per-visit decay: no KL
        drift (kl_per_step 0) makes its ρ = clip(1, 0, decay) = decay."""
        return SPOOptions(prior=self.prior, prior_count=self.prior_count, kl_per_step=0.0, rho_min=0.0,
                          rho_max=self.decay)


# ----------------------------------------------------------------------------- (i) the allocation


def informativeness(values: list[float], eps: float) -> list[float]:
    """u_i = v̂_i(1 − v̂_i) + eps: the Bernoulli variance of prompt i's predicted pass rate, the GRPO signal a group
    of its rollouts carries (0 for a prompt always solved or always failed), floored by eps."""
    return [v * (1.0 - v) + eps for v in values]


def total_rollouts(prompts: int, n_samples: int, budget_scale: float) -> int:
    """The round's shared budget: round(budget_scale × prompts × rollout.n_samples) rollouts."""
    return int(round(budget_scale * prompts * n_samples))


def allocate_rollouts(scores: list[float], total: int, floor: int) -> list[int]:
    """n_i = floor + ⌊R·u_i/Σu⌋ + (1 for the R − Σ_j ⌊R·u_j/Σu⌋ largest remainders R·u_i/Σu − ⌊·⌋, ties to the
    earlier prompt), R = total − floor·P: Σ n_i = total exactly (Hamilton's largest-remainder rounding of the
    proportional share)."""
    if not scores:
        return []
    spare = total - floor * len(scores)
    if spare < 0:
        raise ValueError(f"budget: {total} rollouts cannot give {len(scores)} prompts {floor} each")
    mass = sum(scores)
    shares = [spare * u / mass for u in scores]
    counts = [floor + int(math.floor(s)) for s in shares]
    left = total - sum(counts)
    order = sorted(range(len(scores)), key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


# ----------------------------------------------------------------------------- (ii) the abort rule


def marker_end(texts: list[str], marker: str) -> int:
    """Tokens through the first completion of `marker` in the response (`texts`: each token's text, in order),
    -1 when it never appears."""
    prefix = ""
    for i, t in enumerate(texts):
        prefix += t
        if marker in prefix[-(len(marker) + len(t)):]:
            return i + 1
    return -1


def undecided(lengths: list[int], ends: list[int], abort_at: int) -> list[bool]:
    """The responses the abort rule judges: no marker within their first H + G tokens and still running there
    (more than H + G tokens). The others are kept at weight 1: their marker came in time, or they ended first."""
    return [L > abort_at and not 0 < e <= abort_at for L, e in zip(lengths, ends)]


def abort_weights(judged: list[bool], uniforms: list[float], keep_prob: float) -> list[float]:
    """Each response's importance weight: 1 when not judged; a judged one continues to its end when its uniform
    draw is < q (weight 1/q), else it is aborted (weight 0: it leaves the batch). E[w_i] = 1 for every response, so
    E[Σ_i w_i g_i] = Σ_i g_i for any per-response terms g_i (the gradient of the full batch)."""
    return [(1.0 / keep_prob if u < keep_prob else 0.0) if j else 1.0 for j, u in zip(judged, uniforms)]


# ----------------------------------------------------------------------------- the group filter


@register(NAME, "group_filter", "group", PAPER, DuetOptions)
class Duet(GroupFilter):
    """DUET's two controls on each sampling round (rank 0).
    Before the engine (allocate): v̂_i = α_i/(α_i + β_i), prompt i's Beta pass-rate tracker (a prompt not seen yet:
    its difficulty level's pooled tracker, else the run's pooled one, else the prior);
    u_i = v̂_i(1 − v̂_i) + eps; the round's budget B = round(budget_scale × P × rollout.n_samples) rollouts over its
    P prompts, n_i = min_rollouts + the largest-remainder rounding of (B − min_rollouts·P)·u_i/Σ_j u_j (Σ n_i = B).
    After the verifier (select), with marker m, horizon H, grace G, keep probability q: a response whose first
    H + G tokens hold no m and that runs past them is aborted with probability 1 − q (it leaves the batch) and
    kept with probability q at importance weight 1/q (its loss is multiplied by 1/q: TrainSample.token_weight); every
    other response is kept at weight 1; a group left with fewer than min_rollouts responses leaves the round. Then
    each prompt's tracker: α ← ρα + Σ c, β ← ρβ + Σ (1 − c) over its verdicts c (an aborted response counts as a
    failure), ρ = decay, and each pooled tracker (the prompt's level's, the run's) once per round over the round's
    verdicts. The advantages are the estimator's over the kept responses of each group (groups of different sizes,
    one at a time).
    Assumption: the surrogate (a per-prompt Beta tracker of the verifier's verdicts with a fixed decay, prior 0.5
    over 2 pseudo-samples, backed off to pooled trackers for prompts not seen yet, informativeness the Bernoulli
    variance v̂(1 − v̂) + eps), the allocation (proportional to u above a floor of min_rollouts, largest-remainder
    rounding, ties to the earlier prompt, one budget per sampling round in rollouts, not tokens), the aborted
    response leaving the batch (weight 0) and a group the aborts left below min_rollouts leaving it (the estimator
    compares responses within a group) are ours; the paper's keep probability (0.05) and marker gating are
    transcribed. The abort is applied after generation to the
    whole responses: the samples and weights an in-engine abort gives, without its saved tokens (the metric
    length/duet_tokens_charged counts what it would have spent: H + G per aborted response); the paper's stop
    shortly after a marker is not applied (a response ends at its stop token). Draws: random.Random seeded by
    train.seed, the step and the round."""

    drops_groups = True  # a group whose every response was aborted leaves the round

    def __init__(self, o: DuetOptions, budget: int):
        super().__init__(o, budget)
        if o.marker and o.horizon + o.grace >= budget:
            raise ValueError(f"horizon: the abort check at horizon + grace = {o.horizon + o.grace} tokens must come "
                             f"before rollout.max_new_tokens = {budget}")
        self.tracker = ValueTracker()
        self.step, self.round = 0, 0  # the step and round of the last draws
        # the last select's importance weights, per group, over all its responses (empty without the abort rule)
        self.weights: list[Tensor] = []
        self.counts: list[int] = []  # the last allocation
        self.charged = 0  # tokens this step's rounds spent as an in-engine abort would have
        self.aborted = 0  # responses aborted this step
        self.judged = 0  # responses the abort rule judged this step
        self.dropped = 0  # groups the aborts left with fewer than min_rollouts responses, this step

    def marker(self) -> str | None:
        """The answer marker the length stage finds in each response (ScoredGroup.marker_end), None: no abort."""
        return self.o.marker or None

    def check_group_size(self, n: int) -> None:
        if total_rollouts(1, n, self.o.budget_scale) < self.o.min_rollouts:
            raise ValueError(f"budget_scale: {self.o.budget_scale} × rollout.n_samples={n} rollouts per prompt is "
                             f"below min_rollouts={self.o.min_rollouts}")

    def _begin(self, step: int) -> None:
        if step != self.step:
            self.step, self.round, self.charged, self.aborted, self.judged, self.dropped = step, 0, 0, 0, 0, 0

    def value(self, key: str, difficulty: int | None) -> float:
        """The surrogate's pass rate of a prompt: its own tracker once seen, else its difficulty level's pooled
        tracker, else the run's pooled one, else the prior."""
        for k in (key, pool_key(difficulty), pool_key(None)):
            if k in self.tracker.values:
                return self.tracker.value(k, self.o.tracker_options())
        return self.o.prior

    def allocate(self, keys: list[str], n_samples: int, difficulties: list | None = None) -> list[int]:
        """Each prompt's rollout count for this round (keys: stages.prompt_key of the prompts; difficulties: the
        task's level of each, None where it has none)."""
        o = self.o
        levels = difficulties if difficulties is not None else [None] * len(keys)
        scores = informativeness([self.value(k, d) for k, d in zip(keys, levels)], o.eps)
        self.counts = allocate_rollouts(scores, total_rollouts(len(keys), n_samples, o.budget_scale), o.min_rollouts)
        return self.counts

    def select(self, groups, step):
        self._begin(step)
        o, abort_at = self.o, self.o.abort_at()
        rng = random.Random(f"{NAME}/{self.seed}/{step}/{self.round}")
        self.round += 1
        kept, self.weights = [], []
        pooled: dict[str, list[float]] = {}  # this round's verdicts by pooled tracker (its level's, the run's)
        for g in groups:
            lengths = [int(x) for x in g.lengths]
            w = [1.0] * g.size
            if abort_at is not None:
                ends = [int(x) for x in g.marker_end] if getattr(g, "marker_end", None) is not None else [-1] * g.size
                judged = undecided(lengths, ends, abort_at)
                w = abort_weights(judged, [rng.random() for _ in judged], o.keep_prob)
                self.judged += sum(judged)
                self.aborted += sum(x == 0.0 for x in w)
            self.charged += sum(abort_at if x == 0.0 else L for x, L in zip(w, lengths))
            verdicts = [float(bool(c)) if x > 0 else 0.0 for c, x in zip(g.correct.tolist(), w)]
            self.tracker.update(g.prompt_key, verdicts, step, o.tracker_options())
            for k in dict.fromkeys((pool_key(g.difficulty), pool_key(None))):
                pooled.setdefault(k, []).extend(verdicts)
            weights = torch.tensor(w, dtype=torch.float64)
            if abort_at is not None:  # without the abort rule every weight is 1: Group.weights stays None
                self.weights.append(weights)
            idx = (weights > 0).nonzero()[:, 0].to(torch.int64)
            if idx.numel() < o.min_rollouts:  # the aborts left too few to compare: the group leaves the round
                self.dropped += 1
                idx = idx[:0]
            kept.append(idx)
        for k, verdicts in pooled.items():  # one visit per round: ρ forgets rounds, not groups
            self.tracker.update(k, verdicts, step, o.tracker_options())
        return kept

    def metrics(self):
        counts = self.counts or [0]
        return {"duet_rollouts_min": min(counts), "duet_rollouts_max": max(counts),
                "duet_tokens_charged": self.charged, "duet_aborted": self.aborted, "duet_judged": self.judged,
                "duet_groups_dropped": self.dropped}

    def state_dict(self):
        return {"tracker": self.tracker.state_dict(), "step": self.step, "round": self.round}

    def load_state_dict(self, state):
        if not state:
            return
        if set(state) != {"tracker", "step", "round"}:
            raise ValueError(f"length state: duet expects keys ['round', 'step', 'tracker'], got {sorted(state)}")
        for k in ("step", "round"):
            if isinstance(state[k], bool) or not isinstance(state[k], int) or state[k] < 0:
                raise ValueError(f"length state: duet {k} must be an int >= 0, got {state[k]!r}")
        self.tracker = ValueTracker(state["tracker"])
        self.step, self.round = state["step"], state["round"]


def pool_key(difficulty: int | None) -> str:
    """The pooled tracker of a difficulty level (None: of the whole run), beside the prompts' own keys (hex
    digests) in the one tracker."""
    return "pool:all" if difficulty is None else f"pool:difficulty={difficulty}"


def check_duet_config(cfg) -> None:
    """Config-time refusals of data.group_filter duet, naming the field: the round's budget below the floor, a
    floor below the estimator's group (algorithm.advantage's min_group), async rollouts (the allocation reads the
    tracker as the last round left it), multi-turn environments (their sampler draws rollout.n_samples per
    prompt)."""
    from megapo.algorithms.registry import get
    from megapo.config import ConfigError

    d = cfg.data
    if d.group_filter != NAME:
        return
    o = DuetOptions(**dict(d.group_filter_options))
    total = total_rollouts(d.prompts_per_step, cfg.rollout.n_samples, o.budget_scale)
    if total < o.min_rollouts * d.prompts_per_step:
        raise ConfigError("data.group_filter_options.budget_scale", f"duet's budget of {total} rollouts per round "
                          f"(budget_scale {o.budget_scale} × data.prompts_per_step {d.prompts_per_step} × "
                          f"rollout.n_samples {cfg.rollout.n_samples}) is below min_rollouts={o.min_rollouts} per "
                          "prompt")
    group_min = get("advantage", cfg.algorithm.advantage).min_group
    if o.min_rollouts < group_min:
        raise ConfigError("data.group_filter_options.min_rollouts", f"advantage {cfg.algorithm.advantage!r} "
                          f"compares at least {group_min} responses of a prompt; got min_rollouts={o.min_rollouts}")
    if cfg.train.mode != "sync":
        raise ConfigError("data.group_filter", "duet allocates each round's rollouts from the pass rates the rounds "
                          "before it measured; async rollouts draw ahead of them: use train.mode=sync")
    if cfg.env_factory() is not None:
        raise ConfigError("data.group_filter", "duet sets each prompt's rollout count; a multi-turn environment's "
                          "sampler draws rollout.n_samples per prompt: unset env or the filter")
