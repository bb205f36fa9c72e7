"""THR (Deng et al. 2026, Token Hidden Reward: Steering Exploration-Exploitation in Group Relative Deep Reinforcement
Learning, arXiv:2510.03669), the stage thr, against the hidden reward written out here as its double sum over the
group's correct tokens, coordinate by coordinate of the prediction errors over the group's response vocabulary (never
the function's own output, nor its matrix form); NTHR's threshold; the reweighting 1 + p·sign(THR) on the dominant
tokens; the learner glue (log-probs at given ids against log_softmax, the loop's one pass for both inputs on the
replayed routes; the one pass against the two separate passes and transformers on the tiny MoE under TP=1, TP=2 and
EP=2 x DP=2, the passes counted);
split invariance of the loss on the reweighted advantages; a float64 finite-difference gradient; the refusals by
field; the registry and the stability bench's variant."""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms.hidden_reward import THROptions, thr_advantages
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError
from megapo.learner.logprobs import vocab_parallel_logprobs_at

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import assert_ppo_gradient_matches_fd, assert_ppo_split_invariant  # noqa: E402
from one_rank import ONE, response_pass_stub  # noqa: E402

V, D = 7, 4


def ref_advantages(responses, adv, logits, hidden, masks, group_size, p, beta, dominant_only):
    """Loops: per mixed group, V* = the ids of its policy tokens; g_t[v] = 1[y_t = v] − softmax(z_t)[v] for v in V*;
    s_t = Σ over the positive responses' policy tokens (j, k) of (Σ_v g_t[v] g_jk[v])·(Σ_d h_t[d] h_jk[d]);
    τ = β·min over positive responses of their mean s; dominant |s| > τ: A·(1 + p·sign(A·s)), else A (0 when
    dominant_only); groups of one sign and masked tokens keep A."""
    out = [[a] * len(r) for r, a in zip(responses, adv)]
    for lo in range(0, len(responses), group_size):
        part = list(range(lo, lo + group_size))
        if not (any(adv[i] > 0 for i in part) and any(adv[i] < 0 for i in part)):
            continue
        vocab = sorted({responses[i][t] for i in part for t in range(len(responses[i])) if masks[i][t]})

        def g(i, t):
            z = logits[i][t]
            top = max(z)
            den = sum(math.exp(x - top) for x in z)
            return [(1.0 if responses[i][t] == v else 0.0) - math.exp(z[v] - top) / den for v in vocab]

        pos = [(j, k) for j in part if adv[j] > 0 for k in range(len(responses[j])) if masks[j][k]]

        def score(i, t):
            gi = g(i, t)
            total = 0.0
            for j, k in pos:
                gj = g(j, k)
                total += sum(a * b for a, b in zip(gi, gj)) * sum(a * b for a, b in zip(hidden[i][t], hidden[j][k]))
            return total

        scores = {(i, t): score(i, t) for i in part for t in range(len(responses[i])) if masks[i][t]}
        anchor = min(sum(scores[(j, t)] for t in range(len(responses[j])) if masks[j][t]) /
                     sum(masks[j]) for j in part if adv[j] > 0)
        tau = beta * anchor
        for (i, t), s in scores.items():
            if abs(s) > tau:
                thr = adv[i] * s
                out[i][t] = adv[i] * (1 + p * (1 if thr > 0 else -1 if thr < 0 else 0))
            elif dominant_only:
                out[i][t] = 0.0
    return out


def make_batch(seed, lengths=(4, 5, 3, 4, 3, 5, 2, 4), scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    logits = [torch.randn(n, V, generator=gen, dtype=torch.float64) * scale for n in lengths]
    responses = [torch.randint(0, V - 1, (n,), generator=gen).tolist() for n in lengths]  # id 6 never sampled
    hidden = [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in lengths]
    return logits, responses, hidden


def at_ids(logits, ids):
    return [torch.log_softmax(z, -1)[:, ids] for z in logits]


@pytest.mark.parametrize("p, beta, dominant_only", [(0.5, 1.0, False), (-0.3, 0.5, False), (0.5, 1.0, True)])
@pytest.mark.parametrize("masked", [False, True])
def test_advantages_match_the_hidden_reward_written_out(p, beta, dominant_only, masked):
    logits, responses, hidden = make_batch(1)
    adv = [0.9, -0.4, 0.5, -1.0, 0.0, 0.0, 0.7, -0.7]  # groups of 2: the third has one sign
    masks = [[1] * len(r) for r in responses]
    if masked:
        masks[0][1] = masks[3][0] = masks[7][2] = 0
    ids = sorted({v for r in responses for v in r}) + [6]  # the batch's ids, and one nobody sampled
    got, metrics = thr_advantages(responses, adv, at_ids(logits, ids), ids, hidden, 2,
                                  masks if masked else None, THROptions(p=p, beta=beta, dominant_only=dominant_only))
    want = ref_advantages(responses, adv, [z.tolist() for z in logits], [h.tolist() for h in hidden], masks, 2, p,
                          beta, dominant_only)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-12)
    assert 0 < metrics["thr/dominant_frac"] <= 1


