"""Stage soup: SOUP's token-level mix-policy samples (megapo/algorithms/soup.py, megapo/trainer/soup.py; SOUP:
Token-level Single-sample Mix-policy Reinforcement Learning for Large Language Models, arXiv:2601.21476).

Checked: the mixing rule (slots, prefix shares, prefix lengths) against loops written out here; the loss's per-token
ratio (π_θ/μ on the historical prefix, π_θ/π_old on the continuation, the objective's clip on both) against the
clipped surrogate written out, and its float64 gradient against finite differences; two steps of the loop with a
scripted engine and a recording learner, token by token (the continuation prompts x ⊕ prefix and budgets, the mixed
samples' tokens, μ, routes, rewards, and the trained π_old); the old-log-prob pass's mismatch metrics over the
tokens this step's engine sampled only and soup/prefix_k3 over the prefixes, against k3 written out; the learner's
train/mismatch_* (the stage's mismatch_mask; policy_loss over shards, update_policy, a real tiny learner over several
micro-batches) over those tokens too, and as before without prefixes, against k3 written out; a resumed run
mixes as the unstopped one (the buffer in the checkpoint state, through JSON); config refusals naming the field;
`megapo train` with the stage on, stopped after a checkpoint and resumed, against the unstopped run.
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial

import numpy as np
import pytest
import torch

from megapo.algorithms.soup import mixed_slots, prefix_fractions, prefix_length, run_soup_stage
from megapo.config import ConfigError
from megapo.engines.base import Sample

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from test_self_distill import CharTokenizer, CountingLearner, stand_in_logp  # noqa: E402
from objective_loops import objectives_listing  # noqa: E402
from scripted_engine import ScriptedEngine, Source  # noqa: E402
from train_runs import train_rows  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=4)
F64 = torch.float64
EOS = 2


# ----------------------------------------------------------------------------- the mixing rule


@pytest.mark.parametrize("n, mix", [(8, 2), (4, 1), (4, 3), (2, 5), (1, 1)])
def test_mixed_slots_against_a_loop(n, mix):
    want = []
    for slot in range(n):  # the last `mix` slots, slot 0 always on-policy
        if slot >= n - mix and slot != 0:
            want.append(slot)
    assert mixed_slots(n, mix) == want


def test_prefix_length_against_a_loop():
    for length in range(0, 10):
        for stopped in (False, True):
            for frac in (0.01, 0.2, 0.5, 0.77, 1.0):
                for max_new in (2, 5, 9):
                    usable = length - 1 if stopped else length
                    usable = min(usable, max_new - 1)
                    want = 0 if usable < 1 else min(usable, max(1, int(round(frac * usable))))
                    got = prefix_length(length, stopped, frac, max_new)
                    assert got == want
                    assert 0 <= got <= max(0, max_new - 1) and (got == 0 or got <= length - stopped)


def test_prefix_fractions_seeded_and_in_range():
    a = prefix_fractions(3, 5, 17, 4, 0.2, 0.8)
    assert a == prefix_fractions(3, 5, 17, 4, 0.2, 0.8)  # a resumed run draws the same
    assert all(0.2 <= f <= 0.8 for f in a) and len(a) == 4
    assert a != prefix_fractions(3, 6, 17, 4, 0.2, 0.8) and a != prefix_fractions(3, 5, 18, 4, 0.2, 0.8)
    assert prefix_fractions(0, 1, 0, 3, 0.5, 0.5) == [0.5] * 3


# ----------------------------------------------------------------------------- the loss's ratio


class _X:
    def __init__(self, n, old, mu):
        self.tokens, self.prompt_len = list(range(3 + n)), 3
        self.old_logp, self.rollout_logp = list(old), list(mu)


def test_stage_sets_mu_on_the_prefix_only():
    from megapo.algorithms.pipeline import TokenContext

    old, mu = [-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7, -0.8]
    batch = [_X(4, old, mu), _X(4, old, mu)]
    ctx = TokenContext(group_size=2, step=1, seed=0, kl_coef=0.0, soup_prefix=[0, 3])
    m = run_soup_stage(batch, None, ctx)
    assert batch[0].old_logp == old  # on-policy: untouched
    assert batch[1].old_logp == [-0.5, -0.6, -0.7, -0.4]
    assert m["soup/prefix_frac"] == 3 / 8
    assert m["soup/prefix_log_ratio"] == pytest.approx(((-0.1 + 0.5) + (-0.2 + 0.6) + (-0.3 + 0.7)) / 3, abs=1e-15)


def ppo_by_hand(logp, old, mu, adv, prefix, eps_low=0.2, eps_high=0.2):
    """The clipped surrogate with SOUP's per-token ratio, token-mean over the response, written out."""
    terms = []
    for t in range(len(logp)):
        denom = mu[t] if t < prefix else old[t]
        r = math.exp(logp[t] - denom)
        clipped = min(max(r, 1 - eps_low), 1 + eps_high)
        terms.append(-min(r * adv, clipped * adv))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("adv", [1.3, -0.7])
