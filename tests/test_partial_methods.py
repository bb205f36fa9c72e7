"""Three methods completed from partial ones, each against a loop written here from its paper's formula:

- HölderPO's annealing of p over trainer steps (Hölder Policy Optimisation, arXiv:2605.12058): the schedules,
  LossSpec.at_step (how the step reaches the loss) and the trainer handing each step's resolved spec to the update;
- A-DLP, the accuracy-driven length-penalty weight (Thinking Fast and Right: Balancing Accuracy and Reasoning
  Length with Adaptive Rewards, arXiv:2505.18298): the shaped rewards and λ over steps and sampling rounds, its
  state through JSON, the trainer's length stage;
- STAPO's entropy threshold as the train batch's percentile (STAPO: Stabilizing Reinforcement Learning for LLMs
  by Silencing Rare Spurious Tokens, arXiv:2602.15620) and token_select's per-trajectory percentile (Not only
  where, But when: Temporal Scheduling for RLVR, arXiv:2605.25381), with the 4 micro-batches x 2 DP shards split.

Bad options are refused at config time naming the field."""

from __future__ import annotations

import json
import math
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.length import ScoredGroup, build_length_reward
from megapo.algorithms.spec import LossSpec
from megapo.algorithms.stages import token_mask_weights, token_select_weights
from megapo.config import ConfigError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from objective_loops import assert_ppo_shards_sum, stapo_reference  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=4, seed=5)
F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- HölderPO's annealed p


def paper_p(schedule, p_start, p_end, steps, power, step):
    """The paper's code's schedules, in its min/max form, at our 1-based step."""
    x = min(1.0, (step - 1) / steps)
    lo, hi = min(p_start, p_end), max(p_start, p_end)
    mid, amp = (lo + hi) / 2, (hi - lo) / 2
    rising = p_end >= p_start
    if schedule == "linear":
        return lo + (hi - lo) * x if rising else hi - (hi - lo) * x
    if schedule == "cosine":  # its sin (rising) / cos (falling): S-curves through the midpoint
        return mid - amp * math.cos(math.pi * x) if rising else mid + amp * math.cos(math.pi * x)
    if schedule == "poly":
        return lo + (hi - lo) * x ** power if rising else hi - (hi - lo) * x ** power
    if schedule == "cubic":
        return mid + amp * (2 * x - 1) ** 3 if rising else mid - amp * (2 * x - 1) ** 3
    raise AssertionError(schedule)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "poly", "cubic"])
@pytest.mark.parametrize("p_start, p_end", [(2.0, -2.0), (-1.0, 1.0)])
def test_holder_schedules_against_the_papers_code(schedule, p_start, p_end):
    spec = LossSpec("holder", objective_options=dict(schedule=schedule, p_start=p_start, p_end=p_end,
                                                     schedule_steps=8, power=3.0))
    for step in range(1, 13):
        at = spec.at_step(step)
        want = paper_p(schedule, p_start, p_end, 8, 3.0, step)
        assert at.objective_options["p"] == pytest.approx(want, abs=1e-12), (schedule, step)
        assert at.objective_options["schedule"] == "constant" and at.objective == "holder"
        assert {k: v for k, v in vars(at).items() if k != "objective_options"} == \
               {k: v for k, v in vars(spec).items() if k != "objective_options"}  # nothing else moves
    assert spec.at_step(1).objective_options["p"] == pytest.approx(p_start, abs=1e-12)
    assert spec.at_step(9).objective_options["p"] == pytest.approx(p_end, abs=1e-12)
    constant = LossSpec("holder", objective_options={"p": 0.5})
    assert constant.at_step(7) is constant and LossSpec("ppo").at_step(3) == LossSpec("ppo")


