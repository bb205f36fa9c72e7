"""The ratio and trust-region objectives of issue 14 (megapo/algorithms/trust_region.py, ppo's
clip_mode=dynamic) against formulas written out here as plain Python loops over floats, central
finite differences of those loops, padded vs packed (cu_seqlens) layouts, the special cases each
method contains (holder p=0 is gspo, dhpo α=1 is ppo, ...), and bad options refused at config time.

Stop-gradient (sg) terms: the reference takes them from a frozen copy of logp (as test_objectives.py
does), so its finite-difference gradient at logp = frozen is the gradient sg[·] prescribes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_objectives import clip, lib_loss, make_seqs, packed, padded, ref_aggregate  # noqa: E402

from megapo.algorithms import entries, policy_loss  # noqa: E402
from megapo.cli import main  # noqa: E402
from megapo.config import ConfigError, load_config  # noqa: E402
from megapo.trainer.config import RunConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- references


def _binary_div(kind, lp, old):
    p, q = math.exp(min(lp, 0.0)), math.exp(min(old, 0.0))  # log-probs above 0 (make_seqs' noise) count as 0
    if kind == "tv":
        return abs(p - q)
    rest = (1 - q) * math.log((1 - q) / (1 - p)) if q < 1 else 0.0
    return q * math.log(q / p) + rest


def _moves(a, ell):
    return (a > 0 and ell > 0) or (a < 0 and ell < 0)


def _gains(n, q, r, p0):
    out, var = [], p0
    for _ in range(n):
        prior = var + q
        out.append(prior / (prior + r))
        var = (1 - out[-1]) * prior
    return out


def _pessimistic(a, rho, lo, hi):
    return max(-a * rho, -a * clip(rho, lo, hi))


def ref_losses(name, seqs, opts, lp_of=None, frozen_of=None):
    """Per-token losses (list of lists) of objective `name`, written from its formula."""
    o = dict(opts)
    out = []
    for i, s in enumerate(seqs):
        lp = lp_of(i) if lp_of else s["lp"]
        fz = frozen_of(i) if frozen_of else lp
        old, adv, n = s["old"], s["adv"], len(s["lp"])
        ell = [lp[t] - old[t] for t in range(n)]
        ell_fz = [fz[t] - old[t] for t in range(n)]
        row = []
        if name == "minpro":
            el, eh = o.get("eps_low", 0.2), o.get("eps_high", 0.2)
            for t in range(n):
                m = 1.0 if t == 0 else min(math.exp(ell_fz[u]) for u in range(t))
                row.append(m * _pessimistic(adv[t], math.exp(ell[t]), 1 - el, 1 + eh))
        elif name in ("dppo", "cppo", "cppo_prefix_mean"):
            kind, delta = o.get("divergence", "tv"), o.get("delta", 0.15)
            w_min = o.get("w_min", 0.8) if name != "dppo" else 1.0
            weighted_sum = 0.0  # Σ_{s<=t} w_s·D_s over the prefix, every earlier token counted
            for t in range(n):
                d = _binary_div(kind, fz[t], old[t])
                w = 1.0 if n == 1 else 1 - (1 - w_min) * t / (n - 1)
                weighted_sum += w * d
                if name == "dppo":
                    over = d > delta
                elif name == "cppo":  # the cumulative budget: the running sum, never divided
                    over = w * d > delta or weighted_sum > o.get("budget", 1.0)
                else:  # the prefix mean
                    over = w * d > delta or weighted_sum / (t + 1) > (o.get("budget") or delta)
                keep = 0.0 if (over and _moves(adv[t], ell_fz[t])) else 1.0
                row.append(-keep * math.exp(ell[t]) * adv[t])
        elif name == "dhpo":
            alpha = o.get("alpha", 0.5)
            tl, th = o.get("tok_eps_low", 0.2), o.get("tok_eps_high", 0.2)
            sl, sh = o.get("seq_eps_low", 3e-4), o.get("seq_eps_high", 4e-4)
            seq = math.exp(sum(ell) / n)
            for t in range(n):
                r = math.exp(ell[t])
                rho = alpha * r + (1 - alpha) * seq
                rho_clip = alpha * clip(r, 1 - tl, 1 + th) + (1 - alpha) * clip(seq, 1 - sl, 1 + sh)
                row.append(max(-adv[t] * rho, -adv[t] * rho_clip))
        elif name == "holder":
            p, el, eh = o.get("p", 0.0), o.get("eps_low", 3e-4), o.get("eps_high", 4e-4)
            if p == 0:
                rho = math.exp(sum(ell) / n)
            else:
                rho = (sum(math.exp(p * x) for x in ell) / n) ** (1 / p)
            row = [_pessimistic(adv[t], rho, 1 - el, 1 + eh) for t in range(n)]
        elif name == "kpo":
            el, eh = o.get("eps_low", 0.2), o.get("eps_high", 0.2)
            gains = _gains(n, o.get("process_var", 0.1), o.get("obs_var", 1.0), o.get("init_var", 1.0))
            through_filter = o.get("gradient", "token") == "filter"
            x = 0.0
            for t in range(n):
                x = x + gains[t] * ((ell if through_filter else ell_fz)[t] - x)
                log_rt = x if through_filter else x + lp[t] - fz[t]
                row.append(_pessimistic(adv[t], math.exp(log_rt), 1 - el, 1 + eh))
        elif name == "aspo":
            el, eh, c = o.get("eps_low", 0.2), o.get("eps_high", 0.28), o.get("dual_clip", 3.0)
            for t in range(n):
                r, a = math.exp(ell_fz[t]), adv[t]
                keep = 0.0 if (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el) else 1.0
                w = 1 / r if a > 0 else r
                w = min(w, c) if c is not None else w
                row.append(-keep * w * a * lp[t])
        elif name == "ppo_dynamic":
            el, eh, cap, dual = o.get("eps_low", 0.2), o.get("eps_high", 0.2), o.get("ratio_cap", 10.0), o.get("dual_clip")
            for t in range(n):
                q = math.exp(old[t])
                lo = (1 + math.sqrt(max(1 - 4 * el / q, 0.0))) / 2
                hi = min((1 + math.sqrt(1 + 4 * eh / q)) / 2, cap)
                loss = _pessimistic(adv[t], math.exp(ell[t]), lo, hi)
                if dual is not None and adv[t] < 0:
                    loss = min(loss, -dual * adv[t])
                row.append(loss)
        else:
            raise KeyError(name)
        out.append(row)
    return out


# (objective, options): options that make each mechanism bite on make_seqs' random data
CASES = [
    ("minpro", dict(eps_low=0.2, eps_high=0.28)),
    ("dppo", dict(divergence="tv", delta=0.05)),
    ("dppo", dict(divergence="kl", delta=0.02)),
    ("cppo", dict(divergence="tv", delta=0.05, w_min=0.6, budget=0.3)),
    ("cppo", dict(divergence="kl", delta=0.03, w_min=0.8, budget=0.05)),
    ("cppo", dict(divergence="tv", delta=0.2)),
    ("cppo_prefix_mean", dict(divergence="tv", delta=0.05, w_min=0.6)),
    ("cppo_prefix_mean", dict(divergence="kl", delta=0.03, w_min=0.8, budget=0.02)),
    ("dhpo", dict(alpha=0.5, tok_eps_low=0.2, tok_eps_high=0.28, seq_eps_low=0.05, seq_eps_high=0.08)),
    ("dhpo", dict(alpha=0.3, tok_eps_low=0.1, tok_eps_high=0.1, seq_eps_low=0.02, seq_eps_high=0.03)),
    ("holder", dict(p=0.0, eps_low=0.05, eps_high=0.08)),
    ("holder", dict(p=1.0, eps_low=0.1, eps_high=0.15)),
    ("holder", dict(p=2.0, eps_low=0.1, eps_high=0.15)),
    ("holder", dict(p=-1.0, eps_low=0.1, eps_high=0.15)),
    ("holder", dict(p=0.37, eps_low=0.1, eps_high=0.15)),
    ("kpo", dict(process_var=0.1, obs_var=1.0, init_var=1.0, eps_low=0.1, eps_high=0.15)),
    ("kpo", dict(process_var=0.3, obs_var=0.5, init_var=2.0, eps_low=0.1, eps_high=0.15, gradient="filter")),
    ("aspo", dict(eps_low=0.2, eps_high=0.28, dual_clip=1.3)),
    ("aspo", dict(eps_low=0.2, eps_high=0.28, dual_clip=None)),
    ("ppo_dynamic", dict(eps_low=0.2, eps_high=0.2, ratio_cap=1.6, dual_clip=1.5)),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in CASES]


def _lib_args(name, opts):
    return ("ppo", dict(opts, clip_mode="dynamic")) if name == "ppo_dynamic" else (name, opts)


def _default_agg(name):
    from megapo.algorithms.registry import get

    return get("objective", "ppo" if name == "ppo_dynamic" else name).loss_agg


def _fd_grad(name, seqs, opts, agg, h=1e-6):
    """Central differences of the reference's aggregated loss w.r.t. every valid token, sg parts frozen."""
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
                losses = ref_losses(name, seqs, opts, lp_of=lp_of, frozen_of=lambda j: frozen[j])
                vals.append(ref_aggregate(losses, agg))
            row.append((vals[0] - vals[1]) / (2 * h))
        grads.append(row)
    return grads


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name, opts", CASES, ids=IDS)
@pytest.mark.parametrize("adv_per_token", [False, True])
def test_loss_matches_reference(name, opts, adv_per_token):
    seqs = make_seqs(seed=11, lengths=(3, 5, 1, 6, 2), noise=0.4, adv_per_token=adv_per_token)
    expected_losses = ref_losses(name, seqs, opts)
    lib_name, lib_opts = _lib_args(name, opts)
    for agg in ("auto", "token-mean", "seq-mean-token-mean"):
        loss, _, _ = lib_loss(lib_name, padded(seqs), lib_opts, agg)
        ref_agg = _default_agg(name) if agg == "auto" else agg
        assert loss.item() == pytest.approx(ref_aggregate(expected_losses, ref_agg), rel=1e-10, abs=1e-12), agg