def test_loss_ratio_is_pi_over_mu_on_the_prefix(adv):
    from megapo.algorithms.loss import policy_loss
    from megapo.algorithms.pipeline import TokenContext

    g = torch.Generator().manual_seed(0)
    n, L = 7, 3
    logp = (-torch.rand(n, generator=g, dtype=F64) * 2).tolist()
    old = [v + 0.1 * float(torch.randn(1, generator=g, dtype=F64)) for v in logp]
    mu = [v + 0.4 * float(torch.randn(1, generator=g, dtype=F64)) for v in logp]  # a historical policy, further off
    x = _X(n, old, mu)
    run_soup_stage([x], None, TokenContext(group_size=1, step=1, seed=0, kl_coef=0.0, soup_prefix=[L]))
    lp = torch.tensor([logp], dtype=F64, requires_grad=True)
    loss, _ = policy_loss("ppo", lp, torch.tensor([x.old_logp], dtype=F64), torch.full((1, n), adv, dtype=F64),
                          torch.ones(1, n, dtype=F64), loss_agg="token-mean", eps_low=0.2, eps_high=0.2)
    assert float(loss.detach()) == pytest.approx(ppo_by_hand(logp, old, mu, adv, L), rel=1e-12, abs=1e-14)
    loss.backward()
    h = 1e-6  # float64 central differences of the written-out loss
    for t in range(n):
        up, down = list(logp), list(logp)
        up[t] += h
        down[t] -= h
        fd = (ppo_by_hand(up, old, mu, adv, L) - ppo_by_hand(down, old, mu, adv, L)) / (2 * h)
        assert float(lp.grad[0, t]) == pytest.approx(fd, rel=1e-6, abs=1e-9)
    # the prefix's ratio is far enough from 1 that some prefix token is clipped where its continuation twin is not
    assert any(abs(math.exp(logp[t] - mu[t]) - 1) > 0.2 for t in range(L))


# ----------------------------------------------------------------------------- the loop with a scripted engine


class PrefixEngine(ScriptedEngine):
    """Behind a prompt it knows: its scripted responses; behind prompt ⊕ prefix: the continuation "9" then EOS (cut
    at the budget). Log-probs: −0.01 · (step + 1) per token, step the engine's call count; routes 7 + call count."""

    def __init__(self, plain: dict[tuple, list[str]]):
        self.plain, self.calls, self.weight_version = plain, [], 1

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        c = len(self.calls)
        out = []
        for p in prompts:
            key = next((k for k in self.plain if tuple(p[:len(k)]) == k), None)
            if tuple(p) == key:
                out.append([self._sample(p, t, params, c) for t in self.plain[key][:params.n]])
            else:
                out.append([self._sample(p, "9", params, c)])
        return out

    def _sample(self, prompt, text, params, c):
        ids = ([ord(ch) for ch in text] + [EOS])[:params.max_new_tokens]
        finish = "stop" if ids[-1] == EOS else "length"
        routes = np.full((len(prompt) + len(ids) - 1, 1, 1), 7 + c, np.int32) if params.return_routes else None
        return Sample(list(prompt), ids, [-0.01 * c] * len(ids), finish, self.weight_version, routes)


def _reward(tok):
    return lambda pairs: [float(tok.decode(s.output_ids[:-1] if s.finish_reason == "stop" else s.output_ids)
                                == e.answer) for e, s in pairs]


