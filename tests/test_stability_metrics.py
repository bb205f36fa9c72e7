"""The stability study's per-step metrics and the off-policy loop (issue 13).

- router disagreement against a formula written out over hand-made route arrays (top-k SETS: the same
  experts in another order agree; entries without an engine route are not counted);
- the engine-vs-learner k3 / max |Δlogp| against the formula;
- train.mini_batches = m > 1 through loop.update_policy with a stand-in learner that records what every call
  received: π_old fixed over the m updates (the log-probs of the weights before the first update), the routes
  replayed on every update (r2: the old pass's own, r3: the engine's), μ = the engine's log-probs beside π_old
  for the correction, exactly m mini-batches of whole groups even when the groups do not divide evenly;
- the issue's done-when runs: `megapo train tiny_moe_addition.yaml rollout.dtype=bfloat16 train.steps=3` logs a
  non-zero router/disagree and mismatch KL without replay, and train/replay/disagree_post == 0 under r3.
"""

import math
import sys

import numpy as np
import pytest
import torch

from megapo.replay.modes import engine_mismatch, route_disagreement

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from train_runs import train_rows  # noqa: E402


# ----------------------------------------------------------------------------- metric formulas


def disagreement_by_hand(engine, learner):
    """Written out over (sequence, position, layer): Python sets of the k experts; a route with a negative id is
    missing (not counted)."""
    pairs = differ = tokens = tokens_differ = 0
    per_layer = {}
    for e_seq, l_seq in zip(engine, learner):
        for e_pos, l_pos in zip(e_seq, l_seq):
            counted = any_differ = False
            for layer, (e, o) in enumerate(zip(e_pos, l_pos)):
                if min(e) < 0:
                    continue
                counted = True
                d = set(e.tolist()) != set(o.tolist())
                pairs += 1
                differ += d
                any_differ |= d
                n, k = per_layer.get(layer, (0, 0))
                per_layer[layer] = (n + 1, k + d)
            tokens += counted
            tokens_differ += any_differ
    return differ / pairs, tokens_differ / tokens, {layer: k / n for layer, (n, k) in per_layer.items()}


def test_router_disagreement_matches_the_set_formula():
    rng = np.random.default_rng(0)
    layers, experts, k = 3, 8, 2
    engine, learner = [], []
    for length in (5, 9, 1, 12):
        e = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(length)])
        own = e.copy()
        flip = rng.random((length, layers)) < 0.3  # another expert set there
        own[flip, 0] = (own[flip, 1] + 1 + rng.integers(0, experts - 2, flip.sum())) % experts
        own[flip, 0] = np.where(own[flip, 0] == own[flip, 1], (own[flip, 0] + 1) % experts, own[flip, 0])
        swap = rng.random((length, layers)) < 0.5  # the same set in the other order: agreement
        own[swap] = own[swap][:, ::-1]
        e[rng.random((length, layers)) < 0.1] = -1  # no engine route there
        engine.append(e.astype(np.int32))
        learner.append(own.astype(np.int32))
    got = route_disagreement(engine, learner)
    want, want_any, want_layers = disagreement_by_hand(engine, learner)
    assert 0.1 < want < 0.5 and want < want_any  # the draw exercises both measures
    assert got["router/disagree"] == pytest.approx(want)
    assert got["router/disagree_any"] == pytest.approx(want_any)
    for layer in range(layers):
        assert got[f"router/disagree_l{layer}"] == pytest.approx(want_layers[layer])


def test_router_disagreement_small_cases_and_shape_error():
    same_other_order = [np.array([[[0, 1], [2, 3]]])]
    assert route_disagreement(same_other_order, [np.array([[[1, 0], [3, 2]]])])["router/disagree"] == 0.0
    got = route_disagreement([np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])],
                             [np.array([[[1, 0], [2, 4]], [[4, 5], [6, 7]]])])
    assert got == {"router/disagree": 0.25, "router/disagree_any": 0.5, "router/disagree_l0": 0.0,
                   "router/disagree_l1": 0.5}
    with pytest.raises(ValueError, match=r"routes\[0\]: engine routes \[1, 2, 2\] vs learner routes \[2, 2, 2\]"):
        route_disagreement(same_other_order, [np.zeros((2, 2, 2), dtype=np.int32)])


