"""The top-K seam's methods of issue 32 against references written out here from torch.log_softmax of the unsharded
float64 logits (never the functions' own outputs):

- OTB (Li et al. 2026, The Optimal Token Baseline, arXiv:2602.07078): the vocabulary-parallel Σ_v p_v² and the
  Logit-Gradient Proxy 1 − 2p_y + Σp² against autograd's ‖∇_z log softmax(z)_y‖²; the per-token baseline
  B_t = Σ_i G_i W_{i,t} / (Σ_i W_{i,t} + ε) as loops over each group's responses;
- Lp-Reg (Huang et al. 2025, arXiv:2510.03222): the min-p proxy log-probs (relative and fixed thresholds) as loops over
  the vocabulary, and the objective's loss and its gradient in the logits against the formula as loops;
- both reductions under TP=2 (torchrun, gloo, each rank its vocabulary slice), the options' refusals by name.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.objectives import low_prob_flags
from megapo.algorithms.otb import OTBOptions, otb_advantages
from megapo.algorithms.spec import LossSpec, LossSpecError
from megapo.config import ConfigError
from megapo.learner.logprobs import logit_grad_sq_norm, vocab_parallel_min_p_logprobs, vocab_parallel_sum_p2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithm_configs import make_cfg  # noqa: E402
from one_rank import ONE, response_pass_stub  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DROPPED = -1e30  # the seam's log q of a token the proxy drops (q = 0)



def padded_logits(*shape, vocab, padded, seed, scale=2.0):
    """Random float64 logits over `padded` entries whose last padded − vocab are padding (at 50: larger than any real
    logit, so an unmasked padding entry would dominate)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, padded, generator=gen, dtype=torch.float64) * scale
    z[..., vocab:] = 50.0
    return z


def ref_sum_p2(z):
    return torch.log_softmax(z, dim=-1).mul(2).exp().sum(-1)


def ref_proxy_logp(z_row, y, min_p, mode):
    """log q(y) of the min-p proxy of softmax(z_row), written out over the vocabulary; None where y is dropped."""
    p = [math.exp(x) for x in torch.log_softmax(z_row, dim=-1).tolist()]
    tau = min_p * max(p) if mode == "relative" else min_p
    kept = [v for v in range(len(p)) if p[v] >= tau]
    return math.log(p[y] / sum(p[v] for v in kept)) if y in kept else None


# ----------------------------------------------------------------------------- OTB


def test_sum_p2_and_its_gradient_match_softmax_on_one_rank():
    z = padded_logits(3, 4, vocab=9, padded=11, seed=0).requires_grad_(True)
    ref = z.detach()[..., :9].clone().requires_grad_(True)
    weights = torch.randn(3, 4, dtype=torch.float64)
    got = vocab_parallel_sum_p2(z, vocab_size=9, group=ONE)
    want = ref_sum_p2(ref)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    (weights * got).sum().backward()
    (weights * want).sum().backward()
    torch.testing.assert_close(z.grad[..., :9], ref.grad, rtol=0, atol=1e-14)
    assert z.grad[..., 9:].abs().max() == 0