def test_holder_loss_at_a_step_is_the_power_mean_loss_of_that_p():
    g = torch.Generator().manual_seed(3)
    lengths = [5, 3, 6, 2]
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    old = -torch.rand(4, width, generator=g, dtype=F64) * 2
    logp = old + torch.randn(4, width, generator=g, dtype=F64) * 0.3
    adv = torch.tensor([0.9, -1.1, 0.4, -0.2], dtype=F64)[:, None].expand(4, width).contiguous()
    spec = LossSpec("holder", objective_options=dict(schedule="linear", p_start=2.0, p_end=-2.0,
                                                     schedule_steps=4, eps_low=0.1, eps_high=0.1))
    for step in (1, 2, 3, 5):
        p = 2.0 - 4.0 * min(1.0, (step - 1) / 4)
        want = 0.0
        for i, n in enumerate(lengths):
            ratios = [math.exp(logp[i, t].item() - old[i, t].item()) for t in range(n)]
            if p == 0:
                rho = math.exp(sum(math.log(r) for r in ratios) / n)
            else:
                rho = (sum(r ** p for r in ratios) / n) ** (1 / p)
            a = adv[i, 0].item()
            want += max(-a * rho, -a * min(max(rho, 0.9), 1.1)) / len(lengths)
        got, _ = policy_loss(spec.at_step(step), logp, old, adv, mask)
        assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-15), step


def test_the_trainer_hands_each_step_its_resolved_spec(monkeypatch):
    from megapo.trainer import run

    seen = []
    monkeypatch.setattr(run, "update_policy", lambda learner, groups, cfg, ref, loss, timer, **kw:
                        seen.append((kw["step"], loss)) or {})
    cfg = make_cfg(objective="holder", objective_options={"schedule": "linear", "schedule_steps": 2})
    fake = SimpleNamespace(cfg=cfg, learner=None, reference=None, loss=cfg.loss_spec(), teachers=None, critic=None,
                           reward_model=None, prompt_stats=None, tokenizer=None, eval_due=lambda step, last: False)
    for step in (1, 2, 3, 4):
        run.Run.update(fake, step, [], None)
    assert [(s, spec.objective_options["p"]) for s, spec in seen] == [(1, 2.0), (2, 0.0), (3, -2.0), (4, -2.0)]