def test_exploitation_amplifies_the_correct_side_and_weakens_the_harmful_negative_tokens():
    """A positive response's token repeated in a negative response (the same token, the same hidden state): the
    update on the negative copy lowers the correct response's likelihood, its THR < 0, and p > 0 weakens it, while the
    positive copy's THR > 0 is amplified (NTHR's case, and THR's exploitation)."""
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    responses = [[0, 1], [0, 2]]
    logits = [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)]
    hidden = [h, torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)]
    got, _ = thr_advantages(responses, [1.0, -1.0], at_ids(logits, [0, 1, 2]), [0, 1, 2], hidden, 2, None,
                            THROptions(p=0.5, beta=0.5))
    assert got[0][0] == pytest.approx(1.5) and got[1][0] == pytest.approx(-0.5)


def test_learner_logp_at_reads_the_response_slots(monkeypatch):
    """Learner.response_logp_at's glue on a hand-made micro-batch (2 sequences at 2 and 3 selected slots, a padded
    vocabulary entry; the schedule stubbed): log_softmax over the real vocabulary at the given ids."""
    import megapo.learner.learner as learner_mod
    from megapo.learner.learner import Learner

    monkeypatch.setattr(learner_mod, "vocab_parallel_logprobs_at", partial(vocab_parallel_logprobs_at, group=ONE))
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, V + 1, generator=gen, dtype=torch.float64) * 2
    logits[..., V] = 50.0  # padding: must not count
    select = torch.tensor([1, 2, 5, 6, 7])
    mb = SimpleNamespace(select=select, order=[0, 1], sizes=[2, 3], head_selected=False)
    me = response_pass_stub(logits, V, mb)
    got = Learner.response_logp_at(me, [[1, 2, 3, 4], [1, 2, 3, 4, 5]], [2, 2], [5, 0, 3])
    want = torch.log_softmax(logits.reshape(-1, V + 1)[select, :V], -1)[:, [5, 0, 3]]
    torch.testing.assert_close(torch.cat(got), want.float(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="^ids:"):
        Learner.response_logp_at(me, [[1, 2, 3]], [1], [V])


def test_learner_hidden_logp_at_reads_both_from_one_pass(monkeypatch):
    """Learner.response_hidden_logp_at's glue on a hand-made micro-batch (the schedule stubbed, counting its passes;
    the head's hook standing in as the rows it kept): the kept rows and log_softmax at the given ids from ONE pass,
    where response_hidden and response_logp_at take one each."""
    import megapo.learner.learner as learner_mod
    from megapo.learner.learner import Learner

    monkeypatch.setattr(learner_mod, "vocab_parallel_logprobs_at", partial(vocab_parallel_logprobs_at, group=ONE))
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, V + 1, generator=gen, dtype=torch.float64) * 2
    logits[..., V] = 50.0  # padding: must not count
    rows = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    select = torch.tensor([1, 2, 5, 6, 7])
    mb = SimpleNamespace(select=select, order=[0, 1], sizes=[2, 3], head_selected=False)  # as under sequence parallel
    me = response_pass_stub(logits, V, mb)
    passes, run = [], me._run
    me._run = lambda *a, **k: passes.append(1) or run(*a, **k)
    me._head = SimpleNamespace(keep_input=False, kept=rows)
    seqs = [[1, 2, 3, 4], [1, 2, 3, 4, 5]]
    hidden, logp = Learner.response_hidden_logp_at(me, seqs, [2, 2], [5, 0, 3])
    assert len(passes) == 1
    assert torch.equal(hidden[0], rows[:2]) and torch.equal(hidden[1], rows[2:])
    want = torch.log_softmax(logits.reshape(-1, V + 1)[select, :V], -1)[:, [5, 0, 3]]
    torch.testing.assert_close(torch.cat(logp), want.float(), rtol=0, atol=1e-6)
    assert me._head.keep_input is False and me._head.kept is None
    me._head.kept = rows
    Learner.response_hidden(me, seqs, [2, 2])
    Learner.response_logp_at(me, seqs, [2, 2], [5, 0, 3])
    assert len(passes) == 3  # the separate inputs: two passes
    with pytest.raises(ValueError, match="^ids:"):
        Learner.response_hidden_logp_at(me, [[1, 2, 3]], [1], [V])