def _setup(max_new=6, **options):
    from megapo.tasks.base import Example
    from megapo.trainer.data import encode_example
    from megapo.trainer.rollout import sampling_params
    from megapo.trainer.soup import soup_rollouts

    tok = CharTokenizer()
    options = options or {"mix": 2, "prefix_min": 0.5, "prefix_max": 0.5}
    cfg = make_cfg(stages=[{"name": "soup", **options}], routing_replay="r3")
    cfg.data.prompts_per_step = 1
    cfg.rollout.max_new_tokens = max_new
    ex = Example("1+2=", "3")
    prompt = encode_example(tok, ex, False)
    engine = PrefixEngine({tuple(prompt): ["3", "45", "3", "678"]})
    params = sampling_params(cfg, EOS, routes=True)
    return tok, cfg, ex, prompt, engine, params, soup_rollouts(cfg, params)


def test_two_steps_token_by_token():
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.rollout import collect_rollouts
    from megapo.trainer.update import update_policy

    tok, cfg, ex, prompt, engine, params, soup = _setup()
    soup.step = 1
    groups, metrics, _ = collect_rollouts(engine, params, [(ex, prompt)], Source(), _reward(tok), cfg, soup=soup)
    assert len(engine.calls) == 1 and metrics["soup/mixed"] == 0  # nothing stored before step 1
    assert groups[0].prefix_lens == [0, 0, 0, 0]
    stored = soup.buffer.entries[0]
    assert stored["step"] == 1 and [r["ids"] for r in stored["responses"]] == [[ord("3"), EOS], [ord("4"), ord("5"), EOS]]
    assert stored["responses"][0]["logp"] == [-0.01, -0.01] and all(r["stop"] for r in stored["responses"])

    soup.step = 2
    groups, metrics, tokens = collect_rollouts(engine, params, [(ex, prompt)], Source(), _reward(tok), cfg, soup=soup)
    # slots 2, 3 mixed with stored responses 0 ("3" EOS: usable 1, prefix 1) and 1 ("45" EOS: usable 2, prefix 1)
    (g,) = groups
    assert g.prefix_lens == [0, 0, 1, 1]
    (cont_prompts, cont_params), = engine.calls[2:]  # one budget (6 − 1): one call
    assert cont_prompts == [prompt + [ord("3")], prompt + [ord("4")]]
    assert cont_params.n == 1 and cont_params.max_new_tokens == 5 and cont_params.return_routes
    s2, s3 = g.samples[2], g.samples[3]
    assert s2.prompt_ids == prompt and s2.output_ids == [ord("3"), ord("9"), EOS]
    assert s3.output_ids == [ord("4"), ord("9"), EOS]
    assert s2.logprobs == [-0.01, -0.03, -0.03]  # μ of the step-1 draw, then the continuation call's (3rd call)
    assert s2.token_versions == [1, 1, 1] and s2.finish_reason == "stop"
    assert s2.routes.shape == (len(prompt) + 3 - 1, 1, 1) and (s2.routes == 10).all()  # the continuation call's
    assert g.rewards[2:] == [0.0, 0.0]
    assert [s.output_ids for s in g.samples[:2]] == [[ord("3"), EOS], [ord("4"), ord("5"), EOS]]
    assert g.rewards[:2] == [1.0, 0.0]
    assert metrics["soup/mixed"] == 2 and metrics["soup/prefix_len"] == 1.0 and metrics["soup/mixed_reward"] == 0.0
    assert tokens == (2 + 3 + 2 + 4) + 2 * 2  # the step's draws and the two continuations ("9" EOS)
    assert soup.buffer.entries[0]["step"] == 2  # refilled with step 2's draws (before mixing)
    assert soup.buffer.entries[0]["responses"][0]["logp"] == [-0.02, -0.02]

    learner = CountingLearner(hook=True)
    update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer(), tokenizer=tok)
    trained = learner.calls[-1][1]
    for i, x in enumerate(trained):
        own = stand_in_logp(x["tokens"])[x["prompt_len"] - 1:].tolist()
        L = g.prefix_lens[i]
        assert x["rollout_logp"] == g.samples[i].logprobs
        assert x["old_logp"][:L] == g.samples[i].logprobs[:L]  # π_old := μ on the historical prefix
        assert x["old_logp"][L:] == pytest.approx(own[L:], rel=1e-15)  # the learner's π_old on the rest
        assert x["tokens"] == prompt + g.samples[i].output_ids


