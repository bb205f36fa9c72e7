"""Train–inference mismatch corrections and metrics vs formulas written out here (loops/numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megapo.algorithms import correction_weights, mismatch_metrics, policy_loss

LENGTHS = [4, 1, 6, 3, 5]


def make(seed=0, spread=0.4):
    rng = np.random.default_rng(seed)
    seqs = []
    for n in LENGTHS:
        lp = -rng.uniform(0.05, 2.5, n)
        old = lp + rng.normal(0, 0.1, n)
        roll = old + rng.normal(0, spread, n)
        adv = np.full(n, rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5))
        seqs.append(dict(lp=lp, old=old, roll=roll, adv=adv))
    return seqs


def padded(seqs, width=8):
    t = {k: torch.zeros(len(seqs), width, dtype=torch.float64) for k in ("lp", "old", "roll", "adv")}
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s["lp"])
        for k in t:
            t[k][i, :n] = torch.from_numpy(s[k])
        mask[i, :n] = True
    return t, mask


def packed(seqs):
    t = {k: torch.from_numpy(np.concatenate([s[k] for s in seqs])) for k in ("lp", "old", "roll", "adv")}
    cu = torch.tensor([0] + list(np.cumsum([len(s["lp"]) for s in seqs])))
    return t, torch.ones(cu[-1].item(), dtype=torch.bool), cu


def ref_weights(name, s, opts):
    """Per-token weights of one sequence, written from the papers' definitions."""
    k = [math.exp(o - r) for o, r in zip(s["old"], s["roll"])]
    n = len(k)
    if name == "tis":
        return [min(x, opts.get("cap", 2.0)) for x in k]
    if name == "seq_tis":
        return [min(math.prod(k), opts.get("cap", 2.0))] * n
    lo, hi = opts.get("lo", 0.5), opts.get("hi", 2.0)
    if name == "mis_token":  # masked IS (the MIS write-up, TRL's token_mask): the ratio is kept inside the band
        return [x if lo <= x <= hi else 0.0 for x in k]
    if name == "mis_seq":  # sequence MIS (verl's, slime's): the sequence ratio on each of its tokens
        return [math.prod(k) if lo <= math.prod(k) <= hi else 0.0] * n
    if name == "rs_token":  # rejection: keep or drop, weight 1
        return [1.0 if lo <= x <= hi else 0.0 for x in k]
    if name == "rs_seq":
        return [1.0 if lo <= math.prod(k) <= hi else 0.0] * n
    if name == "rs_geo":
        lo, hi = opts.get("lo", 0.999), opts.get("hi", 1.001)
        g = math.prod(k) ** (1.0 / n)
        return [1.0 if lo <= g <= hi else 0.0] * n
    if name == "icepop":
        a, b = opts.get("alpha", 0.5), opts.get("beta", 5.0)
        return [x if a <= x <= b else 0.0 for x in k]
    raise KeyError(name)


CASES = [
    ("tis", {"cap": 1.2}),
    ("tis", {}),
    ("seq_tis", {"cap": 1.5}),
    ("mis_token", {"lo": 0.7, "hi": 1.3}),
    ("mis_token", {}),
    ("mis_seq", {"lo": 0.5, "hi": 2.0}),
    ("rs_token", {"lo": 0.7, "hi": 1.3}),
    ("rs_seq", {"lo": 0.5, "hi": 2.0}),
    ("rs_geo", {"lo": 0.9, "hi": 1.1}),
    ("icepop", {"alpha": 0.8, "beta": 1.25}),
    ("icepop", {}),
]


@pytest.mark.parametrize("name, opts", CASES)
def test_correction_in_policy_loss(name, opts):
    seqs = make(seed=1)
    w_ref = [ref_weights(name, s, opts) for s in seqs]
    flat = [x for w in w_ref for x in w]
    t, mask = padded(seqs)
    lp = t["lp"].clone().requires_grad_(True)
    loss, m = policy_loss("reinforce", lp, t["old"], t["adv"], mask, t["roll"],
                          correction=name, correction_options=opts)
    loss.backward()
    n_tok = sum(LENGTHS)
    expected = sum(-w * a * l for s, ws in zip(seqs, w_ref) for w, a, l in zip(ws, s["adv"], s["lp"])) / n_tok
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    for i, (s, ws) in enumerate(zip(seqs, w_ref)):
        for t_, (w, a) in enumerate(zip(ws, s["adv"])):
            assert lp.grad[i, t_].item() == pytest.approx(-w * a / n_tok, rel=1e-12, abs=1e-15)
    assert float(m["correction_masked_frac"]) == pytest.approx(sum(x == 0 for x in flat) / n_tok)
    assert float(m["correction_weight_mean"]) == pytest.approx(sum(flat) / n_tok)


