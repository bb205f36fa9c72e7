"""Bradley-Terry reward-model training (megapo/learner/score.py, `megapo rm-train`).

References: the loss −log σ(r_c − r_r) and its derivatives written here in float64 and checked by finite
differences; transformers' AutoModelForSequenceClassification with torch autograd on the same weights and pairs
(the gradient the Megatron score model leaves, one process and TP=2 x DP=2 in one torchrun launch, pairs split
over micro-batches and DP ranks); the folder rm-train writes, loaded by transformers, scoring held-out pairs; a
reward model started from a causal LM, its folder compared tensor by tensor with the causal LM's; the addition
pairs' negatives against the digits of the sums and the old uniform draw written out here.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.cli import run_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_runs import run_layout_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "score_layouts.py"
LAYOUTS = {1: {"tp1": dict(tp=1, pp=1, ep=1, dp=1)}, 4: {"tp2xdp2": dict(tp=2, pp=1, ep=1, dp=2)}}


def bt_loss(chosen: list[float], rejected: list[float]) -> float:
    """The mean over pairs of −log σ(r_c − r_r) = log(1 + exp(−(r_c − r_r)))."""
    return sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected)) / len(chosen)


def test_bradley_terry_gradient_matches_finite_differences():
    from megapo.learner.score import bradley_terry

    rng = random.Random(0)
    chosen = [rng.uniform(-3, 3) for _ in range(5)]
    rejected = [rng.uniform(-3, 3) for _ in range(5)]
    loss, d_chosen, d_rejected = bradley_terry(torch.tensor(chosen, dtype=torch.float64),
                                               torch.tensor(rejected, dtype=torch.float64))
    assert abs(float(loss) - bt_loss(chosen, rejected)) < 1e-12
    h = 1e-6
    for i in range(5):
        up, down = list(chosen), list(chosen)
        up[i] += h
        down[i] -= h
        assert abs((bt_loss(up, rejected) - bt_loss(down, rejected)) / (2 * h) - float(d_chosen[i])) < 1e-8
        up, down = list(rejected), list(rejected)
        up[i] += h
        down[i] -= h
        assert abs((bt_loss(chosen, up) - bt_loss(chosen, down)) / (2 * h) - float(d_rejected[i])) < 1e-8


def random_pairs(seed=0, vocab=512):
    """Pairs of several lengths (micro_batch_tokens=24 splits them over micro-batches), no pad id (0)."""
    rng = random.Random(seed)

    def seq(n):
        return [rng.randrange(1, vocab) for _ in range(n)]

    return [(seq(a), seq(b)) for a, b in [(9, 5), (13, 13), (4, 17), (7, 2), (11, 6)]]


def prefix_inputs(seed=1, vocab=512, pad=0):
    """Sequences for prefix_scores and where their scored prefixes start: several lengths, the pad id (0) inside one,
    at the end of another and first in a third (whose one-token prefix is all pad), so a wrong position shows."""
    rng = random.Random(seed)
    sequences = [[rng.randrange(1, vocab) for _ in range(n)] for n in (9, 14, 5, 3, 12)]
    sequences[1][6] = pad
    sequences[2][-1] = pad
    sequences[3][0] = pad
    return dict(sequences=sequences, starts=[3, 0, 1, 0, 11])


def transformers_bt(model_dir, pairs):
    """Scores, the loss and every parameter's gradient from transformers' model with autograd."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    scores = [model(torch.tensor([s])).logits[0, 0] for s in [c for c, _ in pairs] + [r for _, r in pairs]]
    chosen, rejected = torch.stack(scores[:len(pairs)]), torch.stack(scores[len(pairs):])
    loss = torch.nn.functional.softplus(-(chosen - rejected)).mean()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return [float(s.detach()) for s in scores], float(loss.detach()), grads


