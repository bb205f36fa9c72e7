"""Objectives of megapo.algorithms checked against formulas written out here with plain Python
loops over floats (math module), finite differences, and the on-policy REINFORCE gradient.

Stop-gradient (sg) terms: the reference takes them from a frozen copy `frozen` of logp, so its
finite-difference gradient at logp = frozen is the gradient the paper's sg[·] prescribes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megapo.algorithms import policy_loss

# ----------------------------------------------------------------------------- data


def make_seqs(seed=0, lengths=(3, 5, 1, 4, 2), noise=0.3, adv_per_token=False):
    """Sequences as dicts of python float lists: lp (current), old, roll (engine), adv."""
    rng = random.Random(seed)
    seqs = []
    for i, n in enumerate(lengths):
        lp = [-abs(rng.gauss(1.0, 0.7)) - 0.05 for _ in range(n)]
        old = [x + rng.gauss(0, noise) for x in lp]
        roll = [x + rng.gauss(0, noise) for x in old]
        a = rng.choice([-1.0, 1.0]) * (0.3 + rng.random())
        adv = [a + (rng.gauss(0, 0.5) if adv_per_token else 0.0) for _ in range(n)]
        seqs.append(dict(lp=lp, old=old, roll=roll, adv=adv))
    return seqs


def padded(seqs, pad=2, garbage=True):
    """[B, T] float64 tensors; padding holds garbage (NaN) that must not leak into anything."""
    width = max(len(s["lp"]) for s in seqs) + pad
    out = {}
    for key in ("lp", "old", "roll", "adv"):
        t = torch.full((len(seqs), width), float("nan") if garbage else 0.0, dtype=torch.float64)
        for i, s in enumerate(seqs):
            t[i, : len(s[key])] = torch.tensor(s[key], dtype=torch.float64)
        out[key] = t
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        mask[i, : len(s["lp"])] = True
    out["mask"] = mask
    return out


def packed(seqs, prompt=2):
    """1-D tensors; each sequence is preceded by `prompt` masked tokens (as in a packed batch)."""
    out = {k: [] for k in ("lp", "old", "roll", "adv")}
    mask, cu = [], [0]
    for s in seqs:
        for key in out:
            out[key] += [0.123] * prompt + s[key]
        mask += [False] * prompt + [True] * len(s["lp"])
        cu.append(cu[-1] + prompt + len(s["lp"]))
    res = {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}
    res["mask"] = torch.tensor(mask)
    res["cu"] = torch.tensor(cu, dtype=torch.int32)
    return res


# ----------------------------------------------------------------------------- references


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def ref_token_losses(name, seqs, opts=None, lp_of=None, frozen_of=None):
    """Per-token losses, list of lists. lp_of(i) gives the current log-probs of sequence i (for
    finite differences), frozen_of(i) the values sg[·] sees."""
    opts = dict(opts or {})
    out = []
    for i, s in enumerate(seqs):
        lp = lp_of(i) if lp_of else s["lp"]
        fz = frozen_of(i) if frozen_of else lp
        old, adv, roll, n = s["old"], s["adv"], s["roll"], len(s["lp"])
        losses = []
        if name == "ppo":
            el, eh, c = opts.get("eps_low", 0.2), opts.get("eps_high", 0.2), opts.get("dual_clip")
            for t in range(n):
                r = math.exp(lp[t] - old[t])
                a = adv[t]
                loss = max(-a * r, -a * clip(r, 1 - el, 1 + eh))
                if c is not None and a < 0:
                    loss = min(loss, -c * a)
                losses.append(loss)
        elif name in ("gspo", "gspo_token"):
            el, eh = opts.get("eps_low", 3e-4), opts.get("eps_high", 4e-4)
            for t in range(n):
                if name == "gspo":
                    s_val = math.exp(sum(lp[u] - old[u] for u in range(n)) / n)
                else:
                    s_val = math.exp(sum(fz[u] - old[u] for u in range(n)) / n) * math.exp(lp[t] - fz[t])
                a = adv[t]
                losses.append(max(-a * s_val, -a * clip(s_val, 1 - el, 1 + eh)))
        elif name == "gmpo":
            el, eh = opts.get("eps_low", 0.4), opts.get("eps_high", 0.4)
            total = 0.0
            for t in range(n):
                ell = lp[t] - old[t]
                if adv[t] > 0:
                    total += min(ell, eh)
                elif adv[t] < 0:
                    total += max(ell, -el)
            rho = math.exp(total / n)
            losses = [-adv[t] * rho for t in range(n)]
        elif name == "sapo":
            tp, tn = opts.get("tau_pos", 1.0), opts.get("tau_neg", 1.05)
            for t in range(n):
                r = math.exp(lp[t] - old[t])
                tau = tp if adv[t] > 0 else tn
                losses.append(-adv[t] * sigmoid(tau * (r - 1)) * 4 / tau)
        elif name == "cispo":
            el, eh = opts.get("eps_low", 1.0), opts.get("eps_high", 0.28)
            for t in range(n):
                w = clip(math.exp(fz[t] - old[t]), 1 - el, 1 + eh)
                losses.append(-w * adv[t] * lp[t])
        elif name == "vespo":
            k, lam = opts.get("k", 2.0), opts.get("lam", 2.0)
            w = math.exp(sum(fz[u] - old[u] for u in range(n)))
            phi = math.exp(lam) * w**k * math.exp(-lam * w)
            losses = [-phi * adv[t] * lp[t] for t in range(n)]
        elif name == "ctpo":
            el, eh = opts.get("eps_low", 0.2), opts.get("eps_high", 0.2)
            for t in range(n):
                prefix = fz if opts.get("detach_prefix", True) else lp
                c = sum(prefix[u] - old[u] for u in range(t)) + (lp[t] - old[t])
                lo, hi = -el * math.sqrt(t + 1), eh * math.sqrt(t + 1)
                a = adv[t]
                losses.append(max(-a * math.exp(c), -a * math.exp(clip(c, lo, hi))))
        elif name == "minirl":
            el, eh = opts.get("eps_low", 0.2), opts.get("eps_high", 0.28)
            use_roll, cap = opts.get("_roll", True), opts.get("mismatch_cap")
            for t in range(n):
                r = math.exp(fz[t] - old[t])
                m = math.exp(old[t] - roll[t]) if use_roll else 1.0
                m = min(m, cap) if cap is not None else m
                a = adv[t]
                dropped = (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el)
                losses.append(0.0 if dropped else -(r * m) * a * lp[t])
        elif name == "reinforce":
            for t in range(n):
                w = math.exp(fz[t] - old[t]) if opts.get("importance_weight") else 1.0
                losses.append(-w * adv[t] * lp[t])
        else:
            raise KeyError(name)
        out.append(losses)
    return out


def ref_aggregate(losses, mode, max_len=None):
    n_tok = sum(len(x) for x in losses)
    n_seq = sum(1 for x in losses if x)
    if mode == "token-mean":
        return sum(sum(x) for x in losses) / n_tok
    if mode == "seq-mean-token-mean":
        return sum(sum(x) / len(x) for x in losses if x) / n_seq
    if mode == "seq-mean-token-sum":
        return sum(sum(x) for x in losses) / n_seq
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(x) for x in losses) / (max_len * n_seq)
    raise KeyError(mode)


OBJECTIVES = ["ppo", "gspo", "gspo_token", "gmpo", "sapo", "cispo", "vespo", "ctpo", "minirl", "reinforce"]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# options that make clipping actually bite on the random data
OPTS = {
    "ppo": dict(eps_low=0.2, eps_high=0.28, dual_clip=1.5),
    "gspo": dict(eps_low=0.05, eps_high=0.08),
    "gspo_token": dict(eps_low=0.05, eps_high=0.08),
    "gmpo": dict(eps_low=0.2, eps_high=0.3),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "cispo": dict(eps_low=0.2, eps_high=0.28),
    "vespo": dict(k=2.0, lam=1.5),
    "ctpo": dict(eps_low=0.15, eps_high=0.25),
    "minirl": dict(eps_low=0.2, eps_high=0.28),
    "reinforce": dict(importance_weight=True),
}


def lib_loss(name, p, opts, agg="token-mean", with_roll=True, **kw):
    lp = p["lp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        name, lp, p["old"], p["adv"], p["mask"], p["roll"] if with_roll else None,
        cu_seqlens=p.get("cu"), loss_agg=agg, **opts, **kw,
    )
    loss.backward()
    return loss, lp.grad, metrics


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.parametrize("adv_per_token", [False, True])
def test_loss_matches_reference(name, adv_per_token):
    seqs = make_seqs(seed=1, adv_per_token=adv_per_token)
    ref_losses = ref_token_losses(name, seqs, OPTS[name])
    for agg in AGGS:
        kw = {"max_len": 8} if agg.endswith("norm") else {}
        loss, _, _ = lib_loss(name, padded(seqs), OPTS[name], agg, **kw)
        expected = ref_aggregate(ref_losses, agg, max_len=8)
        assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12), (name, agg)


def _fd_grad(name, seqs, opts, agg, max_len=8, h=1e-6):
    """Central differences of the reference loss w.r.t. every valid token, sg parts frozen."""
    frozen = [list(s["lp"]) for s in seqs]
    grads = []
    for i, s in enumerate(seqs):
        row = []
        for t in range(len(s["lp"])):
            vals = []
            for sign in (1, -1):
                def lp_of(j, sign=sign):
                    v = list(frozen[j])
                    if j == i:
                        v[t] += sign * h
                    return v
                losses = ref_token_losses(name, seqs, opts, lp_of=lp_of, frozen_of=lambda j: frozen[j])
                vals.append(ref_aggregate(losses, agg, max_len))
            row.append((vals[0] - vals[1]) / (2 * h))
        grads.append(row)
    return grads


@pytest.mark.parametrize("name", OBJECTIVES)
def test_gradient_matches_finite_differences(name):
    seqs = make_seqs(seed=2, lengths=(3, 4, 1, 2))
    for agg in ("token-mean", "seq-mean-token-mean"):
        _, grad, _ = lib_loss(name, padded(seqs), OPTS[name], agg)
        fd = _fd_grad(name, seqs, OPTS[name], agg)
        for i, row in enumerate(fd):
            for t, g in enumerate(row):
                assert grad[i, t].item() == pytest.approx(g, rel=1e-6, abs=1e-8), (name, agg, i, t)
        # padding gets exactly zero gradient
        p = padded(seqs)
        assert torch.all(grad[~p["mask"]] == 0)


@pytest.mark.parametrize("name", ["ppo", "gspo", "gspo_token", "sapo", "cispo", "vespo", "ctpo", "minirl", "gmpo"])
@pytest.mark.parametrize("agg", AGGS)
def test_on_policy_gradient_is_reinforce(name, agg):
    """With π_θ = π_old (= μ) every objective's gradient is -A·∇log π under its normalisation."""
    seqs = make_seqs(seed=3)
    for s in seqs:
        s["old"] = list(s["lp"])
        s["roll"] = list(s["lp"])
    _, grad, _ = lib_loss(name, padded(seqs), OPTS[name], agg, max_len=8) if agg.endswith("norm") else \
        lib_loss(name, padded(seqs), OPTS[name], agg)
    n_tok = sum(len(s["lp"]) for s in seqs)
    n_seq = len(seqs)
    for i, s in enumerate(seqs):
        n = len(s["lp"])
        for t in range(n):
            scale = {"token-mean": 1 / n_tok, "seq-mean-token-mean": 1 / (n * n_seq),
                     "seq-mean-token-sum": 1 / n_seq, "seq-mean-token-sum-norm": 1 / (8 * n_seq)}[agg]
            assert grad[i, t].item() == pytest.approx(-s["adv"][t] * scale, rel=1e-10), (name, agg, i, t)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_padded_and_packed_agree(name):
    seqs = make_seqs(seed=4, lengths=(4, 1, 6, 3))
    for agg in AGGS:
        kw = {"max_len": 8} if agg.endswith("norm") else {}
        l1, g1, m1 = lib_loss(name, padded(seqs), OPTS[name], agg, correction="tis", **kw)
        p = packed(seqs)
        l2, g2, m2 = lib_loss(name, p, OPTS[name], agg, correction="tis", **kw)
        assert l1.item() == pytest.approx(l2.item(), rel=1e-12, abs=1e-14)
        flat = g2[p["mask"]]
        assert torch.allclose(g1[padded(seqs)["mask"]], flat, rtol=1e-12, atol=1e-14)
        assert torch.all(g2[~p["mask"]] == 0)
        assert m1.keys() == m2.keys()
        for key in m1:
            assert float(m1[key]) == pytest.approx(float(m2[key]), rel=1e-12, abs=1e-14), key