def test_the_loop_takes_one_pass_for_both_inputs_on_the_replayed_routes():
    """update.advantage_stages with thr (reading old_hidden and old_vocab_logp): ONE learner call that returns both
    (response_hidden_logp_at) on the replayed routes and the batch's response vocabulary, never the two separate
    passes; the advantages are the loop's."""
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    logits, responses, hidden = make_batch(3, lengths=(3, 4, 2, 5))
    adv = [0.5, -0.5, -0.5, 0.5]
    batch = [TrainSample([1, 2] + r, 2, a, old_logp=[-1.0] * len(r), routes=f"routes{i}")
             for i, (r, a) in enumerate(zip(responses, adv))]
    calls = []
    ids = sorted({v for r in responses for v in r})

    class PassLearner:
        def response_hidden(self, sequences, prompt_lens, routes=None):
            calls.append(("hidden", sequences, prompt_lens, routes))
            return hidden

        def response_logp_at(self, sequences, prompt_lens, wanted, routes=None):
            calls.append(("logp_at", wanted, routes))
            return at_ids(logits, wanted)

        def response_hidden_logp_at(self, sequences, prompt_lens, wanted, routes=None):
            calls.append(("hidden_logp_at", sequences, prompt_lens, wanted, routes))
            return hidden, at_ids(logits, wanted)

    groups = [SimpleNamespace(rewards=[1.0, 0.0], samples=[None, None], privileged=False),
              SimpleNamespace(rewards=[0.0, 1.0], samples=[None, None], privileged=False)]
    cfg = make_cfg(stages=[{"name": "thr"}], n_samples=2)
    metrics = advantage_stages(PassLearner(), batch, groups, cfg, 1, None, StepTimer())
    routes = [f"routes{i}" for i in range(4)]
    assert calls == [("hidden_logp_at", [s.tokens for s in batch], [2] * 4, ids, routes)]
    want = ref_advantages(responses, adv, [z.tolist() for z in logits], [h.tolist() for h in hidden],
                          [[1] * len(r) for r in responses], 2, 0.5, 1.0, False)
    for s, w in zip(batch, want):
        assert s.advantage == pytest.approx(w, abs=1e-12)
    assert "thr/dominant_frac" in metrics


def thr_batch(vocab: int):
    """Four sequences (prompt + response) and the sorted ids of their responses' tokens."""
    gen = torch.Generator().manual_seed(5)
    seqs, plens = [], []
    for p, r in [(3, 5), (5, 2), (2, 6), (4, 4)]:
        seqs.append(torch.randint(0, vocab, (p + r,), generator=gen).tolist())
        plens.append(p)
    return seqs, plens, sorted({v for s, p in zip(seqs, plens) for v in s[p:]})