@pytest.mark.parametrize("name, opts", CASES, ids=IDS)
def test_gradient_matches_finite_differences(name, opts):
    seqs = make_seqs(seed=12, lengths=(3, 4, 1, 5), noise=0.4)
    lib_name, lib_opts = _lib_args(name, opts)
    for agg in ("token-mean", "seq-mean-token-mean"):
        _, grad, _ = lib_loss(lib_name, padded(seqs), lib_opts, agg)
        for i, row in enumerate(_fd_grad(name, seqs, opts, agg)):
            for t, g in enumerate(row):
                assert grad[i, t].item() == pytest.approx(g, rel=1e-6, abs=1e-8), (agg, i, t)
        assert torch.all(grad[~padded(seqs)["mask"]] == 0)  # padding gets exactly zero gradient


@pytest.mark.parametrize("name, opts", CASES, ids=IDS)
def test_padded_and_packed_agree(name, opts):
    """Packed rows carry masked prompt tokens before each response: prefixes, positions and
    sequence means must skip them and stop at cu_seqlens boundaries."""
    seqs = make_seqs(seed=13, lengths=(4, 1, 6, 3), noise=0.4)
    lib_name, lib_opts = _lib_args(name, opts)
    l1, g1, m1 = lib_loss(lib_name, padded(seqs), lib_opts, "token-mean")
    p = packed(seqs, prompt=3)
    l2, g2, m2 = lib_loss(lib_name, p, lib_opts, "token-mean")
    assert l1.item() == pytest.approx(l2.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(g1[padded(seqs)["mask"]], g2[p["mask"]], rtol=1e-12, atol=1e-14)
    assert torch.all(g2[~p["mask"]] == 0)
    for key in m1:
        assert float(m1[key]) == pytest.approx(float(m2[key]), rel=1e-12, abs=1e-14), key


def _ref_dropped(name, seqs, opts):
    """Tokens the reference's mask drops (dppo/cppo/aspo/minpro's PPO mask), as a fraction."""
    dropped, total = 0, 0
    for s in seqs:
        n = len(s["lp"])
        for t in range(n):
            total += 1
            one = dict(lp=[s["lp"][t]], old=[s["old"][t]], adv=[s["adv"][t]], roll=[0.0])
            if name in ("dppo", "aspo"):
                # a single token sees the same mask as in its sequence (no prefix dependence)
                loss = ref_losses(name, [one], opts)[0][0]
                dropped += loss == 0.0 and s["adv"][t] != 0
    return dropped / total


@pytest.mark.parametrize("name, opts", [c for c in CASES if c[0] in ("dppo", "aspo")],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] in ("dppo", "aspo")])
def test_mask_fraction_matches_reference(name, opts):
    seqs = make_seqs(seed=14, lengths=(5, 6, 4, 7), noise=0.5)
    _, _, m = lib_loss(name, padded(seqs), opts)
    expected = _ref_dropped(name, seqs, opts)
    assert 0 < expected < 1  # the data exercises the mask
    assert float(m["clipfrac_low"]) + float(m["clipfrac_high"]) == pytest.approx(expected)


