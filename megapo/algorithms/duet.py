"""DUET: Hu, Zhao, Xu and Jacoby 2026, DUET: Optimize Token-Budget Allocation for Reinforcement Learning with
Verifiable Rewards (arXiv:2605.08441). DUal-controlled tokEn allocaTion, a layer over GRPO with two controls under
one shared budget: (i) a lightweight pre-rollout surrogate of each prompt's informativeness sets how many rollouts
it receives; (ii) a marker-gated abort rule with importance reweighting sets when a rollout stops.

It is the group filter `duet` (data.group_filter: duet), because both of its halves act where megapo's group
filters act, on each sampling round of rank 0 (megapo.trainer.length_stage): the rollout asks it for each prompt's
rollout count before the engine runs (`Duet.allocate`, megapo.trainer.rollout.rollout_round draws prompt i n_i
times), and it judges each round's responses after the verifier (`Duet.select`, the abort rule; the kept
responses' importance weights go to Group.weights and from there into every token's loss weight,
TrainSample.token_weight). The surrogate is per-prompt Beta trackers of the verdicts (surrogate: tracker, the
default) or, for prompts never seen before (a large task split), an online logistic model of the pass rate from
features of the prompt's token ids, combined with a prompt's own tracker once it has one (surrogate: features,
megapo/algorithms/duet_surrogate.py; Assumption: all of it ours). Its state (the trackers, the feature model's
weights, the step and round of its draws) travels in the checkpoint with the length stage's
(TrainerState.extra["length"]["group_filter"]), so a resumed run allocates and aborts as the unstopped one.

Where the abort happens (the seam): each rollout's keep draw is made before generation (`Duet.abort_plan`: one
uniform per rollout of the round, in the round's order, random.Random seeded by train.seed, the step and the
round; keep when < keep_prob). An engine whose capabilities say abort_rule (the embedded engine) gets them with the
marker check as `SamplingParams.abort` (megapo.engines.base.AbortRule, built by LengthStage.abort_params): it stops
a rollout still running at H + G tokens with no marker in them unless it drew keep (finish_reason "abort", its
H + G tokens those of the unstopped rollout), so an aborted rollout spends H + G decode tokens and no more. An
engine that cannot stop a request on a marker rule (the vLLM and SGLang servers, a Router) generates every rollout
to its end and `select` aborts after generation; the run logs once which path it takes. `select` reads the same
uniforms on both paths and judges an engine-stopped rollout (exactly H + G tokens, not ended by a stop token) as
the post-hoc rule judges the full one, so the kept rollouts, their weights and the tracker's verdicts are the same.

    data: {group_filter: duet, group_filter_options: {budget_scale: 1.0, min_rollouts: 2}}
    data: {group_filter: duet, group_filter_options: {surrogate: features, feature_buckets: 1024}}
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

from megapo.algorithms.duet_surrogate import FeatureSurrogate
from megapo.algorithms.length import GroupFilter
from megapo.algorithms.registry import register
from megapo.algorithms.value_tracker import SPOOptions, ValueTracker

PAPER = ("Hu, Zhao, Xu and Jacoby 2026, DUET: Optimize Token-Budget Allocation for Reinforcement Learning with "
         "Verifiable Rewards (arXiv:2605.08441), DUET")
NAME = "duet"
SURROGATES = ("tracker", "features")


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
    # the surrogate: "tracker" (the per-prompt Beta trackers above) or "features" (Assumption, ours: an online
    # logistic model of the pass rate from hashed unigrams and bigrams and the length of the prompt's token ids,
    # megapo.algorithms.duet_surrogate, fitted on each round's pass rates; a prompt with tracker history gets
    # v̂ = (α + feature_count·p̂)/(α + β + feature_count), one without it p̂)
    surrogate: str = "tracker"
    feature_buckets: int = 1024  # hashed n-gram buckets (Assumption)
    feature_lr: float = 1.0  # gradient step size (Assumption)
    feature_steps: int = 4  # full-batch gradient steps per sampling round (Assumption)
    feature_l2: float = 1e-4  # L2 on every weight but the bias (Assumption)
    feature_count: float = 2.0  # pseudo-samples behind p̂ beside a prompt's own tracker (Assumption)
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
        if self.surrogate not in SURROGATES:
            raise ValueError(f"surrogate: must be one of {list(SURROGATES)}, got {self.surrogate!r}")
        _int("feature_buckets", self.feature_buckets, 1)
        _number("feature_lr", self.feature_lr, 0.0, math.inf, open_low=True, open_high=True)
        _int("feature_steps", self.feature_steps, 1)
        _number("feature_l2", self.feature_l2, 0.0, math.inf, open_high=True)
        _number("feature_count", self.feature_count, 0.0, math.inf, open_high=True)
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


def undecided(lengths: list[int], ends: list[int], abort_at: int, stopped: list[bool] | None = None) -> list[bool]:
    """The responses the abort rule judges: no marker within their first H + G tokens and still running there
    (more than H + G tokens, or exactly H + G not ended by a stop token: the engine stopped it there, its in-engine
    abort; `stopped`: each ended with a stop token, None: all did). The others are kept at weight 1: their marker
    came in time, or they ended first."""
    stopped = stopped if stopped is not None else [True] * len(lengths)
    return [(L > abort_at or (L == abort_at and not s)) and not 0 < e <= abort_at
            for L, e, s in zip(lengths, ends, stopped)]


def keeps(uniforms: list[float], keep_prob: float) -> list[bool]:
    """Each rollout's "keep" draw, made before generation: its uniform < q. A judged rollout that drew keep runs to
    its end (abort_weights: 1/q), one that did not is aborted; the in-engine abort (SamplingParams.abort) reads the
    same draws."""
    return [u < keep_prob for u in uniforms]


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
    with surrogate features, p̂_i = σ(w·x_i) from the features x_i of prompt i's token ids (bias, log length, hashed
    unigrams and bigrams; megapo.algorithms.duet_surrogate) and v̂_i = (α_i + m·p̂_i)/(α_i + β_i + m) once the
    prompt has its own tracker, else p̂_i (m = feature_count), w fitted after each round by feature_steps gradient
    steps on the count-weighted log-loss of the round's pass rates;
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
    variance v̂(1 − v̂) + eps; the feature model, its features, its fit and its combination with a prompt's tracker
    as feature_count pseudo-samples at p̂), the allocation (proportional to u above a floor of min_rollouts,
    largest-remainder rounding, ties to the earlier prompt, one budget per sampling round in rollouts, not tokens), the aborted
    response leaving the batch (weight 0) and a group the aborts left below min_rollouts leaving it (the estimator
    compares responses within a group) are ours; the paper's keep probability (0.05) and marker gating are
    transcribed. The abort runs in the engine where the engine can stop a request on the marker rule (the
    embedded engine: an aborted response ends at H + G tokens), else after generation on the whole responses, with
    the same draws, samples kept and weights (length/duet_tokens_charged counts H + G per aborted response, what the
    in-engine abort spends; length/duet_engine_aborted the aborts the engine made); the paper's stop
    shortly after a marker is not applied (a response ends at its stop token). Draws: random.Random seeded by
    train.seed, the step and the round, one uniform per rollout of the round drawn before generation."""

    drops_groups = True  # a group whose every response was aborted leaves the round

    def __init__(self, o: DuetOptions, budget: int):
        super().__init__(o, budget)
        if o.marker and o.horizon + o.grace >= budget:
            raise ValueError(f"horizon: the abort check at horizon + grace = {o.horizon + o.grace} tokens must come "
                             f"before rollout.max_new_tokens = {budget}")
        self.tracker = ValueTracker()
        # surrogate features: the online pass-rate model of the prompts' token ids (None: the trackers alone)
        self.features = FeatureSurrogate(o.feature_buckets, o.prior, o.feature_lr, o.feature_steps, o.feature_l2) \
            if o.surrogate == "features" else None
        # the last allocate's prompts, by key: (features x, the model's p̂, the trackers' v̂); select fits on them
        # (one round's, never across a checkpoint: allocate and select run in the same round)
        self.pending: dict[str, tuple[dict, float, float]] = {}
        self.brier = [0.0, 0.0, 0]  # this step's Σ n(p̂ − y)², Σ n(v̂ − y)², Σ n over the fitted groups
        self.step, self.round = 0, 0  # the step and round of the last draws
        # the last select's importance weights, per group, over all its responses (empty without the abort rule)
        self.weights: list[Tensor] = []
        self.counts: list[int] = []  # the last allocation
        self.charged = 0  # tokens this step's rounds spend with the in-engine abort (H + G per aborted)
        self.aborted = 0  # responses aborted this step
        self.engine_aborted = 0  # of them, those the engine stopped at H + G (SamplingParams.abort)
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
            self.engine_aborted = 0
            self.brier = [0.0, 0.0, 0]

    def draws(self, step: int, rollouts: int) -> list[float]:
        """This round's uniform per rollout, in the round's order (prompt by prompt, each prompt's rollouts in
        turn), from random.Random seeded by (train.seed, step, round): the same before generation (abort_plan) and
        after it (select), and in a resumed run (the step and round travel in the checkpoint)."""
        self._begin(step)
        rng = random.Random(f"{NAME}/{self.seed}/{step}/{self.round}")
        return [rng.random() for _ in range(rollouts)]

    def abort_plan(self, step: int, rollouts: int) -> tuple[int, list[bool]] | None:
        """The in-engine abort of this round's `rollouts` rollouts (None without a marker): H + G, where the engine
        judges a rollout still running, and each rollout's keep draw (keeps, on the uniforms select reads). The
        length stage hands them to the engine with the marker check select applies (LengthStage.abort_params,
        megapo.engines.base.AbortRule)."""
        at = self.o.abort_at()
        return None if at is None else (at, keeps(self.draws(step, rollouts), self.o.keep_prob))

    def value(self, key: str, difficulty: int | None) -> float:
        """The surrogate's pass rate of a prompt: its own tracker once seen, else its difficulty level's pooled
        tracker, else the run's pooled one, else the prior."""
        for k in (key, pool_key(difficulty), pool_key(None)):
            if k in self.tracker.values:
                return self.tracker.value(k, self.o.tracker_options())
        return self.o.prior

    def feature_value(self, key: str, difficulty: int | None, ids: list[int]) -> float:
        """surrogate features: v̂ = (α + m·p̂)/(α + β + m) for a prompt with its own tracker (α, β; m =
        feature_count), p̂ for one without (the model's bias stands in for the pooled trackers); p̂ = σ(w·x(ids)).
        Remembers x, p̂ and the trackers' own v̂ for select's fit."""
        x = self.features.features(ids)
        p = self.features.predict(x)
        self.pending[key] = (x, p, self.value(key, difficulty))
        if key not in self.tracker.values:
            return p
        alpha, beta, _ = self.tracker.values[key]
        m = self.o.feature_count
        return (alpha + m * p) / (alpha + beta + m)

    def allocate(self, keys: list[str], n_samples: int, difficulties: list | None = None,
                 prompt_ids: list[list[int]] | None = None) -> list[int]:
        """Each prompt's rollout count for this round (keys: stages.prompt_key of the prompts; difficulties: the
        task's level of each, None where it has none; prompt_ids: each prompt's token ids, which surrogate features
        reads)."""
        o = self.o
        levels = difficulties if difficulties is not None else [None] * len(keys)
        if self.features is None:
            values = [self.value(k, d) for k, d in zip(keys, levels)]
        elif prompt_ids is None or len(prompt_ids) != len(keys):
            raise ValueError("surrogate: features predicts from each prompt's token ids; allocate was given "
                             f"{'none' if prompt_ids is None else len(prompt_ids)} for {len(keys)} prompts")
        else:
            self.pending = {}
            values = [self.feature_value(k, d, list(ids)) for k, d, ids in zip(keys, levels, prompt_ids)]
        scores = informativeness(values, o.eps)
        self.counts = allocate_rollouts(scores, total_rollouts(len(keys), n_samples, o.budget_scale), o.min_rollouts)
        return self.counts

    def select(self, groups, step):
        o, abort_at = self.o, self.o.abort_at()
        uniforms = iter(self.draws(step, sum(g.size for g in groups)))
        self.round += 1
        kept, self.weights = [], []
        pooled: dict[str, list[float]] = {}  # this round's verdicts by pooled tracker (its level's, the run's)
        rates: list[float] = []  # each group's pass rate, for the feature model
        for g in groups:
            lengths = [int(x) for x in g.lengths]
            w = [1.0] * g.size
            if abort_at is not None:
                ends = [int(x) for x in g.marker_end] if getattr(g, "marker_end", None) is not None else [-1] * g.size
                judged = undecided(lengths, ends, abort_at, [not bool(x) for x in g.truncated])
                w = abort_weights(judged, [next(uniforms) for _ in judged], o.keep_prob)
                self.judged += sum(judged)
                self.aborted += sum(x == 0.0 for x in w)
                self.engine_aborted += sum(x == 0.0 and L == abort_at for x, L in zip(w, lengths))
            self.charged += sum(abort_at if x == 0.0 else L for x, L in zip(w, lengths))
            verdicts = [float(bool(c)) if x > 0 else 0.0 for c, x in zip(g.correct.tolist(), w)]
            rates.append(sum(verdicts) / len(verdicts) if verdicts else 0.0)
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
        if self.features is not None:
            self.fit_features(groups, rates)
        return kept

    def fit_features(self, groups, rates: list[float]) -> None:
        """One fit of the feature model on this round's groups that allocate saw (their x and pass rates y over
        all drawn responses, an aborted one a failure; a prompt drawn twice in one round: its first group); the
        step's Brier sums of p̂ and of the trackers' v̂ (both
        as allocate read them) against y."""
        xs, ys, ns = [], [], []
        for g, y in zip(groups, rates):
            if g.prompt_key not in self.pending:
                continue
            x, p, v = self.pending.pop(g.prompt_key)
            xs.append(x)
            ys.append(y)
            ns.append(g.size)
            self.brier[0] += g.size * (p - y) ** 2
            self.brier[1] += g.size * (v - y) ** 2
            self.brier[2] += g.size
        self.features.fit(xs, ys, ns)

    def metrics(self):
        counts = self.counts or [0]
        return {"duet_rollouts_min": min(counts), "duet_rollouts_max": max(counts),
                "duet_tokens_charged": self.charged, "duet_aborted": self.aborted, "duet_judged": self.judged,
                "duet_engine_aborted": self.engine_aborted,
                "duet_groups_dropped": self.dropped,
                **self.feature_metrics()}

    def feature_metrics(self) -> dict:
        """surrogate features: this step's count-weighted Brier scores, before each round's fit, of the feature
        model's p̂ and of what the trackers alone would have predicted (their v̂), against the groups' pass rates."""
        if self.features is None or not self.brier[2]:
            return {}
        n = self.brier[2]
        return {"duet_feature_brier": self.brier[0] / n, "duet_tracker_brier": self.brier[1] / n}

    def state_dict(self):
        state = {"tracker": self.tracker.state_dict(), "step": self.step, "round": self.round}
        if self.features is not None:
            state["features"] = self.features.state_dict()
        return state

    def load_state_dict(self, state):
        if not state:
            return
        keys = {"tracker", "step", "round"} | ({"features"} if self.features is not None else set())
        if set(state) != keys:
            raise ValueError(f"length state: duet (surrogate {self.o.surrogate}) expects keys {sorted(keys)}, "
                             f"got {sorted(state)}")
        if self.features is not None:
            self.features.load_state_dict(state["features"])
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