def hf_hidden_logp_at(model_dir, seqs, plens, ids):
    """Per sequence, transformers' fp32 last hidden state and log_softmax at `ids`, at the response slots."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hidden, logp = [], []
    with torch.no_grad():
        for s, p in zip(seqs, plens):
            out = model(torch.tensor([s]), output_hidden_states=True)
            hidden.append(out.hidden_states[-1][0, p - 1:len(s) - 1])
            logp.append(torch.log_softmax(out.logits[0, p - 1:len(s) - 1].double(), -1)[:, ids])
    return hidden, logp


@pytest.fixture(scope="module")
def thr_runs(tiny_moe, tmp_path_factory):
    import json

    from layout_runs import run_layout_script

    tmp = tmp_path_factory.mktemp("thr_layouts")
    vocab = json.loads((Path(tiny_moe) / "config.json").read_text())["vocab_size"]
    seqs, plens, ids = thr_batch(vocab)
    base = dict(model=str(tiny_moe), sequences=seqs, prompt_lens=plens, ids=ids, micro_batch_tokens=16,
                row_tokens=1)
    script = Path(__file__).resolve().parent / "distributed" / "thr_layouts.py"
    results = {}
    for world, layouts in ((1, [dict(tp=1, pp=1, ep=1, dp=1)]),
                           (2, [dict(tp=2, pp=1, ep=1, dp=1), dict(tp=1, pp=1, ep=2, dp=2)])):
        results.update(run_layout_script(script, dict(base, layouts=layouts), world, tmp))
    return results, hf_hidden_logp_at(tiny_moe, seqs, plens, ids)


def test_learner_one_pass_equals_the_two_passes_and_transformers(thr_runs):
    """The tiny MoE's Learner.response_hidden_logp_at: ONE pass (its micro-batches forwarded once) where
    response_hidden and response_logp_at take two, counted on Learner._run; at TP=1 both equal transformers'
    last hidden state and log_softmax at the ids (fp32: 1e-4 / 1e-5), and under TP=2 (sequence parallel: the head's
    input gathered) and EP=2 x DP=2 the one pass equals the two passes and TP=1."""
    results, (hf_hidden, hf_logp) = thr_runs
    assert set(results) == {"tp1_pp1_ep1_dp1", "tp2_pp1_ep1_dp1", "tp1_pp1_ep2_dp2"}
    tp1 = results["tp1_pp1_ep1_dp1"]["one"]
    for h, lp, rh, rl in zip(*tp1, hf_hidden, hf_logp):
        torch.testing.assert_close(h, rh, rtol=0, atol=1e-4)
        torch.testing.assert_close(lp.double(), rl, rtol=0, atol=1e-5)
    for name, r in results.items():
        assert r["passes"] == {"separate": 2, "one": 1}, name
        assert r["forwards"]["one"] * 2 == r["forwards"]["separate"] > 0, name
        for got, sep, ref in zip(r["one"], r["separate"], tp1):  # hidden, then logp
            for g, s_, t in zip(got, sep, ref):
                torch.testing.assert_close(g, s_, rtol=0, atol=1e-6, msg=name)
                torch.testing.assert_close(g, t, rtol=0, atol=1e-5, msg=name)


def stage_inputs(seed):
    """π_old per token, the stage's advantages (one list per sample) and the lengths, on a batch of 8."""
    logits, responses, hidden = make_batch(seed)
    adv = [0.9, -0.3, -0.3, 0.9, -0.6, 0.2, 0.9, -0.3]
    ids = sorted({v for r in responses for v in r})
    values, _ = thr_advantages(responses, adv, at_ids(logits, ids), ids, hidden, 2, None, THROptions())
    old = [torch.log_softmax(z, -1).gather(-1, torch.tensor(r)[:, None])[:, 0].tolist()
           for z, r in zip(logits, responses)]
    return old, [v.tolist() for v in values], [len(o) for o in old]


def test_ppo_on_the_stage_advantages_is_split_invariant_and_its_gradient_matches_finite_differences():
    """The stage's statistics are taken once, before the split: PPO's loss and gradient on its advantages over 2 DP
    ranks x 4 micro-batches equal the one-batch ones (1e-12), and that gradient equals float64 finite differences."""
    old, adv, lengths = stage_inputs(6)
    assert_ppo_split_invariant(old, adv, lengths, seed=7)
    assert_ppo_gradient_matches_fd(old, adv, lengths, seed=9)


@pytest.mark.parametrize("option, value", [("p", 1.5), ("p", float("nan")), ("beta", float("inf")),
                                           ("dominant_only", 1)])
def test_options_refused_naming_the_field(option, value):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "thr", option: value}])
    assert err.value.field == f"algorithm.stages[0].{option}"


def test_stage_refuses_mismatched_inputs():
    logits, responses, hidden = make_batch(4, lengths=(2, 2))
    ids = [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"^vocab_logp\[1\]"):
        thr_advantages(responses, [1.0, -1.0], [at_ids(logits, ids)[0], at_ids(logits, ids)[1][:1]], ids, hidden, 2,
                       None, THROptions())
    with pytest.raises(ValueError, match="^group_size:"):
        thr_advantages(responses, [1.0, -1.0], at_ids(logits, ids), ids, hidden, 3, None, THROptions())


def test_registered_with_its_paper_and_in_the_bench():
    from megapo.algorithms.registry import entries
    from tools.bench import stability as st

    (entry,) = [e for e in entries("advantage_stage") if e.name == "thr"]
    assert "Token Hidden Reward" in entry.paper and "arXiv:2510.03669" in entry.paper
    assert "THR_{i,t} = Â_i·s_{i,t}" in entry.formula and "Assumptions, marked" in entry.formula
    assert "thr" in st.variant_names("thr")


def test_train_two_steps(tmp_path, tiny_moe):
    """`megapo train` with the stage on ppo: the learner's two passes on the tiny MoE, both steps update with a finite
    loss and log the stage's metrics."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, "thr", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", "algorithm.objective=ppo", "algorithm.stages=[{name: thr}]")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_nonfinite"] == 0 for r in rows)
    assert all(0 <= r["thr/dominant_frac"] <= 1 for r in rows)