def _same(a, b, **kw):
    la, ga, _ = lib_loss(*a, **kw)
    lb, gb, _ = lib_loss(*b, **kw)
    assert la.item() == pytest.approx(lb.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(ga, gb, rtol=1e-10, atol=1e-14)


def test_special_cases_are_the_methods_they_contain():
    p = padded(make_seqs(seed=15, noise=0.4))
    eps = dict(eps_low=0.05, eps_high=0.08)
    # holder: p = 0 is GSPO's geometric mean; a tiny p is numerically the same (no cancellation)
    _same(("holder", p, dict(p=0.0, **eps), "seq-mean-token-mean"), ("gspo", p, eps, "seq-mean-token-mean"))
    _same(("holder", p, dict(p=1e-12, **eps), "seq-mean-token-mean"), ("gspo", p, eps, "seq-mean-token-mean"))
    # dhpo: α = 1 is the token branch alone (PPO), α = 0 the sequence branch alone (GSPO)
    _same(("dhpo", p, dict(alpha=1.0, tok_eps_low=0.2, tok_eps_high=0.28), "token-mean"),
          ("ppo", p, dict(eps_low=0.2, eps_high=0.28), "token-mean"))
    _same(("dhpo", p, dict(alpha=0.0, seq_eps_low=0.05, seq_eps_high=0.08), "seq-mean-token-mean"),
          ("gspo", p, eps, "seq-mean-token-mean"))
    # cppo (and its prefix-mean variant) without position weight and with an unreachable budget is dppo
    _same(("cppo", p, dict(delta=0.05, w_min=1.0, budget=1e9), "token-mean"), ("dppo", p, dict(delta=0.05), "token-mean"))
    _same(("cppo_prefix_mean", p, dict(delta=0.05, w_min=1.0, budget=1e9), "token-mean"),
          ("dppo", p, dict(delta=0.05), "token-mean"))
    # kpo with gain 1 at every token (no smoothing) is PPO
    _same(("kpo", p, dict(process_var=1e12, obs_var=1e-12, eps_low=0.2, eps_high=0.28), "token-mean"),
          ("ppo", p, dict(eps_low=0.2, eps_high=0.28), "token-mean"))


def test_dynamic_clip_widens_for_rare_tokens():
    """The DCPO bounds as the reference computes them: wider as π_old(y_t) falls, the lower one never
    under 1/2, the upper one capped; and the library clips exactly there (ratio just inside / outside)."""
    for q_hi, q_lo in ((0.9, 0.3), (0.3, 0.05)):
        bounds = []
        for q in (q_hi, q_lo):
            lo = (1 + math.sqrt(max(1 - 0.8 / q, 0.0))) / 2
            hi = min((1 + math.sqrt(1 + 0.8 / q)) / 2, 10.0)
            bounds.append((lo, hi))
        assert bounds[1][0] <= bounds[0][0] and bounds[1][1] > bounds[0][1] and bounds[1][0] >= 0.5
    q = 0.3
    hi = (1 + math.sqrt(1 + 0.8 / q)) / 2
    for factor, clipped in ((0.999, False), (1.001, True)):
        lp = torch.tensor([[math.log(q * hi * factor)]], dtype=torch.float64, requires_grad=True)
        old = torch.tensor([[math.log(q)]], dtype=torch.float64)
        loss, m = policy_loss("ppo", lp, old, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1),
                              clip_mode="dynamic", eps_low=0.2, eps_high=0.2)
        loss.backward()
        assert (lp.grad.item() == 0) == clipped
        assert float(m["clipfrac_high"]) == float(clipped)


