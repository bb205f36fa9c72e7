"""Self-distillation: the policy as its own teacher under a changed context (megapo/algorithms/self_distill.py, the
stages opid, intro, credit, srpo) and the self-teacher input log π_old(y_t | x ⊕ c, y_<t) (megapo/trainer/
self_teacher.py, one more learner forward).

Checked: each stage against its formula written out as a loop over hand-made log-probs; the per-token advantages
(opid) and weights (intro) through policy_loss with float64 finite-difference gradients; credit's batch baseline
computed once on the whole train batch, so 4 micro-batches x 2 DP shards give the single-batch loss and gradient
(and a baseline taken per shard would differ); the self-teacher input against transformers' forward of the
re-encoded sequence on a tiny model folder; the pipeline rule (no self-distillation stage: no extra forward; with
one: exactly one, routing freely, the replayed routes untouched); config refusals naming the field; one tiny
`megapo train` run.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import numpy as np
import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.self_distill import TeacherInputs, TeacherSpec, self_distill_advantages
from megapo.config import ConfigError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from objective_loops import assert_ppo_split_invariant, pad_rows  # noqa: E402
import algorithm_configs  # noqa: E402
from train_runs import train_rows  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=2)
F64 = torch.float64
LENGTHS = [3, 5, 2, 4]


def rand_lists(seed, lengths, low=-3.0, high=0.0):
    g = torch.Generator().manual_seed(seed)
    return [(low + (high - low) * torch.rand(n, generator=g, dtype=F64)).tolist() for n in lengths]


def shifted(base, seed, spread=3.0):
    """base + uniform(−spread, spread) per token: a teacher that disagrees both ways (ratios beyond a cap too)."""
    noise = rand_lists(seed, [len(b) for b in base], -spread, spread)
    return [[b + e for b, e in zip(row, er)] for row, er in zip(base, noise)]


def token_adv(adv, i, t):
    a = adv[i]
    return a[t] if isinstance(a, list) else a


def close(got, want, tol=1e-13):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = g.tolist() if hasattr(g, "tolist") else list(g)
        assert g == pytest.approx(w, rel=tol, abs=tol)


# ----------------------------------------------------------------------------- the formulas, as loops

ADV = [0.8, -0.6, [0.3, -0.2], 1.1]  # a sequence advantage, or one per token (an earlier token stage's)


def test_opid_against_a_loop():
    old = rand_lists(1, LENGTHS)
    teacher = shifted(old, 2)
    got = self_distill_advantages("opid", lengths=LENGTHS, advantages=ADV, teacher=TeacherInputs(teacher), old_logp=old, beta=0.3)
    want = [[token_adv(ADV, i, t) + 0.3 * (teacher[i][t] - old[i][t]) for t in range(n)]
            for i, n in enumerate(LENGTHS)]
    close(got, want)


@pytest.mark.parametrize("normalize, cap", [("sequence", 5.0), ("none", 5.0), ("sequence", 1e9)])
def test_intro_against_a_loop(normalize, cap):
    old = rand_lists(3, LENGTHS)
    teacher = shifted(old, 4)
    got = self_distill_advantages("intro", lengths=LENGTHS, advantages=ADV, teacher=TeacherInputs(teacher), old_logp=old,
                max_weight=cap, normalize=normalize)
    want = []
    for i, n in enumerate(LENGTHS):
        ratio = [min(math.exp(teacher[i][t] - old[i][t]), cap) for t in range(n)]
        total = sum(ratio)
        want.append([r * n / total for r in ratio] if normalize == "sequence" else ratio)
    close(got, want)
    if cap == 5.0:  # the cap binds on this data (the test can tell a missing cap)
        assert any(math.exp(t - o) > 5.0 for tr, orow in zip(teacher, old) for t, o in zip(tr, orow))
    if normalize == "sequence":
        assert all(float(w.mean()) == pytest.approx(1.0, rel=1e-13) for w in got)


def test_credit_against_a_loop():
    teacher, contrast = rand_lists(5, LENGTHS), rand_lists(6, LENGTHS)
    inputs = TeacherInputs(teacher, contrast=contrast, contrast_inputs=2)
    got = self_distill_advantages("credit", lengths=LENGTHS, advantages=ADV, teacher=inputs, beta=0.25)
    want = [[token_adv(ADV, i, t) + 0.25 * (teacher[i][t] - contrast[i][t]) for t in range(n)]
            for i, n in enumerate(LENGTHS)]
    close(got, want)
    # a batch of one prompt has no other input: the advantages stay
    lone = self_distill_advantages("credit", lengths=LENGTHS, advantages=ADV, teacher=TeacherInputs(teacher), beta=0.25)
    close(lone, [[token_adv(ADV, i, t) for t in range(n)] for i, n in enumerate(LENGTHS)])


@pytest.mark.parametrize("tau", [1.0, 0.5, None])
def test_srpo_against_a_loop(tau):
    old = rand_lists(7, LENGTHS)
    teacher = shifted(old, 8)
    entropy = rand_lists(9, LENGTHS, 0.0, 2.5)
    correct = [True, False, False, True]
    inputs = TeacherInputs(teacher, entropy=entropy if tau is not None else None)
    got = self_distill_advantages("srpo", lengths=LENGTHS, advantages=ADV, teacher=inputs, old_logp=old, correct=correct, beta=0.7,
                entropy_temperature=tau)
    want = []
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(n):
            if correct[i]:  # GRPO's advantage
                row.append(token_adv(ADV, i, t))
            else:  # the self-teacher's reverse-KL advantage, weighted down where the teacher is unsure
                w = 1.0 if tau is None else math.exp(-entropy[i][t] / tau)
                row.append(0.7 * w * (teacher[i][t] - old[i][t]))
        want.append(row)
    close(got, want)
    with pytest.raises(ValueError, match="correct"):
        self_distill_advantages("srpo", lengths=LENGTHS, advantages=ADV, teacher=inputs, old_logp=old, correct=None)


def test_inputs_of_the_wrong_length_are_refused():
    old = rand_lists(1, LENGTHS)
    with pytest.raises(ValueError, match=r"self_teacher_logp\[1\]: expected 5"):
        self_distill_advantages("opid", lengths=LENGTHS, advantages=ADV, teacher=TeacherInputs([old[0], old[1][:4], *old[2:]]),
              old_logp=old)
    with pytest.raises(ValueError, match=r"advantages\[2\]"):
        self_distill_advantages("opid", lengths=LENGTHS, advantages=[0.1, 0.2, [0.1, 0.2, 0.3], 0.4], teacher=TeacherInputs(old),
              old_logp=old)


def test_the_stages_in_the_pipeline_set_advantages_weights_and_metrics():
    from megapo.trainer.update import token_stages

    cfg = make_cfg(stages=[{"name": "opid", "beta": 0.5}, {"name": "intro", "max_weight": 3.0}])
    old = [[-0.5, -1.0], [-2.0]]
    teacher = [[-0.1, -1.5], [-0.2]]
    batch = [{"tokens": [1, 2, 3, 4], "prompt_len": 2, "advantage": 1.0, "old_logp": old[0]},
             {"tokens": [1, 2, 5], "prompt_len": 2, "advantage": -1.0, "old_logp": old[1]}]
    metrics = token_stages(batch, cfg, step=1, self_teacher=TeacherInputs(teacher), correct=[True, False])
    assert batch[0]["advantage"] == pytest.approx([1.0 + 0.5 * 0.4, 1.0 - 0.5 * 0.5], rel=1e-13)
    assert batch[1]["advantage"] == pytest.approx([-1.0 + 0.5 * 1.8], rel=1e-13)
    r = [math.exp(0.4), math.exp(-0.5)]
    assert batch[0]["token_weight"] == pytest.approx([2 * x / sum(r) for x in r], rel=1e-13)
    assert batch[1]["token_weight"] == pytest.approx([1.0], rel=1e-13)  # one token: its mean is itself
    assert metrics["opid/adv_shift"] == pytest.approx((0.2 + 0.25 + 0.9) / 3, rel=1e-13)
    assert metrics["intro/weight_max"] == pytest.approx(2 * r[0] / sum(r), rel=1e-13)
    with pytest.raises(ValueError, match="self-teacher pass"):
        token_stages(batch, cfg, step=1)


# ----------------------------------------------------------------------------- through the loss


def test_opid_advantages_and_intro_weights_through_policy_loss_formula_and_gradient():
    """The per-token advantages (opid) and weights (intro) drive ppo's token-mean loss as Σ w_t·clip-term(A_t)/N,
    written out; the float64 autograd gradient matches finite differences."""
    old = rand_lists(11, LENGTHS)
    teacher = shifted(old, 12, spread=1.0)
    adv_seq = [0.8, -0.6, 1.2, -0.3]
    adv = self_distill_advantages("opid", lengths=LENGTHS, advantages=adv_seq, teacher=TeacherInputs(teacher), old_logp=old, beta=0.4)
    w = self_distill_advantages("intro", lengths=LENGTHS, advantages=adv_seq, teacher=TeacherInputs(teacher), old_logp=old)
    width = max(LENGTHS)
    g = torch.Generator().manual_seed(13)
    rows = [[x + 0.1 * float(torch.randn(1, generator=g)) for x in lp] for lp in old]
    lp, o, a, weights = pad_rows(rows, width), pad_rows(old, width), pad_rows(adv, width), pad_rows(w, width)
    mask = pad_rows([[1] * n for n in LENGTHS], width).bool()
    loss, _ = policy_loss("ppo", lp, o, a, mask, loss_agg="token-mean", token_weight=weights)
    expect = 0.0
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            r = math.exp(rows[i][t] - old[i][t])
            at = adv_seq[i] + 0.4 * (teacher[i][t] - old[i][t])
            expect += float(w[i][t]) * -min(r * at, min(max(r, 0.8), 1.2) * at)
    assert loss.item() == pytest.approx(expect / sum(LENGTHS), rel=1e-12)
    assert torch.autograd.gradcheck(
        lambda y: policy_loss("ppo", y, o, a, mask, loss_agg="token-mean", token_weight=weights)[0],
        (lp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- the self-teacher pass


class CharTokenizer:
    """Characters as token ids (no BOS): enough for the prompt encoding of data.encode_example (raw text)."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def stand_in_logp(seq):
    """A deterministic 'model': the log-prob of token t depends on it and on every token before it."""
    out, h = [], 0
    for j in range(1, len(seq)):
        h = (h * 31 + seq[j - 1]) % 1009
        out.append(-0.05 - ((h + 7 * seq[j]) % 97) / 50.0)
    return torch.tensor(out, dtype=F64)