def test_ppo_metrics_match_reference_counts():
    seqs = make_seqs(seed=5, noise=0.5)
    opts = dict(eps_low=0.2, eps_high=0.28, dual_clip=1.5)
    _, _, m = lib_loss("ppo", padded(seqs), opts)
    ratios, low, high, dual = [], 0, 0, 0
    for s in seqs:
        for lp, old, a in zip(s["lp"], s["old"], s["adv"]):
            r = math.exp(lp - old)
            ratios.append(r)
            low += a < 0 and r < 0.8
            high += a > 0 and r > 1.28
            dual += a < 0 and r > 1.5
    n = len(ratios)
    assert low + high > 0  # the data exercises clipping
    assert float(m["clipfrac_low"]) == pytest.approx(low / n)
    assert float(m["clipfrac_high"]) == pytest.approx(high / n)
    assert float(m["clipfrac_dual"]) == pytest.approx(dual / n)
    assert float(m["ratio_mean"]) == pytest.approx(sum(ratios) / n)
    assert float(m["ratio_min"]) == pytest.approx(min(ratios))
    assert float(m["ratio_max"]) == pytest.approx(max(ratios))
    assert "mismatch_k3" in m


def test_gspo_defaults_are_the_papers():
    """Defaults eps 3e-4/4e-4: a sequence ratio of exp(5e-4) is clipped, exp(2e-4) is not."""
    for shift, clipped in ((5e-4, True), (2e-4, False)):
        lp = torch.full((1, 3), -1.0, dtype=torch.float64, requires_grad=True)
        old = lp.detach() - shift
        loss, m = policy_loss("gspo", lp, old, torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3))
        loss.backward()
        assert (lp.grad.abs().sum().item() == 0) == clipped
        assert float(m["clipfrac_high"]) == (1.0 if clipped else 0.0)