@pytest.mark.parametrize("options, words", [
    ({"schedule": "linear"}, "schedule_steps:"),
    ({"schedule": "cosine", "schedule_steps": 0}, "schedule_steps:"),
    ({"schedule": "step", "schedule_steps": 5}, "schedule: must be one of constant, linear, cosine, poly, cubic"),
    ({"schedule": "linear", "schedule_steps": 5, "p": 1.0}, "p: set by schedule"),
    ({"schedule": "poly", "schedule_steps": 5, "power": 0}, "power:"),
    ({"schedule": "linear", "schedule_steps": 5, "p_end": float("nan")}, "p_end:"),
    ({"schedule_steps": -1}, "schedule_steps:"),
])
def test_holder_schedule_refused_at_config_time(options, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(objective="holder", objective_options=options)
    assert err.value.field.startswith("algorithm.objective_options") and words in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- A-DLP


def _group(key, rewards, lengths, threshold=0.5):
    r = torch.tensor(rewards, dtype=F64)
    return ScoredGroup(key, 2, r, r >= threshold, torch.tensor(lengths, dtype=torch.int64),
                       torch.zeros(len(rewards), dtype=torch.bool))


CALLS = [  # (trainer step, groups): step 2 has two sampling rounds
    (1, [_group("a", [1.0, 0.0, 1.0, 1.0], [10, 30, 12, 8]), _group("b", [0.0, 0.0, 1.0, 0.0], [40, 35, 20, 50])]),
    (2, [_group("c", [1.0, 1.0, 1.0, 0.0], [9, 11, 14, 60])]),
    (2, [_group("d", [1.0, 1.0, 1.0, 1.0], [7, 8, 9, 10])]),
    (3, [_group("e", [0.0, 0.0, 0.0, 1.0], [70, 80, 90, 15]), _group("f", [0.0, 1.0, 0.0, 0.0], [5, 6, 7, 8])]),
    (4, [_group("g", [1.0, 0.0, 1.0, 1.0], [20, 25, 30, 35])]),
]


def adlp_loop(calls, lambda_init, lr, acc_ref):
    """R' = R − λ_t·L; after each step λ ← max(0, λ + η·(acc_t − acc_ref)), acc_ref the first step's when unset."""
    lam, ref, out = lambda_init, acc_ref, []
    by_step = {}
    for step, groups in calls:
        by_step.setdefault(step, []).append(groups)
    lam_at = {}
    for step in sorted(by_step):
        lam_at[step] = lam
        flags = [bool(c) for groups in by_step[step] for g in groups for c in g.correct.tolist()]
        acc = sum(flags) / len(flags)
        if ref is None:
            ref = acc
        lam = max(0.0, lam + lr * (acc - ref))
    for step, groups in calls:
        out.append([[r - lam_at[step] * n for r, n in zip(g.rewards.tolist(), g.lengths.tolist())] for g in groups])
    return out, lam_at


@pytest.mark.parametrize("options", [{"lambda_init": 0.01, "lr": 0.05}, {"lambda_init": 0.002, "lr": 0.2,
                                                                          "acc_ref": 0.4}, {}])
def test_adlp_against_a_loop(options):
    o = {"lambda_init": 1e-3, "lr": 1e-3, "acc_ref": None, **options}
    want, lam_at = adlp_loop(CALLS, o["lambda_init"], o["lr"], o["acc_ref"])
    method = build_length_reward("adlp", options, 160)
    for (step, groups), w in zip(CALLS, want):
        got = method.shape(groups, step)
        assert [x.tolist() for x in got] == [pytest.approx(row, rel=1e-13, abs=1e-15) for row in w]
        assert method.metrics()["lambda"] == pytest.approx(lam_at[step], rel=1e-13, abs=1e-16)
    if "acc_ref" not in options:
        assert method.metrics()["acc_ref"] == pytest.approx(4 / 8)  # the first step's accuracy
    assert len(set(lam_at.values())) > 1 or o["lr"] == 0  # λ moved


def test_adlp_raises_the_penalty_when_accuracy_is_high_and_relaxes_it_when_low():
    method = build_length_reward("adlp", {"lambda_init": 0.01, "lr": 0.1, "acc_ref": 0.5}, 160)
    high, low = _group("h", [1.0, 1.0, 1.0, 0.0], [5] * 4), _group("l", [0.0, 0.0, 0.0, 1.0], [5] * 4)
    method.shape([high], 1), method.shape([high], 2)
    assert method.metrics()["lambda"] == pytest.approx(0.01 + 0.1 * 0.25)
    for step in range(3, 8):
        method.shape([low], step)
    assert method.metrics()["lambda"] == 0.0  # projected at 0, never a bonus for length


def test_adlp_state_through_json_gives_the_unstopped_outputs():
    options = {"lambda_init": 0.003, "lr": 0.07}
    straight = build_length_reward("adlp", options, 160)
    want = [[x.tolist() for x in straight.shape(g, s)] for s, g in CALLS]
    for k in range(1, len(CALLS)):  # stopped after any call, mid-step included (after the first round of step 2)
        first = build_length_reward("adlp", options, 160)
        for s, g in CALLS[:k]:
            first.shape(g, s)
        resumed = build_length_reward("adlp", options, 160)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got = [[x.tolist() for x in resumed.shape(g, s)] for s, g in CALLS[k:]]
        assert got == want[k:], k
        assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize("state, words", [
    ({"lambda": -1.0, "acc_ref": None, "step": 0, "correct": 0, "total": 0}, "adlp lambda"),
    ({"lambda": 0.1, "acc_ref": 2.0, "step": 0, "correct": 0, "total": 0}, "adlp acc_ref"),
    ({"lambda": 0.1, "acc_ref": None, "step": 1, "correct": 5, "total": 4}, "correct <= total"),
    ({"lambda": 0.1}, "adlp expects keys"),
])
def test_adlp_refuses_a_bad_state(state, words):
    with pytest.raises(ValueError, match=words):
        build_length_reward("adlp", {}, 160).load_state_dict(state)


def _length_cfg(*overrides):
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, ROOT / "megapo/configs/length_base.yaml", ["rollout.n_samples=4", *overrides])


@pytest.mark.parametrize("options, words", [
    ("{acc_ref: 1.5}", "acc_ref"), ("{lr: -0.1}", "lr"), ("{lambda_init: .nan}", "lambda_init"),
    ("{eta: 0.1}", "eta"),
])
def test_adlp_options_refused_at_config_time(options, words):
    with pytest.raises(ConfigError) as err:
        _length_cfg("data.length_reward=adlp", f"data.length_reward_options={options}")
    assert err.value.field.startswith("data.length_reward_options") and words in str(err.value), str(err.value)