class CountingLearner:
    """learner.logprobs / train_step as records; with `hook` a route hook that records its routes (r2/r3)."""

    def __init__(self, hook=False):
        self.calls = []  # ("logprobs", sequences, routes, with_entropy) / ("train_step", batch)
        self.route_hook = SimpleHook() if hook else None

    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        self.calls.append(("logprobs", [list(s) for s in sequences], routes, with_entropy))
        if self.route_hook is not None:
            self.route_hook.used = [np.full((len(s) - 1, 1, 1), 9 if routes is None else 1, np.int32)
                                    for s in sequences]
        logps = [stand_in_logp(s) for s in sequences]
        return (logps, [-lp for lp in logps]) if with_entropy else logps

    def train_step(self, batch, loss):
        self.calls.append(("train_step", [dict(s) for s in batch]))
        return {"loss": 0.0}


class SimpleHook:
    used = None

    def routes_used(self, n):
        return self.used[:n]

    def metrics(self):
        return {}


def make_groups(tok, num_groups=4, n=2, rewards=None):
    from megapo.engines.base import Sample
    from megapo.tasks.addition import example
    from megapo.trainer.data import encode_example
    from megapo.trainer.rollout import Group

    groups = []
    for g in range(num_groups):
        ex = example(123_456 + 1001 * g)
        prompt = encode_example(tok, ex, False)
        samples = []
        for i in range(n):
            out = [ord(c) for c in f"{g}{i}7"][: 2 + (g + i) % 2] + [2]
            routes = np.zeros((len(prompt) + len(out) - 1, 1, 1), np.int32)
            samples.append(Sample(prompt_ids=prompt, output_ids=out, logprobs=[-0.3] * len(out), finish_reason="stop",
                                  weight_version=0, routes=routes))
        r = rewards[g] if rewards is not None else [float(i == g % n) for i in range(n)]
        groups.append(Group(example=ex, samples=samples, rewards=list(r)))
    return groups


