"""DUET's prompt-feature surrogate (Hu, Zhao, Xu and Jacoby 2026, DUET: Optimize Token-Budget Allocation for
Reinforcement Learning with Verifiable Rewards, arXiv:2605.08441): the paper's "lightweight pre-rollout surrogate
of prompt informativeness" as an online model of a prompt's pass rate from features of its prompt token ids, known
before any rollout, so a prompt never seen before gets a prediction of its own (the per-prompt Beta trackers of
megapo.algorithms.duet say nothing about it). The group filter duet uses it with
data.group_filter_options.surrogate: features.

    x(ids) = [1, log(1 + L)/8, hashed unigrams, hashed bigrams]  (L = len(ids); sparse, 2 + feature_buckets wide)
    p̂(ids) = σ(w·x(ids))
    fit, once per sampling round over its groups i (n_i verdicts, pass rate y_i), feature_steps times:
        w ← w − feature_lr · (Σ_i n_i (p̂_i − y_i) x_i / Σ_i n_i + feature_l2 · w with its bias entry 0)

Assumption: the paper does not say what its surrogate is; the features (a bias, the log prompt length, token
unigrams and bigrams hashed by blake2b into feature_buckets shared buckets, each family scaled by 1/√count so it has
unit norm when no bucket collides), the logistic model, its start (bias logit(prior), clipped to [0.01, 0.99], the
rest 0: an unfitted model predicts the prior), and its fit (full-batch gradient steps on the count-weighted binomial
log-loss of each round's observed pass rates, L2 on every weight but the bias) are ours.
"""

from __future__ import annotations

import hashlib
import math

LENGTH_SCALE = 8.0  # the length feature: log(1 + L)/8 (Assumption: 0.3 for 10 tokens, 1.0 for about 3000)


def bucket(gram: tuple[int, ...], buckets: int) -> int:
    """The hashed bucket of a token n-gram: blake2b (8 bytes, little-endian) of its ids joined by "," mod buckets;
    the same in every process and Python version (Python's hash is not)."""
    digest = hashlib.blake2b(",".join(str(int(t)) for t in gram).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


def prompt_features(ids: list[int], buckets: int) -> dict[int, float]:
    """x(ids), sparse {index: value}: 0 the bias (1), 1 the length log(1 + L)/8, 2 + bucket(g) for each unigram g
    (+1/√L each) and each bigram (+1/√(L − 1) each)."""
    x = {0: 1.0, 1: math.log1p(len(ids)) / LENGTH_SCALE}
    for n in (1, 2):
        grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
        for g in grams:
            j = 2 + bucket(g, buckets)
            x[j] = x.get(j, 0.0) + 1.0 / math.sqrt(len(grams))
    return x


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


class FeatureSurrogate:
    """The online logistic model p̂ = σ(w·x) (module docstring). `state_dict()` is JSON: the weights and the number
    of rounds fitted."""

    def __init__(self, buckets: int, prior: float, lr: float, steps: int, l2: float):
        self.buckets, self.lr, self.steps, self.l2 = buckets, lr, steps, l2
        p = min(max(prior, 0.01), 0.99)
        self.w = [0.0] * (2 + buckets)
        self.w[0] = math.log(p / (1.0 - p))
        self.fitted = 0  # rounds fitted

    def features(self, ids: list[int]) -> dict[int, float]:
        return prompt_features(ids, self.buckets)

    def predict(self, x: dict[int, float]) -> float:
        return _sigmoid(sum(self.w[j] * v for j, v in sorted(x.items())))

    def fit(self, xs: list[dict[int, float]], rates: list[float], counts: list[int]) -> None:
        """`steps` gradient steps on one round's groups: x_i, observed pass rate y_i over n_i verdicts."""
        total = float(sum(counts))
        if not xs or total <= 0:
            return
        for _ in range(self.steps):
            grad: dict[int, float] = {}
            for x, y, n in zip(xs, rates, counts):
                r = n * (self.predict(x) - y) / total
                for j, v in x.items():
                    grad[j] = grad.get(j, 0.0) + r * v
            if self.l2:
                for j in range(1, len(self.w)):
                    if self.w[j]:
                        grad[j] = grad.get(j, 0.0) + self.l2 * self.w[j]
            for j, g in grad.items():
                self.w[j] -= self.lr * g
        self.fitted += 1

    def state_dict(self) -> dict:
        return {"weights": list(self.w), "fitted": self.fitted}

    def load_state_dict(self, state: dict) -> None:
        w = state.get("weights") if isinstance(state, dict) else None
        if set(state or {}) != {"weights", "fitted"} or not isinstance(w, list) or len(w) != len(self.w) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in w):
            raise ValueError(f"length state: duet's feature surrogate expects {{'weights': {len(self.w)} finite "
                             f"numbers (2 + feature_buckets), 'fitted': int}}")
        if isinstance(state["fitted"], bool) or not isinstance(state["fitted"], int) or state["fitted"] < 0:
            raise ValueError(f"length state: duet's feature surrogate fitted must be an int >= 0, "
                             f"got {state['fitted']!r}")
        self.w, self.fitted = [float(v) for v in w], state["fitted"]