@pytest.fixture(scope="module")
def score_runs(tiny_model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("score_layouts")
    model = tiny_model_factory("qwen3_moe", head="score")
    pairs = random_pairs()
    results = {}
    for world, layouts in LAYOUTS.items():
        spec = dict(model=str(model), pairs=pairs, micro_batch_tokens=24, layouts=list(layouts.values()),
                    prefix=prefix_inputs())
        saved = run_layout_script(SCRIPT, spec, world, tmp, timeout_s=900)
        results.update(zip(layouts, saved.values()))
    return dict(results=results, reference=transformers_bt(model, pairs))


@pytest.mark.parametrize("layout", [name for layouts in LAYOUTS.values() for name in layouts])
def test_bt_gradient_equals_transformers_autograd(score_runs, layout):
    got = score_runs["results"][layout]
    scores, loss, grads = score_runs["reference"]
    assert max(abs(a - b) for a, b in zip(got["scores"], scores)) < 1e-5
    assert abs(got["metrics"]["loss"] - loss) < 1e-6
    # transformers keeps the experts fused in memory; every other parameter has its checkpoint name
    shared = sorted(set(grads) & set(got["grads"]))
    assert "score.weight" in shared and "model.norm.weight" in shared and "model.embed_tokens.weight" in shared
    assert len(shared) >= 12, shared
    for name in shared:
        ref = grads[name]
        err = (got["grads"][name] - ref).abs().max().item()
        assert err <= 1e-5 + 1e-4 * ref.abs().max().item(), (name, err, ref.abs().max().item())


@pytest.mark.parametrize("layout", [name for layouts in LAYOUTS.values() for name in layouts])
def test_prefix_scores_equal_transformers_on_each_prefix_alone(score_runs, tiny_model_factory, layout):
    """Dense rewards' scores (ScoreModel.prefix_scores, one forward per sequence) against transformers'
    AutoModelForSequenceClassification run on each prefix separately, fp32."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tiny_model_factory("qwen3_moe", head="score"), dtype=torch.float32)
    assert model.config.pad_token_id == 0  # prefix_inputs' pad tokens are pad to transformers too
    inputs = prefix_inputs()
    got = score_runs["results"][layout]["prefix_scores"]
    assert [len(g) for g in got] == [len(s) - a for s, a in zip(inputs["sequences"], inputs["starts"])]
    with torch.no_grad():
        ref = [[float(model(torch.tensor([s[:p + 1]])).logits[0, 0]) for p in range(start, len(s))]
               for s, start in zip(inputs["sequences"], inputs["starts"])]
    for g, r in zip(got, ref):
        assert max(abs(a - b) for a, b in zip(g, r)) < 1e-5, (g, r)
    # 28 prefixes, two ending in a pad (scored at the token before, as the prefix one shorter): 26 distinct scores,
    # so a prefix read at a wrong position would show
    assert sum(map(len, ref)) == 28 and len({round(x, 4) for r in ref for x in r}) == 26


# ----------------------------------------------------------------------------- the command


@pytest.fixture
def no_rm_launch(monkeypatch):
    """Fails the test if `megapo rm-train` would start a process or build a model."""
    import megapo.launch.local
    from megapo.commands import rm_train

    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(megapo.launch.local, "run_workers", refuse)
    monkeypatch.setattr(rm_train, "_work", refuse)


def rm_args(model, tmp_path, **kw):
    import argparse

    base = dict(model=str(model), pairs=str(tmp_path / "pairs.jsonl"), out=str(tmp_path / "out"), eval_pairs=None,
                steps=2, lr=1e-3, batch_pairs=2, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, chat_template=False,
                seed=0, tp=1, pp=1, ep=1, dp=1, dispatcher="alltoall", micro_batch_tokens=64, timeout=60, worker=False)
    base.update(kw)
    return argparse.Namespace(**base)


def bert_folder(tmp_path) -> Path:
    """A folder that is neither a reward model nor a causal LM: a masked LM's config.json."""
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert",
                                                    "hidden_size": 64, "vocab_size": 512}))
    return folder


@pytest.mark.parametrize("content, kw, words", [
    ('{"prompt": "1+1=", "chosen": "0002"}\n', {}, ["--pairs", "pairs.jsonl:1:", "rejected"]),
    ('{"prompt": "1+1=", "chosen": [], "rejected": "0003"}\n', {}, ["--pairs", "pairs.jsonl:1:", "chosen"]),
    ('{"prompt": [1, 9999], "chosen": [2], "rejected": [3]}\n', {}, ["--pairs", "row 1", "512"]),
    ('{"prompt": "1+1=", "chosen": "0002", "rejected": "0003"}\n', dict(bert=True),
     ["--model", "architectures", "BertForMaskedLM", "ForCausalLM"]),
    ('{"prompt": "1+1=", "chosen": "0002", "rejected": "0003"}\n', dict(steps=0), ["--steps", "0"]),
    ('{"prompt": "1+1=", "chosen": "0002", "rejected": "0003"}\n', dict(lr=-1.0), ["--lr"]),
    ('{"prompt": "1+1=", "chosen": "0002", "rejected": "0003"}\n', dict(tp=3), ["tp=3"]),
])
def test_rm_train_bad_inputs_refused_before_any_process(tiny_model_factory, tmp_path, capsys, no_rm_launch,
                                                        content, kw, words):
    (tmp_path / "pairs.jsonl").write_text(content)
    model = bert_folder(tmp_path) if kw.pop("bert", False) else tiny_model_factory("qwen3_moe", head="score")
    assert run_command("rm-train", rm_args(model, tmp_path, **kw)) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