def test_minpro_prefix_stops_at_each_sequence():
    """A tiny ratio at the end of sequence 1 must not reach sequence 2's first token (m_1 = 1)."""
    seqs = [dict(lp=[-1.0, -1.0], old=[-1.0, 2.0], adv=[1.0, 1.0], roll=[0.0, 0.0]),
            dict(lp=[-1.0, -1.0], old=[-1.0, -1.0], adv=[1.0, 1.0], roll=[0.0, 0.0])]
    p = packed(seqs, prompt=1)
    _, grad, _ = lib_loss("minpro", p, {}, "token-mean")
    # on-policy tokens of sequence 2: gradient -A/N with m = 1 (N = 4 tokens)
    assert grad[p["mask"]][2:].tolist() == pytest.approx([-0.25, -0.25])


def test_cppo_prefix_mean_counts_the_current_token():
    """B_t includes token t: token 2 alone is within δ (0.1 <= 0.15) and the prefix before it is within
    the budget (0.04), but B_2 = (0.04 + 0.1)/2 = 0.07 > 0.06, so token 2 (A>0, r>1) is masked."""
    seqs = [dict(lp=[math.log(0.54), math.log(0.6), math.log(0.4)], old=[math.log(0.5)] * 3,
                 adv=[1.0, 1.0, 1.0], roll=[0.0] * 3)]
    opts = dict(divergence="tv", delta=0.15, w_min=1.0, budget=0.06)
    _, grad, _ = lib_loss("cppo_prefix_mean", padded(seqs), opts, "token-mean")
    fd = _fd_grad("cppo_prefix_mean", seqs, opts, "token-mean")[0]
    assert grad[0, :3].tolist() == pytest.approx(fd, rel=1e-6, abs=1e-9)
    assert grad[0, 1].item() == 0 and grad[0, 0].item() != 0 and grad[0, 2].item() != 0  # r_3 < 1: kept