def spec(**over):
    from megapo.algorithms.self_distill import DEFAULT_TEMPLATE

    return TeacherSpec(**{"context": "reference_answer", "template": DEFAULT_TEMPLATE, "entropy": False,
                          "contrast": 0, **over})


def batch_of(groups):
    from megapo.algorithms.sample import TrainSample

    return [TrainSample(tokens=list(s.prompt_ids) + list(s.output_ids), prompt_len=len(s.prompt_ids), advantage=0.0,
                        routes=s.routes) for g in groups for s in g.samples]


def test_self_teacher_sequences_contexts_and_contrast():
    """The pass's sequences: each response behind its prompt with the hint (reference answer, or the group's
    best response), and for credit behind the next groups' prompts with its own hint; the response's log-probs
    are read behind the new prompt; one learner call for all."""
    from megapo.trainer.data import encode_example
    from megapo.trainer.self_teacher import self_teacher_pass

    tok = CharTokenizer()
    groups = make_groups(tok, rewards=[[0.0, 1.0], [0.5, 0.5], [0.0, 0.0], [1.0, 0.2]])
    batch = batch_of(groups)
    learner = CountingLearner()
    encode = partial(encode_example, tok, chat_template=False)
    out = self_teacher_pass(learner, batch, groups, spec(contrast=2), encode, tok.decode)
    assert len(learner.calls) == 1 and len(learner.calls[0][1]) == 3 * len(batch)
    owner = [g for g in range(4) for _ in range(2)]
    for i, (g, s) in enumerate(zip(owner, batch)):
        response = s.tokens[s.prompt_len:]
        rows = []
        for k in range(3):
            text = f"Hint: a correct answer is {groups[g].example.answer}\n{groups[(g + k) % 4].example.prompt}"
            seq = [ord(c) for c in text] + response
            assert learner.calls[0][1][k * len(batch) + i] == seq
            rows.append(stand_in_logp(seq)[len(text) - 1:])
        assert out.logp[i] == pytest.approx(rows[0].tolist(), rel=1e-15)
        assert out.contrast[i] == pytest.approx(((rows[1] + rows[2]) / 2).tolist(), rel=1e-14)
    assert out.contrast_inputs == 2 and out.entropy is None
    # best_sample: the group's highest-reward response (the first of a tie), decoded, is the hint
    learner = CountingLearner()
    self_teacher_pass(learner, batch, groups, spec(context="best_sample"), encode, tok.decode)
    best = [1, 0, 0, 0]
    for i, g in enumerate(owner):
        hint = tok.decode(groups[g].samples[best[g]].output_ids)
        text = f"Hint: a correct answer is {hint}\n{groups[g].example.prompt}"
        assert learner.calls[0][1][i][: len(text)] == [ord(c) for c in text]
    # contrast beyond the batch's other prompts: all of them
    assert self_teacher_pass(CountingLearner(), batch[:2], groups[:1], spec(contrast=3), encode,
                             tok.decode).contrast_inputs == 0