# The learning run: a fresh tiny Qwen3-MoE reward model (random init) on pairs of the addition task, the correct sum
# against a wrong one (uniform over the other sums). Its held-out accuracy on the 200 pairs (measured every 50 steps
# of one run, 2026-12-07): 0.67, 0.78, 0.735, 0.81, 0.88 at 250 steps (the test's run: 0.88 too), 0.86 at 300; 600
# steps (0.92) took about 70 s of CPU. Chance is 0.5 with a standard deviation of sqrt(0.25 / 200) = 0.035: the
# threshold 0.8 is 8.5 of them above it.
TRAIN_PAIRS, HELD_OUT, STEPS, BATCH, LR, THRESHOLD = 4000, 200, 250, 64, 1e-3, 0.8


def hf_pair_accuracy(model_dir, rows) -> float:
    """transformers' scores of each held-out row (prompt text, then the answer and end-of-sequence)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)

    def score(prompt, answer):
        ids = tok(prompt, add_special_tokens=False)["input_ids"] + tok(answer, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            return model(torch.tensor([ids + [tok.eos_token_id]])).logits[0, 0].item()

    return sum(score(r["prompt"], r["chosen"]) > score(r["prompt"], r["rejected"]) for r in rows) / len(rows)


def test_rm_train_ranks_correct_above_wrong(tiny_model_factory, tmp_path):
    from megapo.commands.rm_train import addition_pairs

    train, held_out = addition_pairs("train", TRAIN_PAIRS, 0), addition_pairs("test", HELD_OUT, 1)
    for name, rows in (("train", train), ("held_out", held_out)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    cmd = [sys.executable, "-m", "megapo.cli", "rm-train", "--model", str(tiny_model_factory("qwen3_moe", head="score")),
           "--pairs", str(tmp_path / "train.jsonl"), "--eval-pairs", str(tmp_path / "held_out.jsonl"), "--out", str(out),
           "--steps", str(STEPS), "--batch-pairs", str(BATCH), "--lr", str(LR), "--warmup-steps", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one process: more threads only spin on a shared 2-core machine
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (out / "rm_train.jsonl").read_text().splitlines()]
    assert len(log) == STEPS + 1 and log[0]["loss"] > log[-2]["loss"]
    accuracy = log[-1]["held_out_accuracy"]
    assert accuracy >= THRESHOLD, accuracy
    # the folder it wrote, scored by transformers, ranks the same pairs the same
    assert abs(hf_pair_accuracy(out, held_out) - accuracy) <= 1 / HELD_OUT


# ----------------------------------------------------------------------------- negatives of the addition pairs


def test_near_negatives_change_exactly_one_digit():
    from megapo.commands.rm_train import addition_pairs

    rows = addition_pairs("train", 200, 3, negatives="near")
    assert len(rows) == 200
    for r in rows:
        chosen, rejected = r["chosen"], r["rejected"]
        assert len(chosen) == len(rejected) == 4 and chosen.isdigit() and rejected.isdigit(), r
        assert int(r["prompt"][:3]) + int(r["prompt"][4:7]) == int(chosen), r
        assert sum(a != b for a, b in zip(chosen, rejected)) == 1, r
        assert int(rejected) <= 999 + 999, r
    # every position gets changed somewhere (not only the last digit)
    assert {next(i for i in range(4) if r["chosen"][i] != r["rejected"][i]) for r in rows} == {0, 1, 2, 3}


def test_uniform_negatives_unchanged():
    """The default draw, written out as it was before negatives= existed: the same rng calls, the same pairs."""
    from megapo.commands.rm_train import addition_pairs
    from megapo.tasks import addition

    for seed, n in ((0, 50), (3, 300)):  # seed 3's 221st draw is the right sum (shifted past it)
        rng = random.Random(seed)
        old = []
        for ex in addition.examples("train", n, seed):
            wrong = rng.randrange(1998)
            wrong += wrong >= int(ex.answer)
            old.append({"prompt": ex.prompt, "chosen": ex.answer, "rejected": f"{wrong:04d}"})
        assert addition_pairs("train", n, seed) == old
        assert addition_pairs("train", n, seed, negatives="uniform") == old
        assert all(r["rejected"] != r["chosen"] for r in old)


def test_other_negatives_refused():
    from megapo.commands.rm_train import addition_pairs

    with pytest.raises(ValueError, match="negatives"):
        addition_pairs("train", 3, 0, negatives="far")


# ----------------------------------------------------------------------------- a reward model from a causal LM


def test_rm_train_accepts_causal_lm_before_any_process(tiny_moe, tmp_path, no_rm_launch):
    from megapo.commands.rm_train import check_args
    from megapo.learner.score import head_source

    (tmp_path / "pairs.jsonl").write_text('{"prompt": "1+1=", "chosen": "0002", "rejected": "0003"}\n')
    _, hf = check_args(rm_args(tiny_moe, tmp_path))
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and head_source(hf, "--model", tiny_moe) == "zeros"


def test_rm_train_causal_lm_without_weights_or_score_head_refused(tiny_moe, tmp_path, capsys, monkeypatch,
                                                                  no_rm_launch):
    import dataclasses

    import megapo.models.family

    (tmp_path / "pairs.jsonl").write_text('{"prompt": "1+1=", "chosen": "0002", "rejected": "0003"}\n')
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_moe / "config.json").read_text())  # no safetensors
    assert run_command("rm-train", rm_args(bare, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "safetensors" in err, err

    family_for = megapo.models.family.family_for
    monkeypatch.setattr(megapo.models.family, "family_for",
                        lambda hf: dataclasses.replace(family_for(hf), score_rules=None))
    assert run_command("rm-train", rm_args(tiny_moe, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "no score head" in err, err


def run_rm_train(model, tmp_path, *flags) -> Path:
    """`megapo rm-train` in a subprocess on 8 addition pairs (text); the folder it wrote."""
    from megapo.commands.rm_train import addition_pairs

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in addition_pairs("train", 8, 0)))
    out = tmp_path / "rm"
    cmd = [sys.executable, "-m", "megapo.cli", "rm-train", "--model", str(model),
           "--pairs", str(tmp_path / "pairs.jsonl"), "--out", str(out), "--batch-pairs", "4", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def load_classifier(out):
    """transformers' sequence classifier of `out`, refusing any missing, unexpected or mismatched tensor."""
    import transformers

    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32,
                                                                                    output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