def test_cppo_budget_compounds_where_the_prefix_mean_dilutes():
    """One early drift (D_1 = 0.1) then on-policy tokens that move slightly with A > 0 (D = 0.01 each).
    The cumulative budget C_t = 0.1 + 0.01·(t-1) passes B = 0.135 at t = 5 and stays past it, so every
    later token that moves is masked; the prefix mean (0.1 + 0.01·(t-1))/t only falls, so with the same
    bound it masks nothing."""
    n = 8
    lp = [math.log(0.6)] + [math.log(0.51)] * (n - 1)
    seqs = [dict(lp=lp, old=[math.log(0.5)] * n, adv=[1.0] * n, roll=[0.0] * n)]
    opts = dict(divergence="tv", delta=0.15, w_min=1.0, budget=0.135)
    _, grad, m = lib_loss("cppo", padded(seqs), opts, "token-mean")
    assert grad[0, :n].tolist() == pytest.approx(_fd_grad("cppo", seqs, opts, "token-mean")[0], rel=1e-6, abs=1e-9)
    kept = [g != 0 for g in grad[0, :n].tolist()]
    assert kept == [True, True, True, True, False, False, False, False]
    assert float(m["clipfrac_high"]) == pytest.approx(4 / n)
    _, grad_mean, _ = lib_loss("cppo_prefix_mean", padded(seqs), opts, "token-mean")
    assert all(g != 0 for g in grad_mean[0, :n].tolist())  # the mean never passes 0.135: the early drift diluted


def test_cppo_old_null_budget_names_the_prefix_mean_objective():
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^budget: .*cppo_prefix_mean"):
        policy_loss("cppo", x, x, x, torch.ones(1, 2), budget=None)


@pytest.mark.parametrize("gradient", ["token", "filter"])
def test_kpo_filter_runs_across_chunks(gradient):
    """Sequences longer than the filter's 64-token chunks, packed behind masked prompt tokens: the state
    must carry over chunk boundaries exactly (reference: the token loop), gradient included."""
    seqs = make_seqs(seed=16, lengths=(150, 70, 3), noise=0.3)
    opts = dict(process_var=0.05, obs_var=1.0, init_var=0.5, eps_low=0.1, eps_high=0.1, gradient=gradient)
    loss, grad, m = lib_loss("kpo", packed(seqs, prompt=5), opts, "token-mean")
    assert loss.item() == pytest.approx(ref_aggregate(ref_losses("kpo", seqs, opts), "token-mean"), rel=1e-10)
    assert 0 < float(m["clipfrac_low"]) + float(m["clipfrac_high"]) < 1
    flat = grad[packed(seqs, prompt=5)["mask"]].tolist()
    fd = [g for row in _fd_grad("kpo", seqs, opts, "token-mean") for g in row]
    assert flat == pytest.approx(fd, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name, opts", [("minpro", {}), ("dppo", {}), ("dppo", {"divergence": "kl"}), ("cppo", {}), ("cppo_prefix_mean", {}),
                                        ("dhpo", {}), ("holder", {"p": 2.0}), ("holder", {"p": -1.0}), ("kpo", {}),
                                        ("kpo", {"gradient": "filter"}), ("aspo", {}), ("ppo", {"clip_mode": "dynamic"})])