def test_logit_gradient_proxy_is_the_squared_logit_gradient_norm_of_log_pi():
    """‖∇_z log softmax(z)_y‖² by autograd, position by position, against 1 − 2p_y + Σp² from the seam."""
    z = padded_logits(6, vocab=9, padded=10, seed=1)
    targets = torch.tensor([0, 3, 8, 5, 1, 7])
    sum_p2 = vocab_parallel_sum_p2(z, vocab_size=9, group=ONE)
    logp = torch.log_softmax(z[:, :9], dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    got = logit_grad_sq_norm(logp, sum_p2)
    for t in range(6):
        zt = z[t, :9].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(torch.log_softmax(zt, dim=-1)[targets[t]], zt)
        assert got[t].item() == pytest.approx(grad.square().sum().item(), abs=1e-13)


def test_learner_response_sum_p2_reads_the_response_slots(monkeypatch):
    """Learner.response_sum_p2's glue on a hand-made micro-batch (2 sequences at 2 and 3 selected slots; the schedule
    and the cross-rank sharing stubbed): each sequence's Σp² at its slots, against softmax of the full logits."""
    from functools import partial
    from types import SimpleNamespace

    import megapo.learner.learner as learner_mod
    from megapo.learner.learner import Learner

    monkeypatch.setattr(learner_mod, "vocab_parallel_sum_p2", partial(vocab_parallel_sum_p2, group=ONE))
    V = 6
    logits = padded_logits(2, 4, vocab=V, padded=V, seed=21)
    select = torch.tensor([1, 2, 5, 6, 7])
    mb = SimpleNamespace(select=select, order=[0, 1], sizes=[2, 3], head_selected=False)
    me = response_pass_stub(logits, V, mb)
    got = Learner.response_sum_p2(me, [[1, 2, 3, 4], [1, 2, 3, 4, 5]], [2, 2])
    want = ref_sum_p2(logits.reshape(-1, V)[select])
    torch.testing.assert_close(got[0], want[:2].float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[2:].float(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="^prompt_lens:"):
        Learner.response_sum_p2(me, [[1, 2, 3]], [3])


def ref_otb(rewards, logits, targets, group_size, eps, zero_tail):
    """A_{i,t} = R_i − B_t with B_t = Σ_i R_i W_{i,t} / (Σ_i W_{i,t} + ε) over the group's responses reaching t,
    W_{i,t} = Σ_{j≤t} (1 − 2π(y_j) + Σ_v π(v)²), π from log_softmax; loops throughout."""
    energy = []
    for z, y in zip(logits, targets):
        lp = torch.log_softmax(z, dim=-1).tolist()
        w, acc = [], 0.0
        for t in range(len(y)):
            acc += 1 - 2 * math.exp(lp[t][int(y[t])]) + sum(math.exp(2 * x) for x in lp[t])
            w.append(acc)
        energy.append(w)
    out = []
    for g0 in range(0, len(rewards), group_size):
        members = list(range(g0, g0 + group_size))
        lengths = [len(targets[i]) for i in members]
        for i in members:
            adv = []
            for t in range(len(targets[i])):
                alive = [k for k in members if len(targets[k]) > t]
                base = 0.0 if group_size == 1 else (sum(rewards[k] * energy[k][t] for k in alive)
                                                    / (sum(energy[k][t] for k in alive) + eps))
                ordered = sorted(lengths)
                if zero_tail and group_size > 1 and ordered[-1] > ordered[-2] \
                        and len(targets[i]) == ordered[-1] and t >= ordered[-2]:
                    base = 0.0
                adv.append(rewards[i] - base)
            out.append(adv)
    return out


@pytest.mark.parametrize("zero_tail", [True, False])
def test_otb_advantages_are_the_papers_baseline_written_out(zero_tail):
    lengths = [4, 6, 3, 5, 5, 2]  # group 0: one longest (6); group 1: two longest (5)
    rewards = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # the lone longest response is correct: zero_tail changes its tail
    gen = torch.Generator().manual_seed(2)
    logits = [padded_logits(n, vocab=7, padded=8, seed=10 + i, scale=1.5) for i, n in enumerate(lengths)]
    targets = [torch.randint(0, 7, (n,), generator=gen) for n in lengths]
    old_logp = [torch.log_softmax(z[:, :7], dim=-1).gather(-1, y[:, None]).squeeze(-1) for z, y in zip(logits, targets)]
    sum_p2 = [vocab_parallel_sum_p2(z, vocab_size=7, group=ONE) for z in logits]
    returns = [torch.full((n,), r, dtype=torch.float64) for n, r in zip(lengths, rewards)]
    got = otb_advantages(returns, old_logp, sum_p2, 3, OTBOptions(zero_tail=zero_tail))
    want = ref_otb(rewards, [z[:, :7] for z in logits], targets, 3, 1e-8, zero_tail)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.tensor(w, dtype=torch.float64), rtol=0, atol=1e-12)


def test_otb_group_of_one_keeps_the_return():
    z = padded_logits(3, vocab=5, padded=5, seed=4)
    lp = torch.log_softmax(z, dim=-1)[:, 0]
    got = otb_advantages([torch.full((3,), 0.7, dtype=torch.float64)], [lp], [ref_sum_p2(z)], 1, OTBOptions())
    torch.testing.assert_close(got[0], torch.full((3,), 0.7, dtype=torch.float64))


@pytest.mark.parametrize("options, name", [(dict(eps=0.0), "eps"), (dict(eps=float("nan")), "eps"),
                                           (dict(zero_tail="yes"), "zero_tail")])
def test_otb_options_refused_by_name(options, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        OTBOptions(**options)


def test_otb_refuses_a_group_size_that_does_not_divide_the_batch():
    x = [torch.zeros(2, dtype=torch.float64)] * 3
    with pytest.raises(ValueError, match="^group_size:"):
        otb_advantages(x, x, x, 2, OTBOptions())


# ----------------------------------------------------------------------------- Lp-Reg: the proxy


@pytest.mark.parametrize("mode, min_p", [("relative", 0.1), ("relative", 0.5), ("fixed", 0.05), ("fixed", 0.2)])
def test_min_p_proxy_matches_the_filter_written_out_on_one_rank(mode, min_p):
    z = padded_logits(5, 4, vocab=9, padded=11, seed=5)
    targets = torch.randint(0, 9, (5, 4), generator=torch.Generator().manual_seed(6))
    got = vocab_parallel_min_p_logprobs(z, targets, min_p=min_p, mode=mode, vocab_size=9, group=ONE)
    dropped = 0
    for i in range(5):
        for t in range(4):
            want = ref_proxy_logp(z[i, t, :9], int(targets[i, t]), min_p, mode)
            dropped += want is None
            assert got[i, t].item() == (DROPPED if want is None else pytest.approx(want, abs=1e-12))
    assert 0 < dropped < 20  # both cases occur


def test_min_p_proxy_refuses_its_arguments_by_name():
    z = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="^mode:"):
        vocab_parallel_min_p_logprobs(z, torch.zeros(2, dtype=torch.long), min_p=0.1, mode="top", vocab_size=4,
                                      group=ONE)
    with pytest.raises(ValueError, match="^min_p:"):
        vocab_parallel_min_p_logprobs(z, torch.zeros(2, dtype=torch.long), min_p=0.0, vocab_size=4, group=ONE)


def test_reductions_match_softmax_under_tp2(tmp_path):
    """Two processes, each half of a padded vocabulary of 14 (13 real: rank 1 holds one padding entry)."""
    from megapo.launch.local import run_torchrun

    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    from seam_reductions import inputs

    spec = dict(seed=7, rows=12, vocab=13, padded=14, min_p={"relative": 0.15, "fixed": 0.04})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out.pt"
    rc = run_torchrun([str(ROOT / "tests" / "distributed" / "seam_reductions.py"), "--spec",
                       str(tmp_path / "spec.json"), "--out", str(out)], 2, timeout_s=120)
    assert rc == 0
    got = torch.load(out, weights_only=False)
    logits, targets, weights = inputs(spec)
    assert got["ranks_agree"]
    full = logits.clone().requires_grad_(True)
    want = ref_sum_p2(full[:, :13])
    torch.testing.assert_close(got["sum_p2"], want.detach(), rtol=0, atol=1e-14)
    (weights * want).sum().backward()
    torch.testing.assert_close(got["grad"], full.grad, rtol=0, atol=1e-14)
    for mode in ("relative", "fixed"):
        for r in range(spec["rows"]):
            ref = ref_proxy_logp(logits[r, :13], int(targets[r]), spec["min_p"][mode], mode)
            assert got[mode][r].item() == (DROPPED if ref is None else pytest.approx(ref, abs=1e-12))


# ----------------------------------------------------------------------------- Lp-Reg: the objective


def ref_lp_reg(z, targets, old, adv, mask, *, min_p, neg_fraction, pos_fraction, beta, eps):
    """The loss as the formula reads, token by token from log_softmax(z) (loops), token-mean; differentiable in z.
    The sparks' candidates: per advantage sign, the ⌈ρ·n⌉ lowest π_old of the whole batch's n tokens of that sign."""
    S, T = targets.shape
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    total, count = 0.0, 0
    valid = [(i, t) for i in range(S) for t in range(T) if mask[i, t]]
    chosen = set()
    for sign, share in ((-1, neg_fraction), (1, pos_fraction)):
        flagged = [it for it in valid if adv[it] * sign > 0]
        k = math.ceil(share * len(flagged)) if share > 0 else 0
        chosen |= set(sorted(flagged, key=lambda it: old[it].item())[:k])
    for i in range(S):
        for t in [t for t in range(T) if mask[i, t]]:
            q = ref_proxy_logp(z[i, t].detach(), int(targets[i, t]), min_p, "relative")
            r = torch.exp(logp[i, t] - old[i, t])
            a = adv[i, t]
            if (i, t) in chosen and q is not None and logp[i, t].item() < q:
                d = q - logp[i, t]
                total = total + (-a * r + beta * torch.clamp(torch.exp(d) - d - 1, max=10.0))
            else:
                total = total + torch.max(-a * r, -a * torch.clamp(r, 1 - eps, 1 + eps))
            count += 1
    return total / count


def test_lp_reg_matches_the_formula_in_loss_and_gradient_in_the_logits():
    S, T, V = 3, 8, 7
    z0 = padded_logits(S, T, vocab=V, padded=V + 1, seed=8, scale=1.5)
    targets = torch.randint(0, V, (S, T), generator=torch.Generator().manual_seed(9))
    logp0 = torch.log_softmax(z0[..., :V], dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    old = logp0 + torch.randn(S, T, dtype=torch.float64, generator=torch.Generator().manual_seed(10)) * 0.2
    adv = torch.tensor([-1.0, 0.8, -0.6], dtype=torch.float64)[:, None].expand(S, T).clone()
    mask = torch.ones(S, T, dtype=torch.bool)
    mask[2, 6:] = False
    opts = dict(min_p=0.15, neg_fraction=0.4, pos_fraction=0.3, beta=0.5)

    ref_z = z0[..., :V].clone().requires_grad_(True)
    want = ref_lp_reg(ref_z, targets, old, adv, mask, eps=0.2, **opts)
    want.backward()

    z = z0.clone().requires_grad_(True)
    logp = torch.log_softmax(z[..., :V], dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    proxy = vocab_parallel_min_p_logprobs(z.detach(), targets, min_p=0.15, vocab_size=V, group=ONE)
    spec = LossSpec("lp_reg", objective_options=dict(eps_low=0.2, eps_high=0.2, **opts))
    rows = [mask[i].sum().item() for i in range(S)]
    flags = low_prob_flags([old[i, :n].tolist() for i, n in enumerate(rows)], [adv[i, :n].tolist() for i, n in
                           enumerate(rows)], None, opts["neg_fraction"], opts["pos_fraction"])
    low_prob = torch.zeros(S, T, dtype=torch.float64)
    for i, f in enumerate(flags):
        low_prob[i, :len(f)] = f
    got, metrics = policy_loss(spec, logp, old, adv, mask, proxy_logp=proxy, low_prob=low_prob)
    got.backward()
    assert got.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(z.grad[..., :V], ref_z.grad, rtol=0, atol=1e-12)
    # the example exercises both branches: some tokens regularised toward the proxy, some clipped
    sparks = sum(1 for i in range(S) for t in range(T) if mask[i, t] and
                 (q := ref_proxy_logp(z0[i, t, :V], int(targets[i, t]), 0.15, "relative")) is not None
                 and logp0[i, t].item() < q)
    assert sparks > 0 and metrics["clipfrac_high"] + metrics["clipfrac_low"] > 0


def test_lp_reg_without_sparks_is_ppo():
    torch.manual_seed(11)
    logp = -torch.rand(2, 5, dtype=torch.float64)
    old = logp + torch.randn(2, 5, dtype=torch.float64) * 0.3
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64).expand(2, 5).clone()
    mask = torch.ones(2, 5, dtype=torch.bool)
    got, _ = policy_loss("lp_reg", logp, old, adv, mask, neg_fraction=0.0, eps_low=0.2, eps_high=0.2,
                         proxy_logp=torch.zeros(2, 5, dtype=torch.float64),
                         low_prob=torch.zeros(2, 5, dtype=torch.float64))
    ratio = torch.exp(logp - old)
    assert got.item() == pytest.approx(torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean().item(), abs=1e-12)


@pytest.mark.parametrize("options, name", [(dict(min_p=0.0), "min_p"), (dict(min_p=1.5), "min_p"),
                                           (dict(threshold="top"), "threshold"), (dict(neg_fraction=1.5), "neg_fraction"),
                                           (dict(pos_fraction=-0.1), "pos_fraction"), (dict(beta=-1.0), "beta"),
                                           (dict(eps_high=-0.1), "eps_high")])
def test_lp_reg_options_refused_by_name(options, name):
    with pytest.raises(LossSpecError) as err:
        LossSpec("lp_reg", objective_options=options)
    assert err.value.field == "objective_options" and str(err.value).startswith(name)


def test_lp_reg_refuses_a_missing_proxy_and_the_config_names_the_field():
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="^proxy_logp: required by objective 'lp_reg'"):
        policy_loss("lp_reg", x, x, x, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ConfigError) as err:
        make_cfg(objective="lp_reg", objective_options={"threshold": "top"})
    assert err.value.field == "algorithm.objective_options" and "threshold" in str(err.value)
    assert make_cfg(objective="lp_reg").loss_spec().objective_config().policy_proxy == (0.02, "relative")


def test_learner_glue_gives_lp_reg_the_proxy_at_the_selected_slots(monkeypatch):
    """The train step's proxy_logp on a hand-made micro-batch (2 packed rows of 4 slots, sequences of 2 and 3 selected
    slots) against the min-p filter written out over log_softmax of the micro-batch's full logits; padding stays 0."""
    from functools import partial
    from types import SimpleNamespace

    import megapo.learner.learner as learner_mod
    from megapo.learner.learner import Learner

    monkeypatch.setattr(learner_mod, "vocab_parallel_min_p_logprobs", partial(vocab_parallel_min_p_logprobs, group=ONE))
    V = 7
    logits = padded_logits(2, 4, vocab=V, padded=V, seed=12).requires_grad_(True)
    select = torch.tensor([1, 2, 5, 6, 7])
    targets = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(13))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    mb = SimpleNamespace(select=select, targets=targets, mask=mask, place=torch.tensor([0, 1, 3, 4, 5]),
                         head_selected=False)
    me = SimpleNamespace(spec=SimpleNamespace(vocab_size=V), _padded=Learner._padded)
    got = Learner._at_selected(lambda m, x: Learner._policy_proxy_logp(me, m, x, 0.2, "relative"), mb, logits)
    flat = logits.detach().reshape(-1, V)
    for n, (i, t) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]):
        want = ref_proxy_logp(flat[select[n]], int(targets[select[n]]), 0.2, "relative")
        assert got[i, t].item() == (DROPPED if want is None else pytest.approx(want, abs=1e-12))
    assert got[0, 2] == 0 and not got.requires_grad