def test_adlp_through_the_trainers_length_stage_and_its_checkpoint_state():
    from megapo.engines.base import Sample
    from megapo.tasks.base import Example
    from megapo.trainer.length_stage import LengthStage
    from megapo.trainer.rollout import Group

    def group(prompt, rewards, lengths):
        samples = [Sample([1, 2], list(range(3, 3 + n)), [-0.1] * n, "stop", 0) for n in lengths]
        return Group(Example(prompt, "0", difficulty=2), samples, list(rewards))

    cfg = _length_cfg("data.length_reward=adlp", "data.length_reward_options={lambda_init: 0.01, lr: 0.5}")
    stage = LengthStage(cfg)
    batches = [[group("p", [1.0, 0.0, 1.0, 0.0], [10, 20, 30, 40])], [group("q", [1.0, 1.0, 1.0, 0.0], [5, 6, 7, 8])],
               [group("r", [1.0, 1.0, 1.0, 1.0], [9, 9, 9, 9])]]
    lams = []
    for b in batches:
        stage.begin_batch()
        [out] = stage.apply(b)
        lams.append(stage.metrics()["length/lambda"])
        lengths = [len(s.output_ids) for s in b[0].samples]
        assert out.rewards == pytest.approx([r - lams[-1] * n for r, n in zip(b[0].rewards, lengths)], rel=1e-13)
    assert lams == pytest.approx([0.01, 0.01, 0.01 + 0.5 * 0.25], rel=1e-13)
    resumed = LengthStage(cfg, json.loads(json.dumps(stage.state_dict())))
    assert resumed.state_dict() == stage.state_dict()


# ----------------------------------------------------------------------------- STAPO's batch entropy percentile


def percentile(values, q):
    """Linear interpolation between order statistics (numpy's / torch.quantile's default)."""
    v = sorted(values)
    pos = q / 100 * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def stapo_batch():
    lengths = [5, 3, 6, 4, 2, 7, 3, 4]
    g = torch.Generator().manual_seed(11)
    old = [(-torch.rand(n, generator=g, dtype=F64) * 4).tolist() for n in lengths]
    ent = [(torch.rand(n, generator=g, dtype=F64)).tolist() for n in lengths]
    advantages = [0.9, -0.5, 1.3, 0.4, -1.1, 0.7, [0.2, -0.9, 0.1], -0.3]
    return lengths, advantages, old, ent


def stapo_loop(advantages, old, ent, prob_max, q, renorm, tau=None):
    tau = percentile([h for row in ent for h in row], q) if tau is None else tau
    return stapo_reference(advantages, old, ent, prob_max, tau, renorm)


@pytest.mark.parametrize("renorm", ["batch", "sequence", "none"])
@pytest.mark.parametrize("q", [None, 30.0, 60.0])
def test_stapo_percentile_against_a_loop(renorm, q):
    lengths, advantages, old, ent = stapo_batch()
    opts = dict(prob_max=0.3, renorm=renorm, **({} if q is None else {"entropy_percentile": q}))
    got = token_mask_weights("stapo", lengths=lengths, advantages=advantages, old_logp=old, entropy=ent, **opts)
    want = stapo_loop(advantages, old, ent, 0.3, 5.0 if q is None else q, renorm)
    for g_row, w_row in zip(got, want):
        assert g_row.tolist() == pytest.approx(w_row, rel=1e-13)
    if q == 60.0 and renorm == "none":
        assert 0 < sum(w == 0 for row in want for w in row) < sum(lengths)  # the mask bites, not everywhere
    absolute = token_mask_weights("stapo", lengths=lengths, advantages=advantages, old_logp=old, entropy=ent,
                                  prob_max=0.3, entropy_max=0.5, renorm=renorm)
    want_abs = stapo_loop(advantages, old, ent, 0.3, None, renorm, tau=0.5)  # entropy_max: the absolute threshold
    for g_row, w_row in zip(absolute, want_abs):
        assert g_row.tolist() == pytest.approx(w_row, rel=1e-13)


def _pad(rows, width):
    out = torch.zeros(len(rows), width, dtype=F64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=F64)
    return out


def _split_matches_one_batch(lengths, advantages, old, weights):
    """4 micro-batches x 2 DP shards (one sequence each), each with the batch's weights: loss and gradient of the
    single batch, to 1e-12."""
    width = max(lengths)
    g = torch.Generator().manual_seed(9)
    lp = _pad([torch.tensor(o, dtype=F64) + torch.randn(len(o), generator=g, dtype=F64) * 0.2 for o in old], width)
    o, w = _pad(old, width), _pad(weights, width)
    adv = _pad([a if isinstance(a, list) else [a] * n for a, n in zip(advantages, lengths)], width)
    mask = _pad([[1] * n for n in lengths], width).bool()
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss("ppo", x, o, adv, mask, loss_agg="token-mean", token_weight=w)
    full.backward()
    assert_ppo_shards_sum(lp, o, adv, mask, lengths, full, x.grad, token_weight=w)  # 2 DP x 4 micro