def k3_by_hand(pairs) -> float:
    """k3 = mean(ρ − 1 − log ρ), ρ = π/μ, over the (log π, log μ) pairs, written out."""
    terms = [math.exp(p - m) - 1 - (p - m) for p, m in pairs]
    return sum(terms) / len(terms)


@pytest.mark.parametrize("mode", ["off", "r2"])
def test_mismatch_metrics_leave_out_the_historical_prefixes(mode):
    """The old-log-prob pass's engine-vs-learner metrics (mismatch/k3, mismatch/max_abs_dlogp, replay/kl_k3*)
    count the tokens this step's engine sampled only; soup/prefix_k3 the historical prefixes' (μ an older policy's)."""
    from megapo.trainer.update import old_logprob_pass

    g = torch.Generator().manual_seed(4)
    prefix = [0, 2, 0, 3]
    batch = []
    for i, n in enumerate([4, 5, 3, 6]):
        tokens = [5, 9, 11] + [int(t) for t in torch.randint(3, 120, (n,), generator=g)]
        own = stand_in_logp(tokens)[2:].tolist()
        # μ: near π on the continuation, far off on the prefix (a stale policy)
        mu = [v + (0.9 if t < prefix[i] else 0.05) * float(torch.randn(1, generator=g, dtype=F64))
              for t, v in enumerate(own)]
        batch.append({"tokens": tokens, "prompt_len": 3, "advantage": 1.0, "rollout_logp": mu})
    cfg = make_cfg(stages=[{"name": "soup"}], routing_replay=mode)
    learner = CountingLearner(hook=mode != "off")
    m = old_logprob_pass(learner, batch, cfg, measure_free_kl=True, stale_prefix=prefix)
    fresh = [(p, mu) for x, L in zip(batch, prefix) for p, mu in list(zip(x["old_logp"], x["rollout_logp"]))[L:]]
    stale = [(p, mu) for x, L in zip(batch, prefix) for p, mu in list(zip(x["old_logp"], x["rollout_logp"]))[:L]]
    assert len(fresh) == 18 - 5 and len(stale) == 5
    assert m["mismatch/k3"] == pytest.approx(k3_by_hand(fresh), rel=1e-12)
    assert m["mismatch/max_abs_dlogp"] == pytest.approx(max(abs(p - mu) for p, mu in fresh), rel=1e-12)
    assert m["soup/prefix_k3"] == pytest.approx(k3_by_hand(stale), rel=1e-12)
    assert m["soup/prefix_k3"] > 10 * m["mismatch/k3"]  # what counting the prefixes would have inflated
    if mode == "r2":  # the routed and free-routing KLs of the same pass (kl_penalty in float32)
        assert m["replay/kl_k3"] == pytest.approx(k3_by_hand(fresh), rel=1e-5)
        assert m["replay/kl_k3_free"] == pytest.approx(k3_by_hand(fresh), rel=1e-5)
    assert all(x["old_logp"] == pytest.approx(stand_in_logp(x["tokens"])[2:].tolist(), rel=1e-15) for x in batch)
    assert "loss_mask" not in batch[0] or batch[0]["loss_mask"] is None  # the samples themselves untouched


def test_the_loop_measures_the_mismatch_without_the_prefixes():
    """update_policy on a step with mixed samples (Group.prefix_lens): mismatch/k3 over the continuations' and the
    on-policy samples' tokens only, soup/prefix_k3 over the prefixes, both written out."""
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.rollout import collect_rollouts
    from megapo.trainer.update import update_policy

    tok, cfg, ex, prompt, engine, params, soup = _setup()
    for step in (1, 2):
        soup.step = step
        groups, _, _ = collect_rollouts(engine, params, [(ex, prompt)], Source(), _reward(tok), cfg, soup=soup)
    (g,) = groups
    assert g.prefix_lens == [0, 0, 1, 1]
    m = update_policy(CountingLearner(hook=True), groups, cfg, None, cfg.loss_spec(), StepTimer(), tokenizer=tok)
    fresh, stale = [], []
    for s, L in zip(g.samples, g.prefix_lens):
        own = stand_in_logp(prompt + s.output_ids)[len(prompt) - 1:].tolist()
        fresh += list(zip(own, s.logprobs))[L:]
        stale += list(zip(own, s.logprobs))[:L]
    assert len(stale) == 2
    assert m["mismatch/k3"] == pytest.approx(k3_by_hand(fresh), rel=1e-12)
    assert m["soup/prefix_k3"] == pytest.approx(k3_by_hand(stale), rel=1e-12)