def test_with_context_puts_the_hint_in_the_last_chat_turn():
    from megapo.tasks.base import Example
    from megapo.trainer.self_teacher import with_context

    ex = Example("q?", "42", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}]})
    got = with_context(ex, "42", "{prompt} [{hint}]")
    assert got.prompt == "q? [42]" and got.meta["messages"][-1]["content"] == "q? [42]"
    assert got.meta["messages"][0]["content"] == "s" and ex.meta["messages"][-1]["content"] == "q?"  # a copy


class HFLogprobs:
    """learner.logprobs on transformers in float64, sequences of equal length batched (no padding)."""

    route_hook = None

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        out, by_len = [None] * len(sequences), {}
        for i, s in enumerate(sequences):
            by_len.setdefault(len(s), []).append(i)
        with torch.no_grad():
            for idx in by_len.values():
                ids = torch.tensor([sequences[i] for i in idx])
                logp = torch.log_softmax(self.model(input_ids=ids).logits[:, :-1], -1)
                picked = logp.gather(2, ids[:, 1:, None])[..., 0]
                ent = -(logp.exp() * logp).sum(-1)
                for row, i in enumerate(idx):
                    out[i] = (picked[row], ent[row])
        logps = [o[0] for o in out]
        return (logps, [o[1] for o in out]) if with_entropy else logps