# ----------------------------------------------------------------------------- RLPT


def ref_rlpt(z, targets, old, adv, mask, *, k, eps):
    """The masked policy written out: π̃_θ = softmax of the logits with every token outside the top-K at −inf, the
    ratio π̃_θ(y)/π̃_old(y) with π̃_old(y) = π_old(y)/sg(Σ_{v∈P} π_θ(v)), PPO's clip, loops, token-mean."""
    S, T = targets.shape
    total, count = 0.0, 0
    for i in range(S):
        for t in range(T):
            if not mask[i, t]:
                continue
            count += 1
            promising = torch.log_softmax(z[i, t].detach(), dim=-1).topk(k).indices.tolist()
            y = int(targets[i, t])
            if y not in promising:
                continue
            masked = torch.stack([z[i, t, v] if v in promising else z[i, t, v] * 0 - math.inf
                                  for v in range(z.shape[-1])])
            log_masked = torch.log_softmax(masked, dim=-1)[y]
            mass = torch.exp(torch.log_softmax(z[i, t], dim=-1))[promising].sum().detach()
            r = torch.exp(log_masked - (old[i, t] - torch.log(mass)))
            a = adv[i, t]
            total = total + torch.max(-a * r, -a * torch.clamp(r, 1 - eps, 1 + eps))
    return total / count