# ----------------------------------------------------------------------------- the learner's train/mismatch_*


def test_stage_sets_the_mismatch_mask_only_when_it_mixed():
    """mismatch_mask: 0 on each mixed sample's prefix, 1 after it, on every sample when the step mixed one (the
    learner's optional fields: all samples or none); left None on a step that mixed nothing."""
    from megapo.algorithms.pipeline import TokenContext

    old, mu = [-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7, -0.8]
    batch = [_X(4, old, mu), _X(3, old[:3], mu[:3]), _X(4, old, mu)]
    run_soup_stage(batch, None, TokenContext(group_size=3, step=2, seed=0, kl_coef=0.0, soup_prefix=[0, 1, 3]))
    assert [x.mismatch_mask for x in batch] == [[1, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1]]
    plain = [_X(4, old, mu), _X(4, old, mu)]
    run_soup_stage(plain, None, TokenContext(group_size=2, step=1, seed=0, kl_coef=0.0, soup_prefix=[0, 0]))
    assert not any(hasattr(x, "mismatch_mask") for x in plain)


def k3_loop(rows, count_prefix: bool) -> float:
    """k3 = mean(ρ − 1 − log ρ), ρ = exp(log π_old − log μ), float64, over each row's (old, mu, prefix,
    loss_mask) policy tokens from its prefix on (every policy token with count_prefix), written out."""
    total, n = 0.0, 0
    for old, mu, prefix, policy in rows:
        for t in range(len(old)):
            if not policy[t] or (t < prefix and not count_prefix):
                continue
            d = float(old[t]) - float(mu[t])
            total += math.exp(d) - 1.0 - d
            n += 1
    return total / n


