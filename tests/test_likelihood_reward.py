"""The log-probability reward (data.likelihood_reward, megapo/trainer/likelihood_reward.py): each sample's reward
becomes verifier_coef · r + coef · L, L the log-probability of the reference answer after the response cut at its
answer marker, from one more learner forward.

Checked: the cut against hand-written responses (the marker once, several times, inside a token with more text,
spread over tokens, absent under end and start, an empty marker, a truncated response); L (sum and mean) and the
combination against their formulas; in update_policy, the one extra learner call on the sequences built by hand,
routing freely, and the advantages computed from the combined rewards; the Megatron learner (TP=1 × DP=2 and
TP=2, routing replay on: the pass routes freely) against transformers' fp32 forward of the cut response + answer on a tiny MoE,
1e-5; config refusals naming the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapo.config import ConfigError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
EOS = 2


class CharTokenizer:
    """Characters as token ids; id 2 the end-of-sequence token, which decodes to nothing."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS)


def ids(text):
    return [ord(c) for c in text]


# ----------------------------------------------------------------------------- the cut


@pytest.mark.parametrize("texts, marker, finished, absent, want, found", [
    (["7", "+", "5", "=", "12", ";", "1", "3", ""], ";", True, "end", 6, True),  # once: up to and with the marker
    (["a", ";", "b", ";", "c", ""], ";", True, "end", 4, True),  # several: the last
    (["a", ";1", "3", ""], ";", True, "end", 2, True),  # in a token holding more text: that token kept whole
    (["x", "</", "think", ">", "4", "2", ""], "</think>", True, "end", 4, True),  # spread over tokens
    (["1", "3", "2", ""], ";", True, "end", None, False),  # absent, end: the response less its EOS, then the marker
    (["1", "3", "2"], ";", False, "end", None, False),  # truncated (no EOS): all of it, then the marker
    (["1", "3", "2", ""], ";", True, "start", 0, False),  # absent, start: the response is all answer
    (["1", ";", "2", ""], "", True, "end", None, False),  # no marker: the response less its EOS
])
def test_cut_by_hand(texts, marker, finished, absent, want, found):
    from megapo.trainer.likelihood_reward import cut_response

    out = list(range(100, 100 + len(texts)))
    if finished:
        out[-1] = EOS
    marker_ids = ids(marker)
    z, hit = cut_response(out, texts, marker, marker_ids, finished, absent)
    if want is None:  # cut at the end
        body = out[:-1] if finished else out
        want_z = body + marker_ids
    else:
        want_z = out[:want]
    assert z == want_z and hit == found


def test_occurrence_ends_and_bad_absent():
    from megapo.algorithms.process_rewards import occurrence_ends
    from megapo.trainer.likelihood_reward import cut_response

    assert occurrence_ends(["ab", "ab", "a", "b"], "ab") == [0, 1, 3]
    assert occurrence_ends([";;", ";"], ";;") == [0]  # left to right, no overlap
    assert occurrence_ends(["a"], "") == []
    with pytest.raises(ValueError, match="absent"):
        cut_response([1], ["a"], ";", [59], True, "middle")


# ----------------------------------------------------------------------------- L and the reward


def test_answer_logprob_and_combination_against_the_formulas():
    from megapo.trainer.likelihood_reward import answer_logprob, combined_reward

    logp = torch.tensor([-0.5, -1.25, -0.125, -2.0, -0.75], dtype=F64)  # 6 tokens, the last 3 the answer
    assert answer_logprob(logp, 3, "sum") == pytest.approx(-0.125 - 2.0 - 0.75, rel=1e-15)
    assert answer_logprob(logp, 3, "mean") == pytest.approx((-0.125 - 2.0 - 0.75) / 3, rel=1e-15)
    assert answer_logprob(logp, 5, "sum") == pytest.approx(float(logp.sum()), rel=1e-15)
    assert combined_reward(1.0, -2.875, 0.5, 0.25) == pytest.approx(0.25 - 1.4375, rel=1e-15)
    for n in (0, 6):
        with pytest.raises(ValueError, match="answer_len"):
            answer_logprob(logp, n, "sum")
    with pytest.raises(ValueError, match="mode"):
        answer_logprob(logp, 3, "max")


def stand_in_logp(seq):
    """A deterministic 'model': the log-prob of token t depends on it and on every token before it."""
    out, h = [], 0
    for j in range(1, len(seq)):
        h = (h * 31 + seq[j - 1]) % 1009
        out.append(-0.05 - ((h + 7 * seq[j]) % 97) / 50.0)
    return torch.tensor(out, dtype=F64)


class CountingLearner:
    """learner.logprobs / train_step as records, with a route hook (routing replay on)."""

    def __init__(self):
        self.calls = []
        self.route_hook = self

    def logprobs(self, sequences, routes=None, with_entropy=False, prompt_lens=None):
        self.calls.append(("logprobs", [list(s) for s in sequences], routes, list(prompt_lens or [])))
        self.used = [np.full((len(s) - 1, 1, 1), 1, np.int32) for s in sequences]
        return [stand_in_logp(s) for s in sequences]

    def routes_used(self, n):
        return self.used[:n]

    def metrics(self):
        return {}

    def train_step(self, batch, loss):
        self.calls.append(("train_step", [dict(s) for s in batch]))
        return {"loss": 0.0}


