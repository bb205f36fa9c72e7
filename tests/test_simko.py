"""Objective simko (megapo/algorithms/objectives.py) against the formula of SimKO (Peng et al. 2025, arXiv:2510.14807)
written out here in the paper's own form: π_θ's and π_old's log-probs at each of the K candidates, the ratio
(1 − α w)·γ + (α w / K)·Σ_k sg(γ)/sg(γ_k)·γ_k, the row quantile of the entropies, λ on an incorrect response's top-1
high-entropy tokens and PPO's clip as torch.max / torch.clamp: loss and gradients (to log π_θ(y_t) and to each
candidate's log π_θ(v_k)) agree; and the options' refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.spec import LossSpec, LossSpecError
from megapo.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithm_configs import make_cfg  # noqa: E402


def paper_form(logp, old, cand, cand_old, adv, mask, entropy, top1, *, k, mix, tau, neg_scale, eps):
    """The per-token loss as the paper's formula reads, token by token (loops), then token-mean."""
    S, T = logp.shape
    total, count = 0.0, 0
    for i in range(S):
        valid = [t for t in range(T) if mask[i, t]]
        threshold = torch.quantile(entropy[i, valid], tau)
        correct = sum(adv[i, t] for t in valid) > 0
        incorrect = sum(adv[i, t] for t in valid) < 0
        for t in valid:
            w = 1.0 if entropy[i, t] > threshold else 0.0
            gamma = torch.exp(logp[i, t] - old[i, t])
            a = adv[i, t] * (neg_scale if incorrect and w and top1[i, t] else 1.0)
            if correct:
                terms = sum(gamma.detach() / torch.exp(cand[i, t, j] - cand_old[i, t, j]).detach()
                            * torch.exp(cand[i, t, j] - cand_old[i, t, j]) for j in range(k))
                ratio = (1 - mix * w) * gamma + (mix * w / k) * terms
            else:
                ratio = gamma
            total = total + torch.max(-a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps))
            count += 1
    return total / count


def test_simko_matches_the_papers_formula_in_loss_and_gradients():
    torch.manual_seed(0)
    S, T, K = 4, 6, 3
    logp0 = -torch.rand(S, T, dtype=torch.float64) * 2 - 0.05
    old = (logp0 + torch.randn(S, T, dtype=torch.float64) * 0.15).clamp(max=-0.01)  # some ratios clip
    cand0 = -torch.rand(S, T, K, dtype=torch.float64) * 3
    cand_old = cand0 + torch.randn(S, T, K, dtype=torch.float64) * 0.1  # cancels out of the formula
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)[:, None].expand(S, T).clone()
    mask = torch.ones(S, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 5] = False
    entropy = torch.rand(S, T, dtype=torch.float64) * 2
    top1 = (torch.rand(S, T) > 0.4).to(torch.float64)
    opts = dict(k=K, mix=0.3, tau=0.6, neg_scale=1.5, eps=0.2)  # larger α, λ than the paper's: visible effects

    logp = logp0.clone().requires_grad_(True)
    cand = cand0.clone().requires_grad_(True)
    want = paper_form(logp, old, cand, cand_old, adv, mask, entropy, top1, **opts)
    want.backward()
    want_grads = logp.grad.clone(), cand.grad.clone()

    logp.grad, cand.grad = None, None
    spec = LossSpec("simko", objective_options=dict(k=K, mix=0.3, tau=0.6, neg_scale=1.5, eps_low=0.2, eps_high=0.2))
    got, metrics = policy_loss(spec, logp, old, adv, mask, old_entropy=entropy, top1=top1,
                               topk_logp_sum=cand.sum(-1))
    got.backward()
    assert got.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(logp.grad, want_grads[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(cand.grad, want_grads[1], rtol=0, atol=1e-12)
    assert cand.grad.abs().sum() > 0 and metrics["clipfrac_high"] + metrics["clipfrac_low"] > 0


def test_simko_with_no_mix_and_no_penalty_is_ppo():
    torch.manual_seed(1)
    logp = -torch.rand(3, 5, dtype=torch.float64)
    old = logp + torch.randn(3, 5, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 1, dtype=torch.float64).expand(3, 5).clone()
    mask = torch.ones(3, 5, dtype=torch.bool)
    got, _ = policy_loss("simko", logp, old, adv, mask, mix=0.0, neg_scale=1.0, old_entropy=torch.rand(3, 5).double(),
                         top1=torch.ones(3, 5).double(), topk_logp_sum=torch.zeros(3, 5).double())
    ratio = torch.exp(logp - old)
    want = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    assert got.item() == pytest.approx(want.item(), abs=1e-12)


@pytest.mark.parametrize("options, name", [(dict(k=0), "k"), (dict(mix=1.5), "mix"), (dict(tau=-0.1), "tau"),
                                           (dict(neg_scale=-1.0), "neg_scale"), (dict(eps_low=-0.1), "eps_low")])
def test_simko_options_refused_by_name(options, name):
    with pytest.raises(LossSpecError) as err:
        LossSpec("simko", objective_options=options)
    assert err.value.field == "objective_options" and str(err.value).startswith(name)


def test_simko_refuses_missing_topk_inputs():
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="^topk_logp_sum: required by objective 'simko'"):
        policy_loss("simko", x, x, x, torch.ones(1, 2, dtype=torch.bool), old_entropy=x, top1=x)


def test_simko_option_refused_by_the_config_naming_the_field():
    with pytest.raises(ConfigError) as err:
        make_cfg(objective="simko", objective_options={"k": 0})
    assert err.value.field == "algorithm.objective_options" and "k" in str(err.value)
    assert make_cfg(objective="simko", objective_options={"k": 5}).loss_spec().objective_config().policy_topk == 5
