"""GDPO's reward-decoupled normalisation (arXiv:2601.05242) and MRTPO's reward-specific token credit (Each Reward to
Its Relevant Tokens), against the formulas written out here as loops (never the functions' own outputs):

- the Jensen-Shannon distance as a loop over the vocabulary (float64 logits with padded entries), and the learner's
  paired pass on the tiny MoE against the same loop on transformers' logits, under TP=1, TP=2 and DP=2 (each with
  one-sequence rows and with pairs packed several to a row);
- GDPO's group-then-batch normalisation and MRTPO's reassignment as loops; equal distances give GDPO's advantage;
- PPO on the stage's advantages: split invariance (2 DP ranks x 4 micro-batches) and float64 finite differences;
- the K components packed into one pass (Learner.response_js_distances: each x ⊕ y once beside its K variants) against
  the separate paired passes and transformers, with the learner's passes counted (2 -> 1);
- the packing of the pairs (one unit, two segments: the context never sees the response behind x) and of the groups;
- the task's components, the trainer glue (the components of the kept samples, truncation, one packed call for all
  components on the replayed routes), refusals naming the field, the registry and the bench variants, one
  `megapo train` run with the stage.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms.multi_reward import (ComponentRewards, MRTPOOptions, gdpo_advantages, mrtpo_advantages,
                                            relevance_weights)
from megapo.config import ConfigError
from megapo.learner import packing
from megapo.learner.divergence import vocab_parallel_js_distance
from megapo.tasks.components import ComponentVerifier, RewardComponent

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_runs import run_layout_script  # noqa: E402
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import assert_ppo_gradient_matches_fd, assert_ppo_split_invariant  # noqa: E402
from one_rank import ONE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the distance, written out


def ref_js(p_logits: list[float], q_logits: list[float]) -> float:
    """sqrt(½ Σ_v p log(p/m) + ½ Σ_v q log(q/m)), m = (p + q)/2, a loop over the vocabulary (math, float64)."""
    def softmax(z):
        top = max(z)
        e = [math.exp(x - top) for x in z]
        return [x / sum(e) for x in e]

    p, q = softmax(p_logits), softmax(q_logits)
    total = 0.0
    for pv, qv in zip(p, q):
        m = 0.5 * (pv + qv)
        if pv > 0:
            total += 0.5 * pv * math.log(pv / m)
        if qv > 0:
            total += 0.5 * qv * math.log(qv / m)
    return math.sqrt(max(total, 0.0))


def test_js_distance_matches_the_loop_over_the_vocabulary():
    """13 real entries, 3 of padding at 50 (an unmasked one would dominate); rows 0 and 1 equal (distance 0)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(6, 16, generator=gen, dtype=torch.float64) * 3
    q = torch.randn(6, 16, generator=gen, dtype=torch.float64) * 3
    q[0], q[1, :13] = p[0], p[1, :13]
    p[:, 13:], q[:, 13:] = 50.0, -50.0
    got = vocab_parallel_js_distance(p, q, vocab_size=13, group=ONE)
    want = torch.tensor([ref_js(p[r, :13].tolist(), q[r, :13].tolist()) for r in range(6)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got[0] == got[1] == 0
    assert float(got.max()) <= math.sqrt(math.log(2)) + 1e-12
    with pytest.raises(ValueError, match="^q_logits:"):
        vocab_parallel_js_distance(p, q[:, :5], vocab_size=13, group=ONE)


def test_pairs_pack_as_one_unit_of_two_segments():
    """packing.pair_units: sequence i and its partner n + i side by side in one row; each sees only itself (the tree
    mask), and Transformer Engine's boundaries (member_row) cut the unit into its two sequences."""
    units = packing.pair_units([5, 3], [7, 4])
    assert [(u.members, u.lengths, u.shared, u.size) for u in units] == [((0, 2), (5, 7), 0, 12), ((1, 3), (3, 4), 0, 7)]
    layout = packing.plan([u.size for u in units], dp=1, dp_rank=0, budget=64, row_tokens=64)[0]
    smap = packing.slot_map(layout, units)
    mask = packing.tree_mask(smap)[0, 0]  # True = masked
    seq = smap.seq[0].tolist()
    for i in range(len(seq)):
        for j in range(len(seq)):
            if seq[i] >= 0 and j <= i:
                assert bool(mask[i, j]) == (seq[j] != seq[i]), (i, j)
    row = packing.member_row(layout.rows[0], units)
    assert sorted(row.lengths) == [3, 4, 5, 7] and row.used == layout.rows[0].used
    with pytest.raises(ValueError, match="^partner_lengths:"):
        packing.pair_units([5], [])


# ----------------------------------------------------------------------------- the learner's pass vs transformers


def js_batch(vocab: int, seed: int = 0):
    """Five responses behind their prompts x and behind longer prompts x ⊕ c (other tokens before x)."""
    rng = random.Random(seed)
    seqs, plens, ctx, clens = [], [], [], []
    for p, r, c in [(3, 4, 2), (5, 2, 4), (2, 6, 1), (4, 3, 3), (6, 5, 2)]:
        prompt = [rng.randrange(vocab) for _ in range(p)]
        response = [rng.randrange(vocab) for _ in range(r)]
        hint = [rng.randrange(vocab) for _ in range(c)]
        seqs.append(prompt + response)
        plens.append(p)
        ctx.append(hint + prompt + response)
        clens.append(c + p)
    return seqs, plens, ctx, clens


def hf_js(model_dir, seqs, plens, ctx, clens):
    """Per pair the loop's distance at each response slot, on transformers' fp32 logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for a, p, b, q in zip(seqs, plens, ctx, clens):
            za = model(torch.tensor([a])).logits[0].double()
            zb = model(torch.tensor([b])).logits[0].double()
            out.append(torch.tensor([ref_js(za[p - 1 + t].tolist(), zb[q - 1 + t].tolist())
                                     for t in range(len(a) - p)], dtype=torch.float64))
    return out


def more_contexts(seqs, plens, vocab: int, seed: int = 1):
    """A second component's variants of js_batch's responses: other hints (other lengths) before the same x ⊕ y."""
    rng = random.Random(seed)
    ctx, clens = [], []
    for s, p, c in zip(seqs, plens, (1, 3, 2, 2, 1)):
        ctx.append([rng.randrange(vocab) for _ in range(c)] + list(s))
        clens.append(c + p)
    return ctx, clens


@pytest.fixture(scope="module")
def js_runs(tiny_moe, tmp_path_factory):
    """(response_js_distance's results by layout name, response_js_distances' by layout name, transformers' loop for
    the first context list, for the second)."""
    tmp = tmp_path_factory.mktemp("js_layouts")
    vocab = json.loads((Path(tiny_moe) / "config.json").read_text())["vocab_size"]
    seqs, plens, ctx, clens = js_batch(vocab)
    ctx2, clens2 = more_contexts(seqs, plens, vocab)
    base = dict(model=str(tiny_moe), sequences=seqs, prompt_lens=plens, context_sequences=ctx,
                context_prompt_lens=clens, more_contexts=ctx2, more_context_prompt_lens=clens2)
    script = ROOT / "tests" / "distributed" / "js_layouts.py"
    results = {}
    for world, layouts in ((1, [dict(tp=1, pp=1, ep=1, dp=1)]),
                           (2, [dict(tp=2, pp=1, ep=1, dp=1), dict(tp=1, pp=1, ep=1, dp=2)])):
        # world 1 also with a budget (20 tokens) that holds a pair but not a sequence with both its variants
        spec = dict(base, layouts=layouts, **({"chunked_budget": 20} if world == 1 else {}))
        results.update(run_layout_script(script, spec, world, tmp))
    single = {k: v for k, v in results.items() if not k.startswith("multi:")}
    multi = {k[len("multi:"):]: v for k, v in results.items() if k.startswith("multi:")}
    return single, multi, hf_js(tiny_moe, seqs, plens, ctx, clens), hf_js(tiny_moe, seqs, plens, ctx2, clens2)


def test_learner_js_distance_matches_transformers_and_tp1(js_runs):
    """Learner.response_js_distance against the loop on transformers' logits (fp32 forwards: 1e-5), and TP=2 /
    DP=2 / packed rows against TP=1 (1e-6)."""
    results, _, want, _ = js_runs
    tp1 = results["tp1_pp1_ep1_dp1"]
    for got, ref in zip(tp1, want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)
    assert max(float(r.max()) for r in want) > 1e-2  # the hint moves the distributions: a non-trivial check
    for name, got in results.items():
        assert [len(g) for g in got] == [len(r) for r in want], name
        for g, r in zip(got, tp1):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-6, msg=name)


def test_learner_js_distances_packs_the_components_into_one_pass(js_runs):
    """Learner.response_js_distances on K = 2 context lists: row k equals transformers' loop for list k at TP=1 (1e-5)
    and the separate paired pass of list k in every layout and packing (TP=1, TP=2, DP=2; one-sequence rows, rows
    packed several units each; 1e-6). Counted on Learner._run: ONE pass where the two paired passes take two, packing
    each x ⊕ y once instead of twice; with a budget that holds only pairs (/chunked) it falls back to two passes."""
    _, multi, want, want2 = js_runs
    assert set(multi) == {"tp1_pp1_ep1_dp1", "tp1_pp1_ep1_dp1/rows", "tp1_pp1_ep1_dp1/chunked", "tp2_pp1_ep1_dp1",
                          "tp2_pp1_ep1_dp1/rows", "tp1_pp1_ep1_dp2", "tp1_pp1_ep1_dp2/rows"}
    for got, r1, r2 in zip(multi["tp1_pp1_ep1_dp1"]["one"], want, want2):
        torch.testing.assert_close(got.double(), torch.stack([r1, r2]), rtol=0, atol=1e-5)
    response_tokens = sum(len(r) for r in want)
    for name, r in multi.items():
        assert r["passes"] == {"separate": 2, "one": 2 if name.endswith("/chunked") else 1}, name
        if not name.endswith("/chunked"):  # x ⊕ y packed once, not once per component
            assert r["tokens"]["separate"] - r["tokens"]["one"] > response_tokens, name
        for i, got in enumerate(r["one"]):
            assert got.shape == (2, len(want[i])), name
            for k in range(2):
                torch.testing.assert_close(got[k], r["separate"][k][i], rtol=0, atol=1e-6, msg=name)
                torch.testing.assert_close(got[k], multi["tp1_pp1_ep1_dp1"]["separate"][k][i], rtol=0, atol=1e-6,
                                           msg=name)


def test_group_units_and_the_partners_a_pass_takes():
    """packing.group_units: sequence i with its partner in each list, one unit in slot order (i, n + i, 2n + i);
    partners_per_unit: as many as fit beside the sequence in the budget, at least one, at most the count."""
    units = packing.group_units([5, 3], [[7, 4], [6, 2]])
    assert [(u.members, u.lengths, u.shared, u.size) for u in units] == [((0, 2, 4), (5, 7, 6), 0, 18),
                                                                           ((1, 3, 5), (3, 4, 2), 0, 9)]
    with pytest.raises(ValueError, match=r"^partners\[1\]:"):
        packing.group_units([5, 3], [[7, 4], [6]])
    assert [packing.partners_per_unit(3, 10, b) for b in (5, 20, 29, 30, 40, 400)] == [1, 1, 1, 2, 3, 3]


def test_learner_js_distance_refuses_a_context_with_another_response():
    from megapo.learner.learner import Learner

    me = SimpleNamespace(spec=SimpleNamespace(vocab_size=10), route_hook=None)
    with pytest.raises(ValueError, match=r"^context_sequences\[1\]:"):
        Learner.response_js_distance(me, [[1, 2, 3], [1, 2, 3]], [1, 1], [[4, 1, 2, 3], [4, 1, 2, 4]], [2, 2])
    with pytest.raises(ValueError, match="^context_sequences:"):
        Learner.response_js_distance(me, [[1, 2, 3]], [1], [], [])
    with pytest.raises(ValueError, match=r"^contexts\[1\]\[0\]:"):
        Learner.response_js_distances(me, [[1, 2, 3]], [1], [[[4, 1, 2, 3]], [[5, 1, 2, 4]]], [[2], [2]])
    with pytest.raises(ValueError, match="^contexts:"):
        Learner.response_js_distances(me, [[1, 2, 3]], [1], [], [])


# ----------------------------------------------------------------------------- GDPO and MRTPO, written out


def ref_gdpo_parts(values: list[list[float]], group: int) -> list[list[float]]:
    """Each component normalised in its group: (r − mean) / (std + 1e-4), std with n − 1 (loops)."""
    n, k = len(values), len(values[0])
    out = [[0.0] * k for _ in range(n)]
    for lo in range(0, n, group):
        for j in range(k):
            col = [values[i][j] for i in range(lo, lo + group)]
            mean = sum(col) / group
            std = math.sqrt(sum((x - mean) ** 2 for x in col) / (group - 1))
            for i in range(lo, lo + group):
                out[i][j] = (values[i][j] - mean) / (std + 1e-4)
    return out


def ref_batch_stats(parts: list[list[float]]) -> tuple[float, float]:
    sums = [sum(row) for row in parts]
    mean = sum(sums) / len(sums)
    return mean, math.sqrt(sum((s - mean) ** 2 for s in sums) / (len(sums) - 1)) + 1e-4


def ref_mrtpo(values, distances, masks, group):
    """A_{i,t} = (Σ_k Â_{i,k}·T'·d_{i,k,t}/Σ_s d_{i,k,s} − μ) / σ over the policy tokens (loops; an all-zero row
    spreads evenly, a masked token weighs 0)."""
    parts = ref_gdpo_parts(values, group)
    mean, std = ref_batch_stats(parts)
    out = []
    for i, d in enumerate(distances):
        mask = masks[i]
        count = sum(mask)
        row = []
        for t in range(len(mask)):
            total = 0.0
            for j in range(len(values[0])):
                z = sum(d[j][s] for s in range(len(mask)) if mask[s])
                w = (count * d[j][t] / z if z > 0 else 1.0) if mask[t] else 0.0
                total += parts[i][j] * w
            row.append((total - mean) / std)
        out.append(row)
    return out


def multi_batch(seed: int, n: int = 8, k: int = 3):
    gen = random.Random(seed)
    values = [[float(gen.random() < 0.5) if j else gen.uniform(0, 1) for j in range(k)] for _ in range(n)]
    lengths = [gen.randint(2, 6) for _ in range(n)]
    distances = [[[gen.uniform(0, 0.8) for _ in range(T)] for _ in range(k)] for T in lengths]
    distances[1][k - 1] = [0.0] * lengths[1]  # a reward whose information moves no token: spread evenly
    return values, distances, lengths


def rewards_of(values) -> ComponentRewards:
    k = len(values[0])
    return ComponentRewards(tuple(f"r{j}" for j in range(k)), torch.tensor(values, dtype=torch.float64),
                            [[f"info{j}" for j in range(k)] for _ in values])


def test_gdpo_matches_the_normalisation_written_out():
    values, _, _ = multi_batch(1)
    got = gdpo_advantages(torch.tensor(values, dtype=torch.float64), 4)
    parts = ref_gdpo_parts(values, 4)
    mean, std = ref_batch_stats(parts)
    want = [(sum(row) - mean) / std for row in parts]
    assert got.tolist() == pytest.approx(want, abs=1e-12)


def test_gdpo_keeps_reward_combinations_apart_that_grpo_merges():
    """GDPO's motivating case: two groups of two, rewards (1, 0) vs (0, 0) and (1, 1) vs (0, 0). GRPO on the sums
    gives both groups (0.707, −0.707); decoupled, the (1, 1) rollout's advantage is larger than the (1, 0) one's."""
    values = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    got = gdpo_advantages(values, 2)
    parts = ref_gdpo_parts(values.tolist(), 2)
    mean, std = ref_batch_stats(parts)
    assert got.tolist() == pytest.approx([(sum(r) - mean) / std for r in parts], abs=1e-12)
    assert float(got[2]) > float(got[0]) > 0


@pytest.mark.parametrize("masked", [False, True])
def test_mrtpo_matches_the_reassignment_written_out(masked):
    values, distances, lengths = multi_batch(2)
    masks = [[1] * T for T in lengths]
    if masked:
        masks[0][0] = 0
        masks[3][-1] = 0
    got, metrics = mrtpo_advantages(rewards_of(values), [torch.tensor(d, dtype=torch.float64) for d in distances],
                                    4, masks if masked else None, MRTPOOptions())
    want = ref_mrtpo(values, distances, masks, 4)
    for g, w, m in zip(got, want, masks):
        assert [x for x, keep in zip(g.tolist(), m) if keep] == pytest.approx(
            [x for x, keep in zip(w, m) if keep], abs=1e-12)
    flat0 = [d[0][t] for d, m in zip(distances, masks) for t in range(len(m)) if m[t]]
    assert metrics["mrtpo/js_mean/r0"] == pytest.approx(sum(flat0) / len(flat0), abs=1e-12)


def test_equal_distances_give_gdpo_and_each_reward_lands_where_its_information_moves():
    values, distances, lengths = multi_batch(3, k=2)
    flat = [torch.full((2, T), 0.3, dtype=torch.float64) for T in lengths]
    got, _ = mrtpo_advantages(rewards_of(values), flat, 4, None, MRTPOOptions())
    gdpo = gdpo_advantages(torch.tensor(values, dtype=torch.float64), 4)
    for g, a in zip(got, gdpo.tolist()):
        assert g.tolist() == pytest.approx([a] * len(g), abs=1e-12)
    # reward 0 moves only token 0, reward 1 only the last token: each token carries one reward's advantage
    parts = ref_gdpo_parts(values, 4)
    mean, std = ref_batch_stats(parts)
    peaked = []
    for T in lengths:
        d = torch.zeros(2, T, dtype=torch.float64)
        d[0, 0], d[1, -1] = 0.5, 0.2
        peaked.append(d)
    got, _ = mrtpo_advantages(rewards_of(values), peaked, 4, None, MRTPOOptions())
    for i, (g, T) in enumerate(zip(got, lengths)):
        assert float(g[0]) == pytest.approx((T * parts[i][0] - mean) / std, abs=1e-12)
        assert float(g[-1]) == pytest.approx((T * parts[i][1] - mean) / std, abs=1e-12)
        assert g[1:-1].tolist() == pytest.approx([-mean / std] * (T - 2), abs=1e-12)


def test_relevance_weights_keep_each_rewards_mean():
    d = torch.tensor([[0.1, 0.3, 0.0, 0.6], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    w = relevance_weights(d, torch.tensor([True, True, True, False]))
    torch.testing.assert_close(w, torch.tensor([[0.75, 2.25, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64),
                               rtol=0, atol=1e-12)


def stage_inputs(seed):
    values, distances, lengths = multi_batch(seed)
    adv, _ = mrtpo_advantages(rewards_of(values), [torch.tensor(d, dtype=torch.float64) for d in distances], 4,
                              None, MRTPOOptions())
    gen = random.Random(seed + 1)
    old = [[math.log(gen.uniform(0.05, 0.95)) for _ in range(T)] for T in lengths]
    return old, [a.tolist() for a in adv], lengths


def test_ppo_on_the_stage_advantages_is_split_invariant_and_its_gradient_matches_finite_differences():
    """GDPO's batch statistics are taken once on the whole batch, before the split: PPO's loss and gradient on the
    stage's advantages over 2 DP ranks x 4 micro-batches equal the one-batch ones (1e-12), and that gradient equals
    float64 finite differences."""
    old, adv, lengths = stage_inputs(6)
    assert_ppo_split_invariant(old, adv, lengths, seed=7)
    assert_ppo_gradient_matches_fd(old, adv, lengths, seed=9)


def test_functions_refuse_mismatched_inputs():
    values, distances, lengths = multi_batch(4)
    d = [torch.tensor(x, dtype=torch.float64) for x in distances]
    with pytest.raises(ValueError, match="^group_size:"):
        gdpo_advantages(torch.tensor(values), 3)
    with pytest.raises(ValueError, match="^group_size:"):
        gdpo_advantages(torch.tensor(values), 1)
    with pytest.raises(ValueError, match=r"^distances\[2\]:"):
        mrtpo_advantages(rewards_of(values), d[:2] + [d[2][:2]] + d[3:], 4, None, MRTPOOptions())
    with pytest.raises(ValueError, match="^distances:"):
        mrtpo_advantages(rewards_of(values), d[:-1], 4, None, MRTPOOptions())
    with pytest.raises(ValueError, match="^values:"):
        ComponentRewards(("a", "b"), torch.zeros(2, 3), [["x", "y"], ["x", "y"]])


# ----------------------------------------------------------------------------- the task and the trainer glue


def test_addition_parts_scores_correctness_and_format_apart():
    from megapo.tasks.addition_parts import FORMAT_RULE
    from megapo.tasks.registry import get_task

    task = get_task("addition_parts")
    ex = task.example("train", 0)
    assert task.reward == "exact_match" and task.components.names == ("correct", "format")
    short = str(int(ex.answer))
    cases = {ex.answer: (1.0, 1.0), f" {ex.answer}\n": (1.0, 1.0), "0000" if ex.answer != "0000" else "0001": (0.0, 1.0),
             "x" + ex.answer[1:]: (0.0, 0.0)}
    if len(short) < 4:
        cases[short] = (1.0, 0.0)
    for response, want in cases.items():
        parts = task.components(ex, response)
        assert tuple(p.value for p in parts) == want, response
        assert [p.information for p in parts] == [ex.answer, FORMAT_RULE]
    assert get_task("addition").components is None


def test_component_verifier_checks_names_and_values():
    bad_name = ComponentVerifier(("a", "b"), lambda ex, r: (RewardComponent("a", 1.0, ""), RewardComponent("c", 0.0, "")))
    with pytest.raises(ValueError, match="^components:"):
        bad_name(None, "")
    nan = ComponentVerifier(("a",), lambda ex, r: (RewardComponent("a", float("nan"), ""),))
    with pytest.raises(ValueError, match="^components: a must be a finite number"):
        nan(None, "")
    with pytest.raises(ValueError, match="^names:"):
        ComponentVerifier(("a", "a"), lambda ex, r: ())


class CharTokenizer:
    """ids = characters' code points; 0 is the stop token."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def char_groups():
    from megapo.engines.base import Sample
    from megapo.tasks.registry import get_task

    task = get_task("addition_parts")
    groups = []
    for g, (i, answers) in enumerate([(0, ["ANS", "579", "0000", "ANS"]), (1, ["ANS", "12", "ANS", "1"])]):
        ex = task.example("train", i)
        prompt = [ord(c) for c in ex.prompt]
        samples = []
        for j, a in enumerate(answers):
            text = ex.answer if a == "ANS" else a
            cut = g == 1 and j == 3  # cut at the length limit: truncated_reward in every component
            samples.append(Sample(prompt, [ord(c) for c in text] + ([] if cut else [0]), [0.0] * (len(text) + 1 - cut),
                                  "length" if cut else "stop", 0))
        groups.append(SimpleNamespace(example=ex, samples=samples, privileged=False))
    return task, groups


def test_component_rewards_of_the_kept_samples_with_truncation():
    from megapo.trainer.multi_reward import component_rewards

    task, groups = char_groups()
    got = component_rewards(groups, task.components, CharTokenizer(), truncated_reward=-1.0)
    a0 = groups[0].example.answer
    want_first = [[1.0, 1.0], [float(int(a0) == 579), 0.0], [float(int(a0) == 0), 1.0], [1.0, 1.0]]
    assert got.values[:4].tolist() == want_first
    assert got.values[7].tolist() == [-1.0, -1.0]
    assert got.names == ("correct", "format")
    assert got.information[5] == [groups[1].example.answer, "the answer is exactly four digits"]


def test_the_loop_takes_one_packed_call_for_all_components_on_the_replayed_routes(monkeypatch):
    """update.advantage_stages with stage mrtpo: the components from the task, then ONE Learner.response_js_distances
    call for all K components (never one response_js_distance pass per component), each response behind x ⊕ c_k (the
    template through the run's encoding) beside itself behind x, on the routes the train steps replay; the
    advantages are the loop's."""
    from megapo.algorithms.sample import TrainSample
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    task, groups = char_groups()
    batch = [TrainSample(list(s.prompt_ids) + list(s.output_ids), len(s.prompt_ids), 0.0, routes=f"routes{i}")
             for i, s in enumerate(s for g in groups for s in g.samples)]
    calls, gen = [], torch.Generator().manual_seed(0)

    class PairLearner:
        def response_js_distance(self, sequences, prompt_lens, context, context_lens, routes=None):
            raise AssertionError("one paired pass per component: the components are packed into one call")

        def response_js_distances(self, sequences, prompt_lens, contexts, context_lens, routes=None):
            calls.append((sequences, prompt_lens, contexts, context_lens, routes))
            per_k = [[torch.rand(len(s) - p, generator=gen) for s, p in zip(sequences, prompt_lens)]
                     for _ in contexts]
            return [torch.stack([d[i] for d in per_k]) for i in range(len(sequences))]

    cfg = make_cfg(stages=[{"name": "mrtpo", "template": "[{hint}] {prompt}"}], n_samples=4)
    cfg.data.task, cfg.data.chat_template, cfg.data.truncated_reward = "addition_parts", False, 0.0
    tok = CharTokenizer()
    from megapo.trainer import data as data_mod
    from megapo.trainer.multi_reward import component_rewards

    monkeypatch.setattr(data_mod, "encode_prompt", lambda tokenizer, text, chat: [ord(c) for c in text])
    metrics = advantage_stages(PairLearner(), batch, groups, cfg, 1, tok, StepTimer())
    assert len(calls) == 1
    owners = [g for g in groups for _ in g.samples]
    seqs, plens, contexts, context_lens, routes = calls[0]
    assert seqs == [s.tokens for s in batch] and plens == [s.prompt_len for s in batch]
    assert routes == [f"routes{i}" for i in range(8)]
    assert len(contexts) == len(context_lens) == 2
    for k, (ctx, clens) in enumerate(zip(contexts, context_lens)):
        for g, s, c, cl in zip(owners, batch, ctx, clens):
            info = g.example.answer if k == 0 else "the answer is exactly four digits"
            assert c == [ord(ch) for ch in f"[{info}] {g.example.prompt}"] + s.tokens[s.prompt_len:]
            assert cl == len(c) - (len(s.tokens) - s.prompt_len)
    values = component_rewards(groups, task.components, tok, 0.0).values.tolist()
    # the distances PairLearner returned, regenerated: per component, per sample
    gen2 = torch.Generator().manual_seed(0)
    per_k = [[torch.rand(len(s.tokens) - s.prompt_len, generator=gen2) for s in batch] for _ in range(2)]
    distances = [[per_k[k][i].double().tolist() for k in range(2)] for i in range(8)]
    want = ref_mrtpo(values, distances, [[1] * (len(s.tokens) - s.prompt_len) for s in batch], 4)
    for s, w in zip(batch, want):
        assert s.advantage == pytest.approx(w, abs=1e-12)
    assert set(metrics) >= {"mrtpo/js_mean/correct", "mrtpo/js_mean/format"}


# ----------------------------------------------------------------------------- config, registry, bench, train


def test_stage_on_a_task_with_one_reward_is_refused_naming_data_task():
    cfg = make_cfg(stages=[{"name": "mrtpo"}])
    with pytest.raises(ConfigError) as err:
        cfg._validate_data()
    assert err.value.field == "data.task" and "one reward" in str(err.value)
    cfg = make_cfg(stages=[{"name": "gdpo"}])
    with pytest.raises(ConfigError) as err:
        cfg._validate_data()
    assert err.value.field == "data.task"
    cfg.data.task = "addition_parts"
    cfg._validate_data()


@pytest.mark.parametrize("template", ["no fields", "{prompt} only", "{hint} {prompt} {other}", 3])
def test_template_refused_naming_the_field(template):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "mrtpo", "template": template}])
    assert err.value.field == "algorithm.stages[0].template"


def test_registered_with_their_papers_and_in_the_bench():
    from megapo.algorithms.registry import entries
    from tools.bench import stability as st

    by_name = {e.name: e for e in entries("advantage_stage")}
    assert "arXiv:2601.05242" in by_name["gdpo"].paper and "Group reward-Decoupled" in by_name["gdpo"].paper
    assert "Each Reward to Its Relevant Tokens" in by_name["mrtpo"].paper
    assert "Assumptions, marked" in by_name["mrtpo"].formula and "JSD(" in by_name["mrtpo"].formula
    assert st.variant_names("gdpo,mrtpo") == ["gdpo", "mrtpo"]
    assert "data.task=addition_parts" in st.VARIANTS["mrtpo"]


def test_train_two_steps(tmp_path, tiny_moe):
    """`megapo train` on addition_parts with the stage on ppo: the paired passes on the tiny MoE, both steps update
    with a finite loss and log the stage's metrics."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, "mrtpo", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", "algorithm.objective=ppo", "data.task=addition_parts",
                      "algorithm.stages=[{name: mrtpo}]")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_nonfinite"] == 0 for r in rows)
    assert all(0 <= r["mrtpo/js_mean/correct"] <= math.sqrt(math.log(2)) for r in rows)