RESPONSES = [["4+5=9;", "13;"], ["8;99", "12"]]  # group 0: the marker last / once; group 1: once / absent
ANSWERS = ["10", "7"]


def make_groups(rewards):
    from megapo.engines.base import Sample
    from megapo.tasks.base import Example
    from megapo.trainer.rollout import Group

    groups = []
    for g, (responses, answer) in enumerate(zip(RESPONSES, ANSWERS)):
        prompt = ids(f"q{g}=")
        samples = [Sample(prompt_ids=prompt, output_ids=ids(r) + [EOS], logprobs=[-0.3] * (len(r) + 1),
                          finish_reason="stop", weight_version=0,
                          routes=np.zeros((len(prompt) + len(r), 1, 1), np.int32))  # [prompt + output − 1, ...]
                   for r in responses]
        groups.append(Group(example=Example(f"q{g}=", answer), samples=samples, rewards=list(rewards[g])))
    return groups


def hand_sequence(g, i):
    """prompt + the response cut after its last ";" (absent: the response, then ";") + the answer."""
    r = RESPONSES[g][i]
    z = r[: r.rfind(";") + 1] if ";" in r else r + ";"
    return ids(f"q{g}=") + ids(z) + ids(ANSWERS[g])


@pytest.mark.parametrize("mode, coef, verifier_coef", [("sum", 1.0, 0.0), ("mean", 0.5, 2.0)])
def test_update_policy_rewards_and_advantages_from_the_likelihood(mode, coef, verifier_coef):
    """One extra learner call (before the train step, routing freely: no routes given) on the hand-built
    sequences; each reward becomes verifier_coef · r + coef · L; GRPO's advantages are those of the new rewards."""
    from megapo.algorithms import compute_advantages
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import update_policy

    cfg = algorithm_configs.make_cfg(n_samples=2, routing_replay="r3")
    cfg.data.likelihood_reward.coef, cfg.data.likelihood_reward.mode = coef, mode
    cfg.data.likelihood_reward.verifier_coef, cfg.data.likelihood_reward.answer_marker = verifier_coef, ";"
    verifier = [[1.0, 0.0], [0.0, 1.0]]
    groups = make_groups(verifier)
    learner = CountingLearner()
    metrics = update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer(), tokenizer=CharTokenizer())
    kinds = [c[0] for c in learner.calls]
    assert kinds == ["logprobs", "logprobs", "train_step"]  # the likelihood pass, then the old-log-prob pass
    _, sequences, routes, prompt_lens = learner.calls[0]
    assert routes is None and prompt_lens == [3, 3, 3, 3]
    want_l, want_r = [], []
    for k, (g, i) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        seq = hand_sequence(g, i)
        assert sequences[k] == seq
        tail = stand_in_logp(seq)[-len(ANSWERS[g]):]
        want_l.append(float(tail.sum() if mode == "sum" else tail.mean()))
        want_r.append(verifier_coef * verifier[g][i] + coef * want_l[-1])
    assert [r for g in groups for r in g.rewards] == pytest.approx(want_r, rel=1e-14)
    assert [g.scores for g in groups] == verifier  # the verdicts stay the verifier's
    assert metrics["reward/likelihood"] == pytest.approx(sum(want_l) / 4, rel=1e-14)
    assert metrics["reward/with_likelihood"] == pytest.approx(sum(want_r) / 4, rel=1e-14)
    assert metrics["reward/likelihood_marker_frac"] == 0.75
    adv = compute_advantages("grpo", torch.tensor(want_r, dtype=F64).view(2, 2))
    assert [s["advantage"] for s in learner.calls[-1][1]] == pytest.approx(adv.flatten().tolist(), rel=1e-12)
    # the train step replays the engine's routes (r3), not anything of the likelihood pass
    assert all(np.asarray(s["routes"]).shape[0] == len(s["tokens"]) - 1 for s in learner.calls[-1][1])


def test_off_by_default_no_extra_forward():
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import update_policy

    cfg = algorithm_configs.make_cfg(n_samples=2)
    learner = CountingLearner()
    metrics = update_policy(learner, make_groups([[1.0, 0.0], [0.0, 1.0]]), cfg, None, cfg.loss_spec(), StepTimer(),
                            tokenizer=CharTokenizer())
    assert [c[0] for c in learner.calls] == ["logprobs", "train_step"] and "reward/likelihood" not in metrics


# ----------------------------------------------------------------------------- the Megatron learner vs transformers

LEARNER_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from transformers import AutoTokenizer
from megapo.config import OptimConfig, ParallelConfig
from megapo.engines.base import Sample
from megapo.learner.learner import Learner
from megapo.tasks.addition_cot import example
from megapo.trainer.config import LikelihoodRewardConfig
from megapo.trainer.likelihood_reward import add_likelihood_rewards, likelihood_sequences
from megapo.trainer.rollout import Group