def test_overflowing_ratio_gives_finite_loss_and_gradient(name, opts):
    """float32 ratio e^100 at the last token (A > 0, where every one of them clips or masks it)."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = lp.detach() - torch.tensor([[0.1, 0.0, 100.0]])
    loss, _ = policy_loss(name, lp, old, torch.ones(1, 3), torch.ones(1, 3), **opts)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


def test_aspo_negative_overflow_is_capped_by_the_soft_dual_clip():
    lp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    old = lp.detach() - torch.tensor([[0.0, 100.0]])
    loss, m = policy_loss("aspo", lp, old, -torch.ones(1, 2), torch.ones(1, 2), dual_clip=3.0)
    loss.backward()
    # token 2's weight is capped at c = 3 (its gradient kept, not zeroed): d/dlp of -(-1)·3·lp / 2 tokens
    assert lp.grad[0, 1].item() == pytest.approx(3.0 / 2)
    assert float(m["clipfrac_dual"]) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- options


BAD_OPTIONS = [
    ("dppo", {"delta": 0}, "delta"), ("dppo", {"delta": -0.1}, "delta"), ("dppo", {"divergence": "js"}, "divergence"),
    ("cppo", {"delta": 0.0}, "delta"), ("cppo", {"w_min": 0}, "w_min"), ("cppo", {"w_min": 1.5}, "w_min"),
    ("cppo", {"budget": -1}, "budget"), ("cppo", {"budget": None}, "budget"), ("cppo", {"divergence": "hellinger"}, "divergence"),
    ("cppo_prefix_mean", {"budget": 0}, "budget"), ("cppo_prefix_mean", {"w_min": 2}, "w_min"),
    ("holder", {"p": "two"}, "p"), ("holder", {"p": True}, "p"),
    ("dhpo", {"alpha": 1.5}, "alpha"), ("dhpo", {"alpha": -0.1}, "alpha"), ("dhpo", {"seq_eps_low": -1}, "seq_eps_low"),
    ("kpo", {"obs_var": 0}, "obs_var"), ("kpo", {"process_var": -1}, "process_var"), ("kpo", {"gradient": "x"}, "gradient"),
    ("aspo", {"dual_clip": 1.0}, "dual_clip"), ("minpro", {"eps_low": -0.2}, "eps_low"),
    ("ppo", {"clip_mode": "adaptive"}, "clip_mode"), ("ppo", {"clip_mode": "dynamic", "ratio_cap": 1.0}, "ratio_cap"),
]


@pytest.mark.parametrize("name, opts, field", BAD_OPTIONS, ids=[f"{n}-{f}-{o[f]}" for n, o, f in BAD_OPTIONS])
def test_bad_options_refused_at_config_time(tmp_path, name, opts, field):
    overrides = [f"model.path={tmp_path}/new", f"algorithm.objective={name}",
                 "algorithm.objective_options={" + ", ".join(f"{k}: {_yaml(v)}" for k, v in opts.items()) + "}"]
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, REPO / "megapo/configs/tiny_moe_addition.yaml", overrides)
    assert err.value.field == "algorithm.objective_options", str(err.value)
    assert err.value.message.startswith(f"{field}:"), str(err.value)
    # the library refuses the same, before touching a tensor
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        policy_loss(name, x, x, x, torch.ones(1, 2), **opts)


def _yaml(value) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_holder_refuses_non_finite_p():
    x = torch.zeros(1, 2, dtype=torch.float64)
    for p in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match=r"^p:"):
            policy_loss("holder", x, x, x, torch.ones(1, 2), p=p)


def test_good_options_load(tmp_path):
    cfg = load_config(RunConfig, REPO / "megapo/configs/tiny_moe_addition.yaml",
                      [f"model.path={tmp_path}/new", "algorithm.objective=ppo",
                       "algorithm.objective_options={clip_mode: dynamic, eps_high: 0.28}"])
    assert cfg.algorithm.objective_options == {"clip_mode": "dynamic", "eps_high": 0.28}


NEW = ("minpro", "dppo", "cppo", "cppo_prefix_mean", "dhpo", "holder", "kpo", "aspo")


def test_listed_with_paper_seed_and_formula(capsys):
    assert main(["objectives", "--kind", "objective", "--formulas"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    by_name = {e.name: e for e in entries("objective")}
    for name in NEW:
        assert name in rows, name
        assert "arXiv:" in by_name[name].paper and by_name[name].paper in rows[name]
        assert by_name[name].formula.splitlines()[0].strip() in out
        for option in by_name[name].option_names():
            assert option in out
    assert "DCPO" in rows["ppo"] and "clip_mode" in out