def test_stapo_percentile_is_the_whole_batchs_and_splits():
    lengths, advantages, old, ent = stapo_batch()
    opts = dict(prob_max=0.3, entropy_percentile=60.0)
    weights = token_mask_weights("stapo", lengths=lengths, advantages=advantages, old_logp=old, entropy=ent, **opts)
    _split_matches_one_batch(lengths, advantages, old, weights)
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # the batch in another order (as another sharding would see it): same weights
    permuted = token_mask_weights("stapo", lengths=[lengths[i] for i in order],
                                  advantages=[advantages[i] for i in order], old_logp=[old[i] for i in order],
                                  entropy=[ent[i] for i in order], **opts)
    for j, i in enumerate(order):
        assert permuted[j].tolist() == pytest.approx(weights[i].tolist(), rel=1e-13)
    half = token_mask_weights("stapo", lengths=lengths[:4], advantages=advantages[:4], old_logp=old[:4],
                              entropy=ent[:4], renorm="none", **opts)  # a shard's own percentile differs
    whole = token_mask_weights("stapo", lengths=lengths, advantages=advantages, old_logp=old, entropy=ent,
                               renorm="none", **opts)
    assert [r.tolist() for r in half] != [r.tolist() for r in whole[:4]]


@pytest.mark.parametrize("stage, words", [
    ({"entropy_percentile": 0}, "entropy_percentile"),
    ({"entropy_percentile": 100}, "entropy_percentile"),
    ({"entropy_percentile": 5, "entropy_max": 0.3}, "not both"),
    ({"entropy_percentile": True}, "entropy_percentile"),
])
def test_stapo_percentile_refused_at_config_time(stage, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "stapo", **stage}])
    assert err.value.field.startswith("algorithm.stages[0]") and words in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- token_select per trajectory


def select_loop(advantages, ent, rho, weight, score):
    out = []
    for a, h in zip(advantages, ent):
        a_row = a if isinstance(a, list) else [a] * len(h)
        s = list(h) if score == "entropy" else [abs(x) * y for x, y in zip(a_row, h)]
        k = max(1, math.ceil(rho * len(s) - 1e-9))
        tau = sorted(s, reverse=True)[k - 1]
        out.append([1.0 if v >= tau else weight for v in s])
    return out


@pytest.mark.parametrize("score", ["entropy", "adv_entropy"])
def test_token_select_per_trajectory_against_a_loop_with_its_schedule(score):
    lengths, advantages, old, ent = stapo_batch()
    opts = dict(rho=0.25, rho_end=1.0, anneal_steps=4, weight=0.1, score=score, scope="trajectory")
    for step in (1, 3, 5, 9):
        rho = 0.25 + 0.75 * min(1.0, (step - 1) / 4)
        got = token_select_weights(advantages, ent, step=step, **opts)
        want = select_loop(advantages, ent, rho, 0.1, score)
        assert [r.tolist() for r in got] == [pytest.approx(w, rel=1e-13) for w in want], step
    assert all(r.eq(1).all() for r in token_select_weights(advantages, ent, step=5, **opts))  # attenuated to uniform
    batch_scope = token_select_weights(advantages, ent, step=1, **{**opts, "scope": "batch"})
    assert [r.tolist() for r in batch_scope] != [r.tolist() for r in token_select_weights(advantages, ent, **opts)]


def test_token_select_per_trajectory_splits():
    lengths, advantages, old, ent = stapo_batch()
    opts = dict(rho=0.4, weight=0.0, scope="trajectory")
    weights = token_select_weights(advantages, ent, step=1, **opts)
    _split_matches_one_batch(lengths, advantages, old, weights)
    for lo, hi in ((0, 2), (2, 6), (6, 8)):  # each response's weights are its own: any shard computes the same
        part = token_select_weights(advantages[lo:hi], ent[lo:hi], step=1, **opts)
        assert [r.tolist() for r in part] == [r.tolist() for r in weights[lo:hi]]


def test_token_select_scope_refused_at_config_time():
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "token_select", "scope": "sequence"}])
    assert err.value.field.startswith("algorithm.stages[0]") and "scope" in str(err.value), str(err.value)