def test_engine_mismatch_matches_k3_formula():
    samples = [{"rollout_logp": [-1.0, -0.5]}, {"rollout_logp": [-2.0]}]
    learner = [torch.tensor([-1.1, -0.5]), torch.tensor([-1.5])]
    rho = [math.exp(-1.1 + 1.0), 1.0, math.exp(-1.5 + 2.0)]
    got = engine_mismatch(samples, learner)
    assert got["k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 3)
    assert got["max_abs_dlogp"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- m > 1 mini-batches


LAYERS, TOPK, EXPERTS = 2, 2, 8


def own_route(tokens, version):
    """The stand-in learner's own routing at weights `version`: [n-1, L, k]."""
    pos = np.arange(len(tokens) - 1)[:, None, None]
    t = np.asarray(tokens[:-1])[:, None, None]
    layer = np.arange(LAYERS)[None, :, None]
    j = np.arange(TOPK)[None, None, :]
    return ((t + pos + layer + version + 3 * j) % EXPERTS).astype(np.int32)


def logp_at(tokens, version):
    """The stand-in learner's log-probs of tokens 1.. at weights `version`."""
    return torch.tensor([-0.1 - 0.01 * version - 0.001 * t for t in tokens[1:]])


class StandInHook:
    def __init__(self, learner):
        self.learner = learner
        self.used = None

    def routes_used(self, n):
        return self.used[:n]

    def metrics(self):
        return {"replay/disagree_pre": 0.0}


class RecordingLearner:
    """The Learner contract as records: log-probs and own routes depend on how many updates ran (`version`)."""

    def __init__(self, hook: bool):
        self.version = 0
        self.calls = []  # ("logprobs", version, routes given) / ("train_step", version, batch copy, options)
        self.route_hook = StandInHook(self) if hook else None

    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        self.calls.append(("logprobs", self.version, routes))
        if self.route_hook is not None:
            self.route_hook.used = [r if r is not None and routes is not None else own_route(s, self.version)
                                    for s, r in zip(sequences, routes or [None] * len(sequences))]
        return [logp_at(s, self.version) for s in sequences]

    def train_step(self, batch, loss):
        from megapo.algorithms import policy_loss

        self.calls.append(("train_step", self.version, [dict(s) for s in batch], loss))
        # the loss the real learner would take on this mini-batch: its TIS weights from old_logp and rollout_logp
        logp = torch.cat([logp_at(s["tokens"], self.version)[s["prompt_len"] - 1:] for s in batch])
        old = torch.cat([torch.tensor(s["old_logp"]) for s in batch])
        mu = torch.cat([torch.tensor(s["rollout_logp"], dtype=torch.float32) for s in batch])
        lens = torch.tensor([0] + [len(s["old_logp"]) for s in batch])
        adv = torch.cat([torch.full((len(s["old_logp"]),), s["advantage"]) for s in batch])
        _, metrics = policy_loss(loss, logp, old, adv, torch.ones_like(logp), mu, cu_seqlens=lens.cumsum(0))
        self.version += 1
        return {k: float(v) for k, v in metrics.items()}


def make_groups(num_groups, n=2):
    from megapo.engines.base import Sample
    from megapo.trainer.rollout import Group

    rng = np.random.default_rng(1)
    groups = []
    for g in range(num_groups):
        prompt = [10 + g, 20 + g, 30]
        samples = []
        for i in range(n):
            out = [40 + g + i, 50 + i, 2][: 2 + (g + i) % 2]
            tokens = prompt + out
            routes = np.stack([np.stack([rng.choice(EXPERTS, TOPK, replace=False) for _ in range(LAYERS)])
                               for _ in range(len(tokens) - 1)]).astype(np.int32)
            logps = [-0.2 - 0.05 * j for j in range(len(out))]
            samples.append(Sample(prompt_ids=prompt, output_ids=out, logprobs=logps, finish_reason="stop",
                                  weight_version=0, routes=routes))
        groups.append(Group(example=None, samples=samples, rewards=[float(i == g % n) for i in range(n)]))
    return groups


@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
@pytest.mark.parametrize("num_groups", [8, 7])  # 7: the groups do not divide into 4 evenly
def test_mini_batches_keep_pi_old_and_routes_fixed(mode, num_groups):
    from megapo.trainer.config import RunConfig
    from megapo.trainer.update import update_policy
    from megapo.trainer.metrics import StepTimer

    m, n = 4, 2
    cfg = RunConfig()
    cfg.rollout.n_samples = n
    cfg.algorithm.objective = "ppo"
    cfg.algorithm.routing_replay = mode
    cfg.algorithm.mismatch = "tis"
    cfg.train.mini_batches = m
    groups = make_groups(num_groups, n)
    learner = RecordingLearner(hook=mode != "off")
    metrics = update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer())

    kinds = [c[0] for c in learner.calls]
    assert kinds == ["logprobs"] + ["train_step"] * m  # one old pass, before any update; exactly m updates
    old_call = learner.calls[0]
    assert old_call[1] == 0
    samples = [s for g in groups for s in g.samples]
    if mode == "r3":
        assert all((given == s.routes).all() for given, s in zip(old_call[2], samples))
    else:
        assert old_call[2] is None  # off / r2: the old pass routes freely
    trained = []
    for version, (_, at, batch, loss) in enumerate(learner.calls[1:]):
        assert at == version  # the m updates follow one another on changing weights
        assert loss.correction == "tis"
        assert len(batch) % n == 0 and len({tuple(s["tokens"][:s["prompt_len"]]) for s in batch}) == len(batch) // n
        for s in batch:
            engine = samples[len(trained)]
            trained.append(s)
            assert s["tokens"] == engine.prompt_ids + engine.output_ids
            # π_old: the weights before the first update (version 0), on every mini-batch
            assert s["old_logp"] == pytest.approx(logp_at(s["tokens"], 0)[s["prompt_len"] - 1:].tolist())
            assert s["rollout_logp"] == engine.logprobs  # μ: the engine's, beside π_old
            if mode == "off":
                assert "routes" not in s
            else:  # replayed on every update: r3 the engine's routes, r2 the old pass's own (version 0)
                want = engine.routes if mode == "r3" else own_route(s["tokens"], 0)
                assert (s["routes"] == want).all()
    assert len(trained) == num_groups * n  # every sample once
    sizes = sorted(len(c[2]) // n for c in learner.calls[1:])
    assert sizes == ([2, 2, 2, 2] if num_groups == 8 else [1, 2, 2, 2])
    # the last mini-batch's TIS weights are min(π_old/μ, 2) of its tokens
    last = learner.calls[-1][2]
    ratio = torch.cat([torch.tensor(s["old_logp"]) - torch.tensor(s["rollout_logp"]) for s in last]).exp()
    assert metrics["train/correction_weight_mean"] == pytest.approx(float(ratio.clamp(max=2.0).mean()), rel=1e-5)
    # the stability metrics of the whole batch: π_old vs μ, and (hook) the learner's own routes vs the engine's
    old = [logp_at(s.prompt_ids + s.output_ids, 0)[len(s.prompt_ids) - 1:] for s in samples]
    assert metrics["mismatch/k3"] == pytest.approx(engine_mismatch([{"rollout_logp": s.logprobs} for s in samples],
                                                                   old)["k3"])
    if mode == "r3":  # no free-routing pass this step
        assert "mismatch/k3_free" not in metrics
    else:  # off / r2: the old pass routed freely
        assert metrics["mismatch/k3_free"] == metrics["mismatch/k3"]
    if mode == "r2":
        want = route_disagreement([s.routes for s in samples], [own_route(s.prompt_ids + s.output_ids, 0)
                                                                for s in samples])
        assert {k: metrics[k] for k in want} == want and want["router/disagree"] > 0.5
    else:  # off: no hook in the stand-in; r3: no free-routing pass this step
        assert "router/disagree" not in metrics


# ----------------------------------------------------------------------------- the done-when runs


def bf16_engine_rows(tmp_path, tiny_moe, mode, *extra):
    return train_rows(tmp_path, f"run_{mode}", "rollout.dtype=bfloat16", f"algorithm.routing_replay={mode}",
                      "train.steps=3", f"model.path={tiny_moe}", "data.prompts_per_step=16", *extra)


def test_bf16_engine_disagrees_without_replay_and_r3_replays_exactly(tmp_path, tiny_moe):
    rows = bf16_engine_rows(tmp_path, tiny_moe, "off")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["router/disagree"] > 0 and r["router/disagree_any"] >= r["router/disagree"]
        assert r["mismatch/k3"] > 0 and r["mismatch/max_abs_dlogp"] > 0
        assert r["mismatch/k3_free"] == r["mismatch/k3"]  # no replay: π_old is the free routing's
        assert "train/replay/disagree_post" not in r and r["collapse/collapsed"] in (0, 1)
    rows = bf16_engine_rows(tmp_path, tiny_moe, "r3", "train.stability_metrics_every=2")
    for r in rows:
        assert r["train/replay/disagree_post"] == 0.0 and r["mismatch/k3"] > 0
    assert "router/disagree" not in rows[0] and "router/disagree" not in rows[2]  # every 2nd step only
    assert rows[1]["router/disagree"] > 0 and rows[1]["mismatch/k3_free"] > 0 and rows[1]["time/stability"] > 0


# ----------------------------------------------------------------------------- the logged collapse flag


def test_collapse_flag_as_the_run_goes_and_after_a_resume():
    from megapo.trainer.collapse import CollapseWatch

    def row(step):
        r = {"reward": 0.3 if step < 12 else 0.01, "train/loss": 0.1}  # the reward falls at step 12 and stays
        if step % 5 == 0:
            r["eval/accuracy"] = 0.4
        return r

    watch = CollapseWatch()
    flags = {s: watch.add(s, row(s)) for s in range(0, 25)}
    assert all(flags[s]["collapse/collapsed"] == 0 and "collapse/step" not in flags[s] for s in range(0, 21))
    # ten low-reward steps 12..21 complete at step 21; the collapse is dated to their first
    assert all(flags[s]["collapse/collapsed"] == 1 and flags[s]["collapse/step"] == 12 for s in range(21, 25))
    assert flags[3]["reward"] == 0.3  # the metrics pass through
    # a resume from step 18's checkpoint: the rows after it (logged again next) are dropped from the history
    earlier = [{"step": s, **row(s)} for s in range(0, 24)]
    resumed = CollapseWatch(earlier, upto=18)
    assert resumed.add(19, row(19))["collapse/collapsed"] == 0
    assert resumed.add(20, row(20))["collapse/collapsed"] == 0
    assert resumed.add(21, row(21)) == {**row(21), "collapse/collapsed": 1, "collapse/step": 12}