def test_kl_and_entropy_terms():
    seqs = make_seqs(seed=6)
    p = padded(seqs)
    ref = p["old"] - 0.1
    ent = torch.rand_like(p["lp"]).abs()
    loss, _, m = lib_loss("reinforce", p, {}, ref_logp=ref, kl_coef=0.5, kl_estimator="k3",
                          entropy=ent, entropy_coef=0.01)
    base = ref_aggregate(ref_token_losses("reinforce", seqs), "token-mean")
    kl = [[math.exp(r - l) - (r - l) - 1 for l, r in zip(s["lp"], ref[i, : len(s["lp"])].tolist())]
          for i, s in enumerate(seqs)]
    ents = [ent[i, : len(s["lp"])].tolist() for i, s in enumerate(seqs)]
    expected = base + 0.5 * ref_aggregate(kl, "token-mean") - 0.01 * ref_aggregate(ents, "token-mean")
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert float(m["kl"]) == pytest.approx(ref_aggregate(kl, "token-mean"))


# ----------------------------------------------------------------------------- bad input


def _args():
    p = padded(make_seqs(seed=7), garbage=False)
    return dict(loss="ppo", logp=p["lp"], old_logp=p["old"], advantages=p["adv"], mask=p["mask"])


@pytest.mark.parametrize(
    "change, argument",
    [
        (lambda a: a.update(loss="nope"), "objective"),
        (lambda a: a.update(old_logp=a["old_logp"][:, :-1]), "old_logp"),
        (lambda a: a.update(advantages=a["advantages"][:-1]), "advantages"),
        (lambda a: a.update(mask=torch.zeros_like(a["mask"])), "mask"),
        (lambda a: a.update(mask=a["mask"][:, 1:]), "mask"),
        (lambda a: a["advantages"].__setitem__((0, 0), float("nan")), "advantages"),
        (lambda a: a["logp"].__setitem__((0, 0), float("inf")), "logp"),
        (lambda a: a.update(eps_lowx=0.1), "options"),
        (lambda a: a.update(eps_low=-0.1), "eps_low"),
        (lambda a: a.update(dual_clip=0.5), "dual_clip"),
        (lambda a: a.update(loss_agg="mean"), "loss_agg"),
        (lambda a: a.update(loss_agg="seq-mean-token-sum-norm"), "max_len"),
        (lambda a: a.update(global_tokens=0), "global_tokens"),
        (lambda a: a.update(correction="tis"), "rollout_logp"),
        (lambda a: a.update(rollout_logp=a["old_logp"], correction="zzz"), "correction"),
        (lambda a: a.update(rollout_logp=a["old_logp"], correction="tis", correction_options={"cup": 1}), "options"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 3])), "cu_seqlens"),
        (lambda a: a.update(kl_coef=0.1), "ref_logp"),
        (lambda a: a.update(logp=a["logp"][None]), "logp"),
    ],
)
def test_bad_input_names_the_argument(change, argument):
    a = _args()
    change(a)
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        policy_loss(**a)