def _mismatch_rows(seed=7):
    """Five samples (old_logp after stage soup: μ on the prefix), prefixes 0/2/0/3/1, one observation token."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n, L in zip([5, 6, 4, 7, 3], [0, 2, 0, 3, 1]):
        mu = (-0.3 - torch.rand(n, generator=g, dtype=F64) * 2).tolist()
        old = [m + 0.3 * float(torch.randn(1, generator=g, dtype=F64)) for m in mu]
        old[:L] = mu[:L]  # π_old := μ on the historical prefix (run_soup_stage)
        policy = [1] * n
        if n == 6:
            policy[4] = 0  # an observation token: counted by neither
        rows.append((old, mu, L, policy))
    return rows


def _padded(rows, pick):
    T = max(len(r[0]) for r in rows)
    return torch.tensor([[float(v) for v in pick(r)] + [0.0] * (T - len(r[0])) for r in rows], dtype=F64)


def _shard_metrics(rows, keep: bool, global_tokens=None):
    from megapo.algorithms.loss import policy_loss

    old = _padded(rows, lambda r: r[0])
    kw = {}
    if keep:
        kw["mismatch_mask"] = _padded(rows, lambda r: [0] * r[2] + [1] * (len(r[0]) - r[2]))
    if global_tokens is not None:
        kw["global_tokens"] = global_tokens
    mask = _padded(rows, lambda r: r[3])
    _, m = policy_loss("ppo", old.clone(), old, torch.ones_like(old), mask, _padded(rows, lambda r: r[1]),
                       loss_agg="token-mean", **kw)
    return {k: float(v) for k, v in m.items()}, int(mask.sum())


def test_policy_loss_mismatch_counts_the_continuations_over_shards():
    """policy_loss's mismatch_k3 with a mismatch_mask: the k3 over the continuation tokens written out, on one shard
    and over two shards reduced as the learner reduces them (metrics.reduce_metrics, each shard's policy tokens its
    weight, the batch's policy tokens given, each shard's mismatch means weighted by its own mismatch_tokens);
    without it (no prefixes) the all-token k3; counting the prefixes would give the diluted value instead."""
    from megapo.learner.metrics import MicroBatchMetrics, reduce_metrics

    rows = _mismatch_rows()
    fresh, diluted = k3_loop(rows, count_prefix=False), k3_loop(rows, count_prefix=True)
    assert abs(fresh - diluted) > 0.05 * fresh  # the test can tell them apart
    one, _ = _shard_metrics(rows, keep=True)
    assert one["mismatch_k3"] == pytest.approx(fresh, rel=1e-12)
    assert one["mismatch_max_abs_dlogp"] == pytest.approx(
        max(abs(o[t] - m[t]) for o, m, L, p in rows for t in range(L, len(o)) if p[t]), rel=1e-12)
    N = sum(sum(r[3]) for r in rows)
    K = sum(sum(r[3][r[2]:]) for r in rows)
    parts = []
    for shard in (rows[:2], rows[2:]):
        m, n = _shard_metrics(shard, keep=True, global_tokens=N)
        parts.append(MicroBatchMetrics(tokens=n, values=m))
    assert reduce_metrics(parts)["mismatch_k3"] == pytest.approx(fresh, rel=1e-12)
    assert reduce_metrics(parts)["mismatch_k1"] == pytest.approx(
        sum(m[t] - o[t] for o, m, L, p in rows for t in range(L, len(o)) if p[t]) / K, rel=1e-12)
    # no prefix: the plain path, the k3 over every policy token
    plain = [(o, m, 0, p) for o, m, _, p in rows]
    unmasked, _ = _shard_metrics(plain, keep=False)
    assert unmasked["mismatch_k3"] == pytest.approx(k3_loop(plain, count_prefix=True), rel=1e-12)
    assert unmasked["mismatch_k3"] == pytest.approx(diluted, rel=1e-12)  # (π_old = μ on the ex-prefixes: ρ = 1)
    everything, _ = _shard_metrics(plain, keep=True)  # a mask of ones: the plain path's values, bit for bit
    assert everything == unmasked


class LossLearner(CountingLearner):
    """CountingLearner whose train_step returns policy_loss's metrics on the batch as one micro-batch, its inputs
    as the learner's loss_func passes them (mismatch_mask when the samples carry one)."""

    def train_step(self, batch, loss):
        from megapo.algorithms.loss import policy_loss
        from megapo.algorithms.sample import as_train_samples

        super().train_step(batch, loss)
        xs = as_train_samples(batch)
        T = max(len(x.tokens) - x.prompt_len for x in xs)

        def pad(values):
            return torch.tensor([list(map(float, v)) + [0.0] * (T - len(v)) for v in values], dtype=F64)

        n = [len(x.tokens) - x.prompt_len for x in xs]
        old = pad([x.old_logp for x in xs])
        adv = pad([[x.advantage] * k if isinstance(x.advantage, float) else x.advantage for x, k in zip(xs, n)])
        extra = {} if xs[0].mismatch_mask is None else {"mismatch_mask": pad([x.mismatch_mask for x in xs])}
        _, m = policy_loss(loss, old.clone(), old, adv, pad([[1] * k for k in n]), pad([x.rollout_logp for x in xs]),
                           **extra)
        return {"loss": 0.0, **{k: float(v) for k, v in m.items()}}


def test_update_reports_train_mismatch_over_the_continuations():
    """update_policy's train/mismatch_k3: on the step without prefixes the k3 over every response token (no
    mismatch_mask reaches the learner); on the mixed step the k3 over the continuations' and on-policy samples'
    tokens only, both written out (float64), the mask 0 on each prefix; counting the prefixes (ρ = 1 there,
    π_old := μ) would dilute it."""
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.rollout import collect_rollouts
    from megapo.trainer.update import update_policy

    tok, cfg, ex, prompt, engine, params, soup = _setup()
    for step in (1, 2):
        soup.step = step
        groups, _, _ = collect_rollouts(engine, params, [(ex, prompt)], Source(), _reward(tok), cfg, soup=soup)
        (g,) = groups
        learner = LossLearner(hook=True)
        m = update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer(), tokenizer=tok)
        trained = learner.calls[-1][1]
        rows = []
        for s, L in zip(g.samples, g.prefix_lens):
            own = stand_in_logp(prompt + s.output_ids)[len(prompt) - 1:].tolist()
            old = list(s.logprobs[:L]) + own[L:]  # π_old := μ on the prefix
            rows.append((old, s.logprobs, L, [1] * len(own)))
        if step == 1:
            assert g.prefix_lens == [0, 0, 0, 0] and all(x.get("mismatch_mask") is None for x in trained)
            assert m["train/mismatch_k3"] == pytest.approx(k3_loop(rows, count_prefix=True), rel=1e-12)
            continue
        assert g.prefix_lens == [0, 0, 1, 1]
        assert [x["mismatch_mask"] for x in trained] == [[0] * L + [1] * (len(r[0]) - L)
                                                          for r, L in zip(rows, g.prefix_lens)]
        fresh = k3_loop(rows, count_prefix=False)
        assert m["train/mismatch_k3"] == pytest.approx(fresh, rel=1e-12)
        assert abs(k3_loop(rows, count_prefix=True) - fresh) > 0.05 * fresh