model, cases, out, layouts = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
tok = AutoTokenizer.from_pretrained(model)
enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
spec = LikelihoodRewardConfig(coef=0.5, verifier_coef=2.0, answer_marker=";")
results = {}
for name, layout in layouts.items():
    learner = Learner(model, ParallelConfig(**layout), OptimConfig(), routing_replay=True, micro_batch_tokens=64)
    groups = []
    for (a, b), responses, rewards in cases:
        ex = example(a, b)
        samples = [Sample(prompt_ids=enc(ex.prompt), output_ids=enc(r) + [tok.eos_token_id],
                          logprobs=[0.0] * (len(enc(r)) + 1), finish_reason="stop", weight_version=0, routes=None)
                   for r in responses]
        groups.append(Group(example=ex, samples=samples, rewards=list(rewards)))
    sequences, _, answer_lens, found = likelihood_sequences(groups, spec, tok)
    metrics = add_likelihood_rewards(learner, groups, spec, tok)
    results[name] = {"sequences": sequences, "answer_lens": answer_lens, "found": found, "metrics": metrics,
                     "rewards": [r for g in groups for r in g.rewards]}
    learner.close()
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(results, f)
dist.barrier()  # every rank leaves the process group together (one leaving early can abort the other)
dist.destroy_process_group()
"""
CASES = [[[47, 85], ["7+5+0=12;4+8+1=13;132", "132"], [1.0, 1.0]],
         [[306, 427], ["6+7+0=13;0+2+1=03;3+4+0=07;733", "7;3;;9"], [1.0, 0.0]]]
LAYOUTS = {"tp1_dp2": {"tp": 1, "dp": 2}, "tp2": {"tp": 2}}


def test_learner_answer_logprob_against_transformers(tmp_path, tiny_moe):
    """The Megatron learner (two ranks under torchrun: TP=1 × DP=2, then TP=2; a route hook, the pass routing freely)
    gives each sample's L = Σ log π of the reference answer's tokens behind the prompt and the response cut after its
    last ";" (absent: the response less EOS, then ";"), equal to transformers' fp32 forward of that sequence, built
    here from the texts, to 1e-5."""
    from megapo.launch.local import run_torchrun

    script, out = tmp_path / "likelihood_learner.py", tmp_path / "likelihood.json"
    script.write_text(LEARNER_SCRIPT)
    assert run_torchrun([str(script), str(tiny_moe), json.dumps(CASES), str(out), json.dumps(LAYOUTS)], 2,
                        timeout_s=300) == 0
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(LAYOUTS)
    for name in LAYOUTS:
        check_against_transformers(results[name], tiny_moe)


def check_against_transformers(out: dict, tiny_moe) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    k, likelihood = 0, []
    for (a, b), responses, rewards in CASES:
        answer = enc(str(a + b))
        for r, verifier in zip(responses, rewards):
            z = r[: r.rfind(";") + 1] if ";" in r else r + ";"
            seq = enc(f"{a}+{b}=") + enc(z) + answer
            assert out["sequences"][k] == seq and out["found"][k] == (";" in r)
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)
            want = float(logp.gather(1, torch.tensor(seq[1:])[:, None])[-len(answer):].sum())
            likelihood.append(want)
            assert out["rewards"][k] == pytest.approx(2.0 * verifier + 0.5 * want, abs=1e-5)
            k += 1
    assert out["metrics"]["reward/likelihood"] == pytest.approx(sum(likelihood) / k, abs=1e-5)
    assert out["metrics"]["reward/likelihood_marker_frac"] == 0.75
    assert len(set(round(x, 4) for x in likelihood)) == k  # the cut responses give different L


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("fields, field, words", [
    ({"coef": 1.0, "mode": "max"}, "data.likelihood_reward.mode", "sum, mean"),
    ({"coef": 1.0, "absent": "middle"}, "data.likelihood_reward.absent", "end, start"),
    ({"verifier_coef": 1.0}, "data.likelihood_reward.verifier_coef", "coef is 0"),
    ({"coef": 1.0, "absent": "start"}, "data.likelihood_reward.absent", "answer_marker"),
    ({"coef": -1.0}, "data.likelihood_reward.coef", ">= 0"),
])
def test_bad_options_refused_naming_the_field(fields, field, words):
    from megapo.config import from_dict
    from megapo.trainer.config import RunConfig

    data = algorithm_configs.config_data()
    data["data"]["likelihood_reward"] = fields
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, data).data.validate()
    assert err.value.field == field and words in str(err.value)


def test_refused_with_multi_turn_rollouts():
    from megapo.config import from_dict
    from megapo.trainer.config import RunConfig, _check_env

    data = algorithm_configs.config_data()
    data["data"] = {"task": "calculator", "likelihood_reward": {"coef": 1.0}}
    with pytest.raises(ConfigError) as err:
        _check_env(from_dict(RunConfig, data))
    assert err.value.field == "data.likelihood_reward.coef" and "multi-turn" in str(err.value)
