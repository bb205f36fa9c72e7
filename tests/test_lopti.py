"""Lopti, Low-Probability Token Isolation (Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs;
megapo/algorithms/lopti.py, megapo.trainer.update.policy_updates): the token split written out as a loop; the two
optimizer steps per update on a tiny torch model equal a hand-written two-step SGD / Adam reference (scope rollout
and mini_batch); the halves' losses add up to the unsplit loss; the KL term goes with the high step; a bad eta is
refused naming algorithm.stages[i].eta; the fused on-policy step is off with lopti; update_policy runs the split."""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from megapo.algorithms.spec import LossSpec
from megapo.config import ConfigError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=2, seed=3)
F64 = torch.float64
V = 5  # the tiny model's vocabulary


# ----------------------------------------------------------------------------- the split, as a loop


def test_the_token_split_written_out_as_a_loop():
    from megapo.algorithms.lopti import low_fraction, low_prob_masks, split_weights

    old_logp = [[math.log(0.1), math.log(0.5), math.log(0.9)], [math.log(0.49), math.log(0.51)], []]
    eta = 0.5
    masks = low_prob_masks(old_logp, eta)
    for row, m in zip(old_logp, masks):
        assert m.tolist() == [math.exp(lp) < eta for lp in row]  # π_old(y_t) < η; 0.5 itself is high
    assert [m.tolist() for m in masks] == [[True, False, False], [True, False], []]
    weights = [[1.0, 2.0, 0.5], None, []]
    low, high = split_weights(masks, weights)
    for i, m in enumerate(masks):
        w = weights[i] if weights[i] is not None else [1.0] * len(m)
        assert low[i] == [w[t] if m[t] else 0.0 for t in range(len(m))]
        assert high[i] == [0.0 if m[t] else w[t] for t in range(len(m))]
    assert low_fraction(masks) == pytest.approx(2 / 5)
    assert low_fraction(masks, [[0, 1, 1], [1, 1], []]) == pytest.approx(1 / 4)  # policy tokens only
    assert low_prob_masks(old_logp, 0.95)[0].tolist() == [True, True, True]


# ----------------------------------------------------------------------------- a tiny learner


def bigram_logp(W: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """log π(y_t | y_{t-1}) at every position 1.. of `tokens` (a bigram table W[prev] -> logits)."""
    prev, nxt = torch.tensor(tokens[:-1]), torch.tensor(tokens[1:])
    return torch.log_softmax(W[prev], -1).gather(-1, nxt[:, None])[:, 0]


class TinyLearner:
    """A bigram model trained by policy_loss (token-mean over the mini-batch's tokens, the samples' token_weight);
    records each train step's token weights and LossSpec."""

    route_hook = None

    def __init__(self, W: torch.Tensor, optimizer: str, lr: float):
        self.W = W.clone().requires_grad_(True)
        self.opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)([self.W], lr=lr)
        self.calls = []

    def logprobs(self, sequences, with_entropy=False, prompt_lens=None):
        with torch.no_grad():
            return [bigram_logp(self.W, s) for s in sequences]

    def train_step(self, batch, loss):
        from megapo.algorithms import policy_loss
        from megapo.algorithms.sample import as_train_samples

        batch = as_train_samples(batch)
        self.calls.append(([s.token_weight for s in batch], loss))
        width = max(len(s.tokens) - s.prompt_len for s in batch)
        logp = torch.zeros(len(batch), width, dtype=F64)
        old, adv, tw = (torch.zeros(len(batch), width, dtype=F64) for _ in range(3))
        ref = torch.zeros(len(batch), width, dtype=F64)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        rows = []
        for i, s in enumerate(batch):
            n = len(s.tokens) - s.prompt_len
            rows.append(bigram_logp(self.W, s.tokens)[s.prompt_len - 1:])
            old[i, :n] = torch.tensor(s.old_logp, dtype=F64)
            adv[i, :n] = torch.as_tensor(s.advantage, dtype=F64).expand(n)
            tw[i, :n] = torch.tensor(s.token_weight, dtype=F64) if s.token_weight is not None else 1.0
            if s.ref_logp is not None:
                ref[i, :n] = torch.tensor(s.ref_logp, dtype=F64)
            mask[i, :n] = True
        logp = torch.stack([torch.cat([r, r.new_zeros(width - r.numel())]) for r in rows])
        kw = {"ref_logp": ref} if batch[0].ref_logp is not None else {}
        self.opt.zero_grad()
        out, _ = policy_loss(loss, logp, old, adv, mask, token_weight=tw, global_tokens=int(mask.sum()), **kw)
        out.backward()
        self.opt.step()
        return {"loss": float(out.detach())}