@pytest.mark.parametrize(
    "cu, n",
    [([0, 3, 5], 6), ([1, 3, 6], 6), ([0, 4, 3, 6], 6), ([[0, 6]], 6), ([0.0, 6.0], 6), (None, 6)],
)
def test_bad_cu_seqlens(cu, n):
    x = torch.zeros(n, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    with pytest.raises(ValueError, match=r"^cu_seqlens"):
        policy_loss("ppo", x, x, x, torch.ones(n), cu_seqlens=cu_t)


@pytest.mark.parametrize(
    "name, opts, adv",
    [("ppo", {}, 1.0), ("ppo", {"dual_clip": 3.0}, -1.0), ("gspo", {}, 1.0), ("gspo_token", {}, 1.0),
     ("ctpo", {}, 1.0), ("sapo", {}, 1.0), ("sapo", {}, -1.0), ("gmpo", {}, 1.0), ("vespo", {}, 1.0),
     ("cispo", {}, 1.0)],
)
def test_overflowing_ratio_gives_finite_loss_and_gradient(name, opts, adv):
    """float32 ratio e^100 overflows; a clipped (or saturated) token must not produce NaN grads."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = lp.detach() - torch.tensor([[100.0, 0.1, 0.0]])
    loss, _ = policy_loss(name, lp, old, torch.full((1, 3), adv), torch.ones(1, 3), **opts)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all()


def test_bad_coefficients():
    a = _args()
    with pytest.raises(ValueError, match="^kl_coef"):
        policy_loss(**a, ref_logp=a["old_logp"], kl_coef="big")
    with pytest.raises(ValueError, match="^entropy"):
        policy_loss(**a, entropy_coef=0.1)


@pytest.mark.parametrize(
    "name, opts, with_roll",
    [("ctpo", dict(eps_low=0.15, eps_high=0.25, detach_prefix=False), True),
     ("minirl", dict(eps_low=0.2, eps_high=0.28), False),
     ("minirl", dict(eps_low=0.2, eps_high=0.28, mismatch_cap=1.1), True)],
)
def test_variants_match_reference_and_finite_differences(name, opts, with_roll):
    seqs = make_seqs(seed=8, lengths=(3, 4, 2))
    ref_opts = dict(opts, _roll=with_roll)
    for agg in ("token-mean", "seq-mean-token-sum"):
        loss, grad, _ = lib_loss(name, padded(seqs), opts, agg, with_roll=with_roll)
        assert loss.item() == pytest.approx(ref_aggregate(ref_token_losses(name, seqs, ref_opts), agg), rel=1e-10)
        fd = _fd_grad(name, seqs, ref_opts, agg)
        for i, row in enumerate(fd):
            for t, g in enumerate(row):
                assert grad[i, t].item() == pytest.approx(g, rel=1e-6, abs=1e-8), (name, agg, i, t)