def rlpt_inputs(z, targets, k, vocab):
    """topk_lse and in_topk as the learner's seam computes them (one rank), from logits [S, T, V]."""
    from megapo.learner.logprobs import vocab_parallel_logprobs_at, vocab_parallel_topk

    ids, _ = vocab_parallel_topk(z.detach(), k, vocab_size=vocab, group=ONE)
    at = vocab_parallel_logprobs_at(z, ids, vocab_size=vocab, group=ONE)
    return torch.logsumexp(at, dim=-1), (ids == targets[..., None]).any(-1).to(z.dtype)


def test_rlpt_matches_the_masked_policy_in_loss_and_gradient_in_the_logits():
    S, T, V, K = 3, 6, 9, 3
    z0 = padded_logits(S, T, vocab=V, padded=V, seed=14, scale=1.5)
    targets = torch.randint(0, V, (S, T), generator=torch.Generator().manual_seed(15))
    targets[:, :3] = z0[:, :3].argmax(-1)  # half the sampled tokens surely inside the promising set
    logp0 = torch.log_softmax(z0, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    old = logp0 + torch.randn(S, T, dtype=torch.float64, generator=torch.Generator().manual_seed(16)) * 0.3
    adv = torch.tensor([1.0, -0.7, 0.5], dtype=torch.float64)[:, None].expand(S, T).clone()
    mask = torch.ones(S, T, dtype=torch.bool)
    mask[1, 5] = False

    ref_z = z0.clone().requires_grad_(True)
    want = ref_rlpt(ref_z, targets, old, adv, mask, k=K, eps=0.2)
    want.backward()

    z = z0.clone().requires_grad_(True)
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    lse, inside = rlpt_inputs(z, targets, K, V)
    got, metrics = policy_loss("rlpt", logp, old, adv, mask, k=K, topk_lse=lse, in_topk=inside)
    got.backward()
    assert got.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(z.grad, ref_z.grad, rtol=0, atol=1e-12)
    assert 0 < inside[mask].sum() < mask.sum() and metrics["clipfrac_high"] + metrics["clipfrac_low"] > 0


def test_rlpt_with_the_whole_vocabulary_is_ppo():
    V = 5
    z = padded_logits(2, 4, vocab=V, padded=V, seed=17).requires_grad_(True)
    targets = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(18))
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    old = logp.detach() + 0.25
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64).expand(2, 4).clone()
    mask = torch.ones(2, 4, dtype=torch.bool)
    lse, inside = rlpt_inputs(z, targets, V, V)  # K = V: the mask keeps everything, Σ π = 1
    got, _ = policy_loss("rlpt", logp, old, adv, mask, k=V, topk_lse=lse, in_topk=inside)
    ratio = torch.exp(logp - old)
    want = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    assert got.item() == pytest.approx(want.item(), abs=1e-12)