@pytest.mark.parametrize("name, opts", CASES)
def test_correction_weights_packed(name, opts):
    seqs = make(seed=2)
    t, mask, cu = packed(seqs)
    w, _ = correction_weights(name, t["old"], t["roll"], mask, cu_seqlens=cu, **opts)
    expected = [x for s in seqs for x in ref_weights(name, s, opts)]
    assert w.shape == t["old"].shape
    assert np.allclose(w.numpy(), expected, rtol=1e-12, atol=0)


def test_masking_corrections_do_mask_something():
    """The random data has tokens on both sides of each band (so the tests above can fail)."""
    seqs = make(seed=1)
    for name, opts in CASES:
        if name.startswith(("mis", "rs_")) or (name == "icepop" and opts):
            flat = [x for s in seqs for x in ref_weights(name, s, opts)]
            assert 0 < flat.count(0.0) < len(flat), name
        if name.startswith("mis"):  # and kept weights that differ from 1 (so ρ-kept and rejection differ)
            assert any(x not in (0.0, 1.0) for s in seqs for x in ref_weights(name, s, opts)), name


def test_mis_keeps_the_ratio_where_rejection_keeps_one():
    """The same tokens survive mis_* and rs_*; mis_* weights them by their ratio, rs_* by 1."""
    seqs = make(seed=1)
    t, mask, cu = packed(seqs)
    for mis, rs in (("mis_token", "rs_token"), ("mis_seq", "rs_seq")):
        w_mis, _ = correction_weights(mis, t["old"], t["roll"], mask, cu_seqlens=cu)
        w_rs, _ = correction_weights(rs, t["old"], t["roll"], mask, cu_seqlens=cu)
        assert torch.equal(w_mis > 0, w_rs > 0) and set(w_rs.unique().tolist()) == {0.0, 1.0}
    rho = torch.exp(t["old"] - t["roll"])  # token level: the kept weight is the token's own ratio
    w_mis, _ = correction_weights("mis_token", t["old"], t["roll"], mask, cu_seqlens=cu)
    assert torch.allclose(w_mis[w_mis > 0], rho[w_mis > 0], rtol=1e-12)


def test_mismatch_metrics():
    seqs = make(seed=3)
    old = np.concatenate([s["old"] for s in seqs])
    roll = np.concatenate([s["roll"] for s in seqs])
    rho = np.exp(old - roll)
    expect = {
        "mismatch_k1": np.mean(roll - old),
        "mismatch_k3": np.mean(rho - 1 - np.log(rho)),
        "mismatch_chi2": np.mean(rho**2) - 1,
        "mismatch_ess": rho.sum() ** 2 / (len(rho) * (rho**2).sum()),
        "mismatch_max_abs_dlogp": np.max(np.abs(old - roll)),
    }
    t, mask = padded(seqs)
    m_pad = mismatch_metrics(t["old"], t["roll"], mask)
    tp, maskp, cu = packed(seqs)
    m_pack = mismatch_metrics(tp["old"], tp["roll"], maskp, cu_seqlens=cu)
    _, m_loss = policy_loss("ppo", t["lp"], t["old"], t["adv"], mask, t["roll"])
    for key, value in expect.items():
        for m in (m_pad, m_pack, m_loss):
            assert float(m[key]) == pytest.approx(value, rel=1e-12), key


def test_no_mismatch_metrics_without_rollout():
    t, mask = padded(make())
    _, m = policy_loss("ppo", t["lp"], t["old"], t["adv"], mask)
    assert not any(k.startswith("mismatch") for k in m)


@pytest.mark.parametrize(
    "name, opts, argument",
    [("tis", {"cap": 0}, "cap"), ("mis_token", {"lo": 2.0, "hi": 1.0}, "lo"), ("icepop", {"alpha": -1}, "alpha"),
     ("tis", {"lo": 1}, "options"), ("nope", {}, "correction")],
)
def test_bad_correction_options(name, opts, argument):
    t, mask = padded(make())
    with pytest.raises(ValueError, match=rf"^{argument}"):
        policy_loss("ppo", t["lp"], t["old"], t["adv"], mask, t["roll"], correction=name, correction_options=opts)