LEARNER_MISMATCH = r"""
import json, sys
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner

spec = json.loads(open(sys.argv[2]).read())
learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-3, grad_clip=0.0), micro_batch_tokens=12)
out = {}
for name, batch in spec.items():
    m = learner.train_step(batch, "ppo", "token-mean")
    out[name] = {k: v for k, v in m.items() if k.startswith("mismatch_")}
learner.close()
print(json.dumps(out))
"""


def test_learner_train_mismatch_counts_the_continuations(tiny_dense, tmp_path):
    """The learner's train_step over several micro-batches: mismatch_k3 with the samples' mismatch_mask equals the
    k3 over the continuation tokens written out (float32 inputs), without it the k3 over every policy token; the
    two differ."""
    import subprocess

    rows = _mismatch_rows(seed=11)
    tokens = [[7 + i, 20 + i] + [30 + 3 * i + t for t in range(len(r[0]))] for i, r in enumerate(rows)]

    def batch(keep):
        out = []
        for tk, (old, mu, L, policy) in zip(tokens, rows):
            s = {"tokens": tk, "prompt_len": 2, "advantage": 0.5, "old_logp": old, "rollout_logp": mu,
                 "loss_mask": policy}
            if keep:
                s["mismatch_mask"] = [0] * L + [1] * (len(old) - L)
            out.append(s)
        return out

    (tmp_path / "run.py").write_text(LEARNER_MISMATCH)
    (tmp_path / "spec.json").write_text(json.dumps({"kept": batch(True), "plain": batch(False)}))
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tiny_dense), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    as32 = [([float(np.float32(v)) for v in o], [float(np.float32(v)) for v in m], L, p) for o, m, L, p in rows]
    fresh, every = k3_loop(as32, count_prefix=False), k3_loop(as32, count_prefix=True)
    assert abs(fresh - every) > 0.05 * fresh
    assert out["kept"]["mismatch_k3"] == pytest.approx(fresh, rel=1e-4)
    assert out["plain"]["mismatch_k3"] == pytest.approx(every, rel=1e-4)
    assert out["kept"]["mismatch_max_abs_dlogp"] == out["plain"]["mismatch_max_abs_dlogp"]  # (0 on the prefixes)


def _run(steps, soup, engine, cfg, tok, ex, prompt, params):
    from megapo.trainer.rollout import collect_rollouts

    out = []
    for step in steps:
        soup.step = step
        groups, metrics, _ = collect_rollouts(engine, params, [(ex, prompt)], Source(), _reward(tok), cfg, soup=soup)
        out.append(([(s.output_ids, s.logprobs) for s in groups[0].samples], groups[0].prefix_lens, metrics))
    return out