@pytest.mark.parametrize("options, name", [(dict(k=0), "k"), (dict(k=2.5), "k"), (dict(eps_low=-0.1), "eps_low")])
def test_rlpt_options_refused_by_name(options, name):
    with pytest.raises(LossSpecError) as err:
        LossSpec("rlpt", objective_options=options)
    assert err.value.field == "objective_options" and str(err.value).startswith(name)


def test_rlpt_refuses_missing_inputs_and_the_config_names_the_field():
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="^topk_lse: required by objective 'rlpt'"):
        policy_loss("rlpt", x, x, x, torch.ones(1, 2, dtype=torch.bool), in_topk=x)
    with pytest.raises(ConfigError) as err:
        make_cfg(objective="rlpt", objective_options={"k": 0})
    assert err.value.field == "algorithm.objective_options" and "k" in str(err.value)
    assert make_cfg(objective="rlpt", objective_options={"k": 4}).loss_spec().objective_config().policy_topk == 4


def test_learner_glue_gives_rlpt_the_promising_mass_and_membership(monkeypatch):
    """_policy_topk_inputs' topk_lse / in_topk on a hand-made micro-batch against log_softmax of its full logits."""
    from functools import partial
    from types import SimpleNamespace

    import megapo.learner.learner as learner_mod
    from megapo.learner.learner import Learner
    from megapo.learner.logprobs import vocab_parallel_logprobs_at, vocab_parallel_topk

    monkeypatch.setattr(learner_mod, "vocab_parallel_topk", partial(vocab_parallel_topk, group=ONE))
    monkeypatch.setattr(learner_mod, "vocab_parallel_logprobs_at", partial(vocab_parallel_logprobs_at, group=ONE))
    V = 7
    logits = padded_logits(2, 4, vocab=V, padded=V, seed=19).requires_grad_(True)
    select = torch.tensor([1, 2, 5, 6, 7])
    targets = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(20))
    targets[5] = logits[1, 1].argmax()
    mask = torch.tensor([[True, True, False], [True, True, True]])
    mb = SimpleNamespace(select=select, targets=targets, mask=mask, place=torch.tensor([0, 1, 3, 4, 5]),
                         head_selected=False)
    me = SimpleNamespace(spec=SimpleNamespace(vocab_size=V), _padded=Learner._padded)
    got = Learner._at_selected(lambda m, x: Learner._policy_topk_inputs(me, m, x, 3), mb, logits)
    full = torch.log_softmax(logits.detach().reshape(-1, V)[select], dim=-1)
    for n, (i, t) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]):
        top = full[n].topk(3)
        assert got["topk_lse"][i, t].item() == pytest.approx(math.log(top.values.exp().sum().item()), abs=1e-12)
        assert got["in_topk"][i, t].item() == float(int(targets[select[n]]) in top.indices.tolist())
    assert got["in_topk"][1, 0] == 1.0 and got["topk_lse"].requires_grad and got["topk_lse"][0, 2] == 0


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("objective, options", [("lp_reg", "{min_p: 0.1, neg_fraction: 1.0}"), ("rlpt", "{k: 4}")])
def test_train_two_steps(tmp_path, tiny_moe, objective, options):
    """`megapo train` with lp_reg (the learner builds the min-p proxy from its train forward's logits; every response's
    negative tokens considered) and with rlpt (the promising set's mass from the top-k seam, K = 4): both steps update
    with a finite loss."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, objective, f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", f"algorithm.objective={objective}",
                      f"algorithm.objective_options={options}")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_nonfinite"] == 0 for r in rows)


def test_the_otb_stage_in_the_loop_takes_sum_p2_on_the_replayed_routes():
    """update.advantage_stages with otb listed: one response_sum_p2 call on the samples' routes, and each token's
    advantage is the paper's baseline written out (ref_otb) from the rewards, π_old and those Σπ²."""
    from types import SimpleNamespace

    from algorithm_configs import make_cfg
    from megapo.algorithms.sample import TrainSample
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    lengths, rewards = [3, 4, 2, 4], [1.0, 0.0, 0.0, 1.0]
    gen = torch.Generator().manual_seed(5)
    logits = [padded_logits(n, vocab=7, padded=7, seed=30 + i, scale=1.5) for i, n in enumerate(lengths)]
    targets = [torch.randint(0, 7, (n,), generator=gen) for n in lengths]
    batch = [TrainSample([1, 2] + y.tolist(), 2, 0.5, routes=f"routes{i}",
                         old_logp=torch.log_softmax(z, -1).gather(-1, y[:, None]).squeeze(-1).tolist())
             for i, (z, y) in enumerate(zip(logits, targets))]
    calls = []

    class SumP2Learner:
        def response_sum_p2(self, sequences, prompt_lens, routes=None):
            calls.append((sequences, prompt_lens, routes))
            return [torch.softmax(z, -1).pow(2).sum(-1) for z in logits]

    groups = [SimpleNamespace(rewards=rewards[:2], samples=[None, None], privileged=False),
              SimpleNamespace(rewards=rewards[2:], samples=[None, None], privileged=False)]
    cfg = make_cfg(stages=[{"name": "otb"}], n_samples=2)
    metrics = advantage_stages(SumP2Learner(), batch, groups, cfg, 1, None, StepTimer())
    assert calls == [([s.tokens for s in batch], [2, 2, 2, 2], [f"routes{i}" for i in range(4)])]
    want = ref_otb(rewards, logits, targets, 2, 1e-8, True)
    for s, w in zip(batch, want):
        assert s.advantage == pytest.approx(w, abs=1e-12)
    assert "otb/baseline_mean" in metrics