def test_self_teacher_logp_against_transformers(tiny_dense):
    """The input is the log-probs of the response behind the re-encoded prompt: the tokenizer's ids of the
    template filled with the reference answer (plus BOS where the tokenizer has one), then the same response ids,
    through transformers' own forward of that one sequence."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megapo.trainer.update import self_teacher_inputs

    tok = AutoTokenizer.from_pretrained(tiny_dense)
    groups = make_groups(tok, num_groups=2)
    batch = batch_of(groups)
    cfg = make_cfg(stages=[{"name": "srpo", "template": "answer {hint}: {prompt}"}])
    out = self_teacher_inputs(HFLogprobs(tiny_dense), batch, groups, cfg, tok, cfg.algorithm.self_teacher())
    model = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float64).eval()
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    for i, s in enumerate(batch):
        ex = groups[i // 2].example
        prompt = bos + tok(f"answer {ex.answer}: {ex.prompt}", add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + s.tokens[s.prompt_len:]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        want = logp.gather(1, ids[0, 1:, None])[:, 0][len(prompt) - 1:]
        entropy = -(logp.exp() * logp).sum(-1)[len(prompt) - 1:]
        assert len(out.logp[i]) == len(s.tokens) - s.prompt_len
        assert out.logp[i] == pytest.approx(want.tolist(), rel=1e-9, abs=1e-9)
        assert out.entropy[i] == pytest.approx(entropy.tolist(), rel=1e-9, abs=1e-9)  # srpo reads it
        # the context changes the log-probs (the test can tell a pass that ignored it; float64, a tiny random model)
        with torch.no_grad():
            plain = torch.log_softmax(model(input_ids=torch.tensor([s.tokens])).logits[0, :-1], -1)
        assert (plain.gather(1, torch.tensor(s.tokens)[1:, None])[:, 0][s.prompt_len - 1:] - want).abs().max() > 1e-7


# ----------------------------------------------------------------------------- the pipeline rule, in the loop


def run_update(stages, hook=False, mode="off", num_groups=4):
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import update_policy

    tok = CharTokenizer()
    cfg = make_cfg(stages=stages, routing_replay=mode)
    groups = make_groups(tok, num_groups=num_groups)
    learner = CountingLearner(hook=hook)
    metrics = update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer(), tokenizer=tok)
    return learner, groups, metrics


@pytest.mark.parametrize("stages, passes, width", [
    ([], 1, None), ([{"name": "polarity"}, {"name": "gtpo"}], 1, None),
    ([{"name": "opid"}], 2, 1), ([{"name": "intro"}, {"name": "srpo"}], 2, 1),
    ([{"name": "credit", "contrast": 2}], 2, 3),
])
def test_the_extra_forward_runs_only_for_a_self_distillation_stage(stages, passes, width):
    learner, groups, metrics = run_update(stages)
    kinds = [c[0] for c in learner.calls]
    assert kinds == ["logprobs"] * passes + ["train_step"]
    if passes == 2:
        assert len(learner.calls[1][1]) == width * sum(len(g.samples) for g in groups)
        assert learner.calls[1][3] == any(s["name"] == "srpo" for s in stages)  # the entropy only for srpo
        assert any(k.endswith("/adv_shift") or k.endswith("/weight_max") for k in metrics)
    trained = learner.calls[-1][1]
    assert all(s.get("old_logp") is not None for s in trained)


def test_srpo_in_the_loop_routes_on_the_verdicts():
    learner, groups, metrics = run_update([{"name": "srpo", "entropy_temperature": None}])
    trained = learner.calls[-1][1]
    teacher = learner.calls[1][1]
    for i, (s, g) in enumerate(zip(trained, [g for g in groups for _ in g.samples])):
        n = len(s["tokens"]) - s["prompt_len"]
        if g.rewards[i % 2] >= 0.5:  # correct: GRPO's advantage, one number repeated
            assert len(set(s["advantage"])) == 1 and s["advantage"][0] != 0
        else:  # failed: log π(y|x ⊕ c) − log π_old(y|x)
            want = stand_in_logp(teacher[i])[len(teacher[i]) - n - 1:] - torch.tensor(s["old_logp"], dtype=F64)
            assert s["advantage"] == pytest.approx(want.tolist(), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_the_self_teacher_pass_routes_freely_and_keeps_the_replayed_routes(mode):
    learner, groups, _ = run_update([{"name": "opid"}], hook=True, mode=mode)
    (_, _, old_routes, _), (_, _, teacher_routes, _) = learner.calls[0], learner.calls[1]
    assert teacher_routes is None  # the re-encoded sequences route themselves
    trained = learner.calls[-1][1]
    # every train step replays the old-log-prob pass's routes (r3: the engine's; r2: the pass's own), not the
    # self-teacher pass's (which the stand-in marks 9 where it routed freely, 1 where it replayed)
    want = 1 if mode == "r3" else 9
    assert all(np.asarray(s["routes"]).shape[0] == len(s["tokens"]) - 1 for s in trained)
    assert all((np.asarray(s["routes"]) == want).all() for s in trained)
    assert (old_routes is None) == (mode == "r2")


# ----------------------------------------------------------------------------- credit's batch


def test_credit_baseline_is_the_whole_batch_and_the_loss_splits():
    """credit's contrast reads other prompts of the train batch: the pass runs once on the whole batch before the
    split (a baseline taken per DP shard would differ), and 4 micro-batches x 2 DP shards of the loss with those
    advantages give the single-batch loss and gradient."""
    from megapo.trainer.data import encode_example
    from megapo.trainer.self_teacher import self_teacher_pass

    tok = CharTokenizer()
    groups = make_groups(tok, num_groups=4)
    batch = batch_of(groups)
    encode = partial(encode_example, tok, chat_template=False)
    whole = self_teacher_pass(CountingLearner(), batch, groups, spec(contrast=1), encode, tok.decode)
    shard = self_teacher_pass(CountingLearner(), batch[:4], groups[:2], spec(contrast=1), encode, tok.decode)
    assert any(a != pytest.approx(b, rel=1e-9) for a, b in zip(whole.contrast[2:4], shard.contrast[2:4]))
    lengths = [len(s.tokens) - s.prompt_len for s in batch]
    adv_seq = [0.7, -0.7, -0.7, 0.7, 0.7, -0.7, -0.7, 0.7]
    adv = self_distill_advantages("credit", lengths=lengths, advantages=adv_seq, teacher=whole, beta=0.5)
    old = [stand_in_logp(s.tokens)[s.prompt_len - 1:].tolist() for s in batch]
    assert_ppo_split_invariant(old, adv, lengths, seed=17)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("stages, field, words", [
    ([{"name": "opid", "beta": -0.1}], "algorithm.stages[0].beta", ">= 0"),
    ([{"name": "opid", "context": "skills"}], "algorithm.stages[0].context", "reference_answer"),
    ([{"name": "opid", "template": "{prompt} answer"}], "algorithm.stages[0].template", "{hint}"),
    ([{"name": "opid", "template": "{prompt} {hint} {x}"}], "algorithm.stages[0].template", "no other field"),
    ([{"name": "intro", "max_weight": 0}], "algorithm.stages[0].max_weight", "> 0"),
    ([{"name": "intro", "normalize": "batch"}], "algorithm.stages[0].normalize", "sequence"),
    ([{"name": "credit", "contrast": 0}], "algorithm.stages[0].contrast", ">= 1"),
    ([{"name": "credit", "contrast": 1.5}], "algorithm.stages[0].contrast", "an int"),
    ([{"name": "credit", "contrast": 8}], "algorithm.stages[0].contrast", "prompts_per_step=8"),
    ([{"name": "srpo", "entropy_temperature": 0}], "algorithm.stages[0].entropy_temperature", "> 0"),
    ([{"name": "srpo", "weight": 1}], "algorithm.stages[0]", "unknown option"),
    ([{"name": "opid"}, {"name": "srpo", "context": "best_sample"}], "algorithm.stages[1].context", "one context"),
    ([{"name": "intro"}, {"name": "credit", "template": "{hint} {prompt}"}], "algorithm.stages[1].template",
     "one context"),
])
def test_bad_self_distillation_options_refused_at_config_time(stages, field, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=stages)
    assert err.value.field == field and words in str(err.value)


def test_a_stage_against_pi_old_refused_where_pi_old_is_the_engine():
    for name in ("opid", "intro", "srpo"):
        with pytest.raises(ConfigError) as err:
            make_cfg(stages=[{"name": name}], old_policy="engine")
        assert err.value.field == "algorithm.stages[0]" and "old_policy=learner" in str(err.value)
    make_cfg(stages=[{"name": "credit"}], old_policy="engine")  # teacher against teacher: both the learner's


def test_what_the_stages_read():
    a = make_cfg(stages=[{"name": "credit"}]).algorithm
    assert a.self_teacher() == TeacherSpec("reference_answer", a.self_teacher().template, False, 1)
    assert not a.needs_old_stats()  # credit reads no π_old: an on-policy step may stay fused
    assert make_cfg(stages=[{"name": "opid"}]).algorithm.needs_old_stats()
    assert make_cfg(stages=[{"name": "srpo"}]).algorithm.self_teacher().entropy
    assert not make_cfg(stages=[{"name": "srpo", "entropy_temperature": None}]).algorithm.self_teacher().entropy
    assert make_cfg(stages=[{"name": "gtpo"}]).algorithm.self_teacher() is None


def test_objectives_lists_them_with_paper_and_formula(capsys):
    from megapo.cli import main

    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    for name, words in (("opid", "On-Policy Skill Distillation"), ("intro", "In-Token Rationality Optimization"),
                        ("credit", "Contrastive REward from DIsTillation"), ("srpo", "Sample-Routed Policy")):
        row = next(line for line in out.splitlines() if line.split()[:1] == [name] and not line.startswith(" "))
        assert words in row
    assert "A'_t = A_t + β·(log π_old(y_t | x ⊕ c, y_<t) − log π_old(y_t | x, y_<t))" in out
    assert main(["objectives", "--stages"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["opid"] == ["token", "old_logp,self_teacher_logp"]
    assert rows["credit"] == ["token", "self_teacher_logp,contrast_teacher_logp"]
    assert rows["srpo"] == ["token", "old_logp,correct,self_teacher_logp,self_teacher_entropy"]


# ----------------------------------------------------------------------------- one tiny run


def test_megapo_train_with_credit_and_srpo(tmp_path, tiny_moe):
    """Two steps of `megapo train` (the Megatron learner on CPU, routing replay r3 from the config) with credit and
    srpo: the self-teacher pass runs (timed) and the stages log their metrics."""
    rows = train_rows(tmp_path, "credit_srpo", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", "rollout.max_new_tokens=6",
                      "algorithm.stages=[{name: credit, contrast: 1}, {name: srpo}]")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["time/self_teacher"] > 0 and r["credit/contrast_inputs"] == 1.0
        assert math.isfinite(r["credit/adv_shift"]) and r["credit/adv_shift"] > 0
        assert math.isfinite(r["srpo/adv_shift"]) and math.isfinite(r["train/loss"])