def samples(W: torch.Tensor) -> list[dict]:
    seqs = [([0, 1, 2, 3, 4], 2, 1.0), ([0, 4, 4, 1], 2, -0.5), ([1, 2, 0, 0, 3, 2], 3, 0.75), ([2, 3, 1], 1, -1.0)]
    out = []
    for tokens, plen, adv in seqs:
        with torch.no_grad():
            lp = bigram_logp(W, tokens)[plen - 1:]
        out.append({"tokens": tokens, "prompt_len": plen, "advantage": adv, "old_logp": lp.tolist()})
    return out


def reference_step(W: torch.Tensor, opt, batch: list[dict], keep, eps: float = 0.2) -> None:
    """One optimizer step on the PPO-clip loss written as a loop: Σ over the tokens `keep(p)` selects (p = π_old)
    of max(-A·r, -A·clip(r, 1-ε, 1+ε)), divided by every token of the mini-batch."""
    total, n = 0.0, 0
    for s in batch:
        lp = bigram_logp(W, s["tokens"])[s["prompt_len"] - 1:]
        for t, old in enumerate(s["old_logp"]):
            n += 1
            if not keep(math.exp(old)):
                continue
            r = torch.exp(lp[t] - old)
            a = s["advantage"]
            total = total + torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps, 1 + eps))
    if isinstance(total, float):  # no token of this half: no step
        return
    opt.zero_grad()
    (total / n).backward()
    opt.step()


@pytest.mark.parametrize("optimizer, lr", [("sgd", 2.0), ("adam", 0.3)])
@pytest.mark.parametrize("scope", ["rollout", "mini_batch"])
def test_two_steps_equal_a_hand_written_reference(optimizer, lr, scope):
    from megapo.trainer.update import policy_updates

    torch.manual_seed(0)
    W0 = torch.randn(V, V, dtype=F64)
    cfg = make_cfg(stages=[{"name": "lopti", "eta": 0.15, "scope": scope}])
    cfg.train.updates_per_rollout = 2
    bounds = [(0, 2), (2, 4)]  # two mini-batches
    batch = samples(W0)
    for lo, hi in bounds:  # both halves have tokens in each mini-batch
        probs = [math.exp(x) for s in batch[lo:hi] for x in s["old_logp"]]
        assert any(p < 0.15 for p in probs) and any(p >= 0.15 for p in probs)
    learner = TinyLearner(W0, optimizer, lr)
    last, metrics = policy_updates(learner, batch, bounds, cfg, LossSpec.of("ppo", "token-mean"))

    W = W0.clone().requires_grad_(True)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)([W], lr=lr)
    low, high = (lambda p: p < 0.15), (lambda p: p >= 0.15)
    if scope == "rollout":  # every low step, then every high step
        order = [(keep, b) for keep in (low, high) for _ in range(2) for b in bounds]
    else:  # per mini-batch: its low step, then its high step
        order = [(keep, b) for _ in range(2) for b in bounds for keep in (low, high)]
    for keep, (lo, hi) in order:
        reference_step(W, opt, batch[lo:hi], keep)
    assert torch.allclose(learner.W.detach(), W.detach(), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(W.detach(), W0)
    assert metrics["lopti/low_steps"] == 4 and metrics["lopti/high_steps"] == 4
    assert metrics["lopti/high_loss"] == last["loss"]
    # what the learner saw: weights selecting the half, never both
    for weights, _ in learner.calls:
        assert all(w is not None and all(x in (0.0, 1.0) for x in w) for w in weights)


def test_the_halves_add_up_to_the_unsplit_loss():
    from megapo.algorithms import policy_loss
    from megapo.algorithms.lopti import low_prob_masks, split_weights

    torch.manual_seed(1)
    S, T = 3, 4
    old = torch.log(torch.rand(S, T, dtype=F64) * 0.98 + 0.01)
    logp = (old + 0.3 * torch.randn(S, T, dtype=F64)).requires_grad_(True)
    adv = torch.randn(S, T, dtype=F64)
    mask = torch.ones(S, T, dtype=torch.bool)
    mask[2, 3] = False
    w = torch.rand(S, T, dtype=F64)
    low, high = split_weights(low_prob_masks([r.tolist() for r in old]), [r.tolist() for r in w])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        parts = []
        for half in (None, low, high):
            tw = w if half is None else torch.tensor(half, dtype=F64)
            loss, _ = policy_loss(LossSpec.of("ppo", agg), logp, old, adv, mask, token_weight=tw)
            logp.grad = None
            loss.backward()
            parts.append((float(loss.detach()), logp.grad.clone()))
        assert parts[0][0] == pytest.approx(parts[1][0] + parts[2][0], rel=1e-12, abs=1e-14), agg
        assert torch.allclose(parts[0][1], parts[1][1] + parts[2][1], rtol=1e-12, atol=1e-14), agg


def test_the_kl_term_goes_with_the_high_step_and_an_empty_half_takes_no_step():
    from megapo.trainer.update import policy_updates

    torch.manual_seed(2)
    W0 = torch.randn(V, V, dtype=F64)
    cfg = make_cfg(stages=[{"name": "lopti", "eta": 0.2}])
    batch = samples(W0)
    for s in batch:
        s["ref_logp"] = [x - 0.1 for x in s["old_logp"]]
    learner = TinyLearner(W0, "sgd", 0.1)
    spec = LossSpec.of("ppo", "token-mean", kl_coef=0.05, entropy_coef=0.0)
    policy_updates(learner, batch, [(0, 4)], cfg, spec)
    assert [c[1].kl_coef for c in learner.calls] == [0.0, 0.05]
    assert all("token_weight" not in s for s in batch)  # the caller's samples are not touched
    # η so low that no token is below it: the high step only, the full weights
    cfg = make_cfg(stages=[{"name": "lopti", "eta": 1e-9}])
    learner = TinyLearner(W0, "sgd", 0.1)
    _, metrics = policy_updates(learner, batch, [(0, 4)], cfg, spec)
    assert metrics["lopti/low_steps"] == 0 and metrics["lopti/high_steps"] == 1 and "lopti/low_loss" not in metrics
    assert learner.calls[0][0] == [[1.0] * (len(s["tokens"]) - s["prompt_len"]) for s in batch]


def test_without_lopti_the_updates_are_the_plain_ones():
    from megapo.trainer.update import policy_updates

    W0 = torch.zeros(V, V, dtype=F64)
    cfg = make_cfg()
    cfg.train.updates_per_rollout = 2
    learner = TinyLearner(W0, "sgd", 0.1)
    _, metrics = policy_updates(learner, samples(W0), [(0, 2), (2, 4)], cfg, LossSpec.of("ppo", "token-mean"))
    assert metrics == {} and len(learner.calls) == 4 and all(w == [None, None] for w, _ in learner.calls)


# ----------------------------------------------------------------------------- config and the loop


@pytest.mark.parametrize("eta", [0, 1, 1.5, -0.2, True, "half", float("nan")])
def test_a_bad_eta_is_refused_naming_its_field(eta):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "advantage_reweighting"}, {"name": "lopti", "eta": eta}])
    assert err.value.field == "algorithm.stages[1].eta"
    assert "(0, 1)" in str(err.value) or "finite" in str(err.value)  # nan: the config loader's own refusal