def test_resume_equals_unstopped():
    from megapo.trainer.soup import soup_rollouts

    tok, cfg, ex, prompt, _, params, _ = _setup(max_new=8, mix=3, prefix_min=0.2, prefix_max=1.0)

    def fresh():
        return PrefixEngine({tuple(prompt): ["3", "4567", "3", "678"]})

    e1 = fresh()
    unstopped = _run(range(1, 5), soup_rollouts(cfg, params), e1, cfg, tok, ex, prompt, params)
    e2 = fresh()
    first = soup_rollouts(cfg, params)
    part = _run(range(1, 3), first, e2, cfg, tok, ex, prompt, params)
    state = json.loads(json.dumps(first.buffer.state_dict()))  # what the checkpoint's trainer state holds
    resumed = soup_rollouts(cfg, params)
    resumed.buffer.load_state_dict(state)
    e3 = fresh()
    e3.calls = list(e2.calls)  # the scripted engine's log-probs follow its call count (its RNG state)
    rest = _run(range(3, 5), resumed, e3, cfg, tok, ex, prompt, params)
    assert part + rest == unstopped
    assert any(sum(p) > 0 for _, p, _ in unstopped[1:])  # the later steps did mix


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("stage, field, words", [
    ({"mix": 0}, "algorithm.stages[0].mix", "int >= 1"),
    ({"mix": 4}, "algorithm.stages[0].mix", "mix < n_samples"),
    ({"prefix_min": 0.0}, "algorithm.stages[0].prefix_min", "(0, 1]"),
    ({"prefix_max": 1.5}, "algorithm.stages[0].prefix_max", "(0, 1]"),
    ({"prefix_min": 0.9, "prefix_max": 0.5}, "algorithm.stages[0].prefix_min", "exceeds"),
])
def test_bad_options_refused_naming_the_field(stage, field, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "soup", **stage}])
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("change, field, words", [
    (lambda d: d["train"].update(mode="async"), "train.mode", "sync"),
    (lambda d: d["rollout"].update(max_new_tokens=1), "rollout.max_new_tokens", ">= 2"),
    (lambda d: d["data"].update(length_reward="kimi"), "data.length_reward", "none"),
    (lambda d: d["algorithm"]["stages"].insert(0, {"name": "gtpo"}), "algorithm.stages[1]", "before the token stage"),
    (lambda d: d["algorithm"]["stages"].append({"name": "hdpo"}), "algorithm.stages[0]", "hdpo"),
])
def test_runs_it_cannot_serve_refused(change, field, words):
    data = algorithm_configs.config_data(n_samples=4, stages=[{"name": "soup"}])
    change(data)
    err = algorithm_configs.refusal(data)
    assert err.field == field and words in str(err)


def test_small_addition_pool_option():
    from megapo.tasks.registry import get_task

    t = get_task("addition", {"train_size": 5})
    assert t.size("train") == 5 and t.example("train", 4) == get_task("addition").example("train", 4)
    with pytest.raises(ConfigError) as err:
        get_task("addition", {"train_size": -1})
    assert err.value.field == "data.task_options" and "train_size" in str(err.value)


def test_objectives_lists_soup(capsys):
    row, out, _ = objectives_listing(capsys, "soup")
    assert "SOUP" in row and "2601.21476" in row
    assert "π_θ/μ" in out and "Assumption" in out


# ----------------------------------------------------------------------------- one tiny run


def test_megapo_train_with_soup_resumes_as_the_unstopped_run(tmp_path, tiny_moe):
    """Three steps of `megapo train` (the Megatron learner on CPU, r3 from the config) with stage soup on a pool of
    two prompts: every step after the first revisits them and mixes; the same run stopped after step 2's checkpoint
    and resumed mixes at step 3 as the unstopped one (the prefix buffer comes back from the checkpoint: an empty
    one would mix nothing there)."""
    from test_critic_loop import stopped_after

    args = (f"model.path={tiny_moe}", "train.steps=3", "train.ckpt_every=2", "data.prompts_per_step=2",
            "rollout.n_samples=4", "rollout.max_new_tokens=6", "data.task_options={train_size: 2}",
            "algorithm.stages=[{name: soup, mix: 2}]")
    full = train_rows(tmp_path, "full", *args)
    assert full[0]["soup/mixed"] == 0 and all(r["soup/mixed"] > 0 and r["soup/prefix_frac"] > 0 for r in full[1:])
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["soup/prefix_log_ratio"]) for r in full)
    stopped_after(tmp_path / "full", tmp_path / "half", 2)
    rest = {r["step"]: r for r in train_rows(tmp_path, "half", *args, "--resume")}
    for key in ("soup/mixed", "soup/prefix_len", "soup/mixed_reward", "soup/prefix_frac", "soup/prefix_log_ratio",
                "reward", "train/loss", "train/grad_norm"):
        # the tolerance of tests/test_trainer_resume.py
        assert rest[3][key] == pytest.approx(full[2][key], rel=1e-6, abs=1e-9), key
