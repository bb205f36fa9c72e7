"""Probe cases of the class 'conventions: objectives vs papers': the objectives' and estimators' conventions
(MIS keeping rho, rejection sampling, default aggregations, whitening, groups of one) checked in a
subprocess against the papers' formulas.
"""

from __future__ import annotations

import json

from tools.probe.outcomes import message_line
from tools.probe.registry import case, config_refusal


CONVENTIONS = "conventions: objectives vs papers"
CONVENTION_PRELUDE = r'''
import json, math, torch
from megapo.algorithms import compute_advantages, correction_weights, policy_loss
torch.manual_seed(0)
mask = torch.ones(3, 4)
old = torch.log(torch.rand(3, 4) * 0.5 + 0.25).double()
mu = old + torch.tensor([[0.0, 0.3, -0.4, 0.05], [0.1, -0.1, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]).double()
rho = torch.exp(old - mu)
'''


def _convention(ctx, body: str, what: str):
    out = ctx.python(CONVENTION_PRELUDE + body)
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return out, ("poor", f"the probe script failed: {message_line(out)}")
    if got.get("ok"):
        return out, ("good", what)
    return out, ("wrong", f"{what}: not so ({got})")


@case(CONVENTIONS)
def mis_token_keeps_rho(ctx):
    return _convention(ctx, r'''
w, _ = correction_weights("mis_token", old, mu, mask.double(), lo=0.5, hi=2.0)
want = rho * ((rho >= 0.5) & (rho <= 2.0))
print(json.dumps({"ok": bool(torch.allclose(w, want, atol=1e-12)), "max_err": float((w - want).abs().max())}))
''', "mis_token weight = ρ·1[lo ≤ ρ ≤ hi] (the MIS write-up's, TRL's, slime's)")


@case(CONVENTIONS)
def mis_seq_keeps_rho(ctx):
    return _convention(ctx, r'''
w, _ = correction_weights("mis_seq", old, mu, mask.double(), lo=0.5, hi=2.0)
r = torch.exp((old - mu).sum(-1))
want = (r * ((r >= 0.5) & (r <= 2.0)))[:, None].expand_as(old)
print(json.dumps({"ok": bool(torch.allclose(w, want, atol=1e-12)), "max_err": float((w - want).abs().max())}))
''', "mis_seq weight = ρ_seq·1[lo ≤ ρ_seq ≤ hi] on every token")


@case(CONVENTIONS)
def rejection_form_is_named_rs(ctx):
    return _convention(ctx, r'''
w, _ = correction_weights("rs_token", old, mu, mask.double(), lo=0.5, hi=2.0)
want = ((rho >= 0.5) & (rho <= 2.0)).double()
print(json.dumps({"ok": bool(torch.equal(w, want))}))
''', "the rejection form 1[lo ≤ ρ ≤ hi] is rs_token")


def _paper_aggregation(name: str):
    # at ratio 1 every token of sequence i has the same loss c·A_i (c the same for positive A): with A = [1, 2]
    # over lengths [1, 3] a per-sequence mean is -c·(1 + 2)/2, a token mean -c·(1 + 3·2)/4; their ratio 6/7
    return r'''
logp = torch.zeros(2, 3, dtype=torch.float64)
mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=torch.float64)
adv = torch.tensor([1.0, 2.0], dtype=torch.float64)[:, None].expand(2, 3)
auto, _ = policy_loss("%s", logp, logp, adv, mask)
tok, _ = policy_loss("%s", logp, logp, adv, mask, loss_agg="token-mean")
print(json.dumps({"ok": abs(float(auto) / float(tok) - 6 / 7) < 1e-9, "auto": float(auto), "token_mean": float(tok)}))
''' % (name, name)


@case(CONVENTIONS)
def gspo_default_aggregation_is_per_sequence(ctx):
    return _convention(ctx, _paper_aggregation("gspo"), "gspo's default loss_agg averages per sequence (paper)")


@case(CONVENTIONS)
def sapo_default_aggregation_is_per_sequence(ctx):
    return _convention(ctx, _paper_aggregation("sapo"), "sapo's default loss_agg averages per sequence (paper)")


@case(CONVENTIONS)
def reinforce_pp_whitens_over_tokens_by_default(ctx):
    return _convention(ctx, r'''
r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
lengths = torch.tensor([[3, 1], [2, 2], [1, 5]])
a = r - r.mean(-1, keepdim=True)
w = lengths.double()
m = (w * a).sum() / w.sum()
s = ((w * (a - m) ** 2).sum() / w.sum()).sqrt()
token = (a - m) / (s + 1e-6)
response = (a - a.mean()) / (a.std(unbiased=False) + 1e-6)
got_default = compute_advantages("reinforce_pp_baseline", r, lengths=lengths)
got_response = compute_advantages("reinforce_pp_baseline", r, lengths=lengths, whiten="response")
print(json.dumps({"ok": bool(torch.allclose(got_default, token, atol=1e-12) and
                             torch.allclose(got_response, response, atol=1e-12) and
                             not torch.allclose(token, response, atol=1e-3))}))
''', "reinforce_pp_baseline whitens over tokens by default (OpenRLHF), over responses with whiten=response")


@case(CONVENTIONS)
def group_of_one_one_rule_in_the_estimators(ctx):
    return _convention(ctx, r'''
refused = {}
for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
    try:
        compute_advantages(name, torch.ones(3, 1), lengths=torch.ones(3, 1, dtype=torch.long))
        refused[name] = None
    except ValueError as err:
        refused[name] = str(err)
print(json.dumps({"ok": all(v and "at least 2 samples" in v for v in refused.values()), "refused": refused}))
''', "groups of one refused alike by grpo, dr_grpo, rloo, reinforce_pp_baseline (min_group=2)")


def _group_of_one(estimator: str):
    def probe(ctx):
        return config_refusal(ctx, f"n1_{estimator}", ("rollout.n_samples=1", f"algorithm.advantage={estimator}"),
                              ("rollout.n_samples",))
    probe.__name__ = f"group_of_one_refused_by_the_config_{estimator}"
    case(CONVENTIONS)(probe)


for _estimator in ("grpo", "dr_grpo", "rloo"):
    _group_of_one(_estimator)