def test_other_refusals():
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "lopti", "scope": "epoch"}])
    assert err.value.field == "algorithm.stages[0].scope"
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "lopti"}, {"name": "lopti", "eta": 0.2}])
    assert err.value.field == "algorithm.stages[1]" and "twice" in str(err.value)


def test_on_policy_is_off_with_lopti_and_the_stage_reports_the_share():
    from megapo.trainer.update import on_policy, token_stages

    class FusedLearner:
        def train_step_on_policy(self, *a, **k):
            raise AssertionError("not called")

    assert on_policy(make_cfg(), FusedLearner())
    cfg = make_cfg(stages=[{"name": "lopti"}])
    assert not on_policy(cfg, FusedLearner()) and cfg.algorithm.needs_old_stats()
    batch = [{"advantage": 1.0, "old_logp": [math.log(0.2), math.log(0.7)]},
             {"advantage": -1.0, "old_logp": [math.log(0.9), math.log(0.4)], "loss_mask": [1, 0]}]
    metrics = token_stages(batch, cfg, step=1)
    assert metrics == {"lopti/low_frac": pytest.approx(1 / 3)}  # 0.2 of the 3 policy tokens
    assert all("token_weight" not in s for s in batch)


def test_update_policy_runs_the_two_steps():
    from megapo.engines.base import Sample
    from megapo.tasks.base import Example
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.rollout import Group
    from megapo.trainer.update import update_policy

    torch.manual_seed(3)
    W0 = torch.randn(V, V, dtype=F64)
    cfg = make_cfg(stages=[{"name": "advantage_reweighting"}, {"name": "lopti", "eta": 0.3}])
    groups = [Group(Example("p", "a"), [Sample([0, 1], [2, 3, 4], [-1.0] * 3, "stop", 1),
                                        Sample([0, 1], [4, 4, 1], [-1.0] * 3, "stop", 1)], [1.0, 0.0])]
    learner = TinyLearner(W0, "sgd", 0.5)
    out = update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer())
    probs = [math.exp(x) for s in ([0, 1, 2, 3, 4], [0, 1, 4, 4, 1]) for x in bigram_logp(W0, s)[1:].tolist()]
    assert out["lopti/low_frac"] == pytest.approx(sum(p < 0.3 for p in probs) / len(probs))
    assert 0 < out["lopti/low_frac"] < 1 and len(learner.calls) == 2
    low, high = (c[0] for c in learner.calls)
    flat_low = [x for w in low for x in w]
    assert flat_low == [1.0 if p < 0.3 else 0.0 for p in probs]
    assert [x for w in high for x in w] == [1.0 - x for x in flat_low]
    assert {"lopti/low_loss", "lopti/high_loss", "train/loss"} <= set(out)