SEQUENCES = [[5, 17, 200, 42], [9, 8, 7, 6, 5, 4, 3], [100]]  # byte symbols: no special token, no pad


def test_rm_train_from_causal_lm_keeps_its_body_and_zero_head(tiny_moe, tmp_path):
    """One step at learning rate 0 (the first warmup step: its rate is logged), so the folder written is the causal
    LM's body, tensor for tensor, and a zero score head; transformers loads it as a one-label classifier."""
    from safetensors.torch import load_file

    out = run_rm_train(tiny_moe, tmp_path, "--steps", "1", "--warmup-steps", "1", "--lr", "1e-3")
    log = [json.loads(line) for line in (out / "rm_train.jsonl").read_text().splitlines()]
    assert len(log) == 1 and log[0]["lr"] == 0.0, log
    config, source_config = (json.loads((d / "config.json").read_text()) for d in (out, tiny_moe))
    assert config["architectures"] == ["Qwen3MoeForSequenceClassification"]
    assert len(config["id2label"]) == 1 and len(config["label2id"]) == 1
    assert config["pad_token_id"] == source_config["pad_token_id"] is not None

    def tensors(folder):
        return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}

    got, source = tensors(out), tensors(tiny_moe)
    assert set(got) == set(source) - {"lm_head.weight"} | {"score.weight"}
    for name, tensor in source.items():
        if name != "lm_head.weight":
            assert torch.equal(got[name], tensor.float()), name
    assert got["score.weight"].shape == (1, source_config["hidden_size"]) and not got["score.weight"].any()
    model = load_classifier(out)
    with torch.no_grad():
        assert [model(torch.tensor([s])).logits[0, 0].item() for s in SEQUENCES] == [0.0, 0.0, 0.0]


def test_rm_train_from_causal_lm_scores_as_transformers(tiny_moe, tmp_path):
    """Two steps that move the head: transformers' classifier of the folder scores each sequence as its body's last
    hidden state (AutoModel) times score.weight, and the head is no longer zero."""
    import transformers

    out = run_rm_train(tiny_moe, tmp_path, "--steps", "2", "--lr", "1e-2")
    model = load_classifier(out)
    body = transformers.AutoModel.from_pretrained(out, dtype=torch.float32).eval()
    weight = model.score.weight.detach()
    assert weight.shape == (1, body.config.hidden_size) and weight.abs().max() > 0
    with torch.no_grad():
        for s in SEQUENCES:
            hidden = body(torch.tensor([s])).last_hidden_state[0, -1]
            expected = float(hidden @ weight[0])
            assert abs(model(torch.tensor([s])).logits[0, 0].item() - expected) <= 1e-5 * (1 + abs(expected)), s
