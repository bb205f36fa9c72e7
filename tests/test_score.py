"""Reward models: `megapo tiny-model --head score` and `megapo score` (megapo/learner/score.py).

Reference: transformers' AutoModelForSequenceClassification (fp32) on the same folder, one unpadded sequence at a
time, which scores the last token that is not pad_token_id. Layouts: TP=1 in one process, TP=2 x EP=2 in one
torchrun launch. Bad folders, inputs and layouts refused before any process starts, naming the flag.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.cli import run_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2", "mixtral"])
def test_tiny_model_score_head_loads_in_transformers(tmp_path, family):
    import transformers

    out = tmp_path / "rm"
    args = argparse.Namespace(out=str(out), family=family, layers=1, experts=4, topk=2, hidden=32, heads=2,
                              kv_heads=1, head_dim=16, ffn=64, moe_ffn=32, vocab=320, seed=0, head="score")
    assert run_command("tiny-model", args) == 0
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__.endswith("ForSequenceClassification")
    assert model.config.num_labels == 1 and model.config.model_type == family
    assert model.score.weight.shape == (1, 32) and model.score.bias is None
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 1)


def score_inputs(path: Path, vocab: int = 512, pad: int = 0, seed: int = 3) -> list[list[int]]:
    """Sequences of several lengths, one of a single token, one ending in the pad id (scored at the token
    before it), none otherwise holding it."""
    rng = random.Random(seed)
    sequences = [[rng.randrange(1, vocab) for _ in range(n)] for n in (5, 17, 1, 11, 8)]
    sequences[-1][-1] = pad
    path.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    return sequences


def transformers_scores(model_dir, sequences) -> list[float]:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0, 0].item() for s in sequences]


@pytest.mark.parametrize("layout", [[], ["--tp", "2", "--ep", "2"]], ids=["tp1", "tp2xep2"])
def test_score_command_matches_transformers(tiny_model_factory, tmp_path, layout):
    rm = tiny_model_factory("qwen3_moe", head="score")
    sequences = score_inputs(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "megapo.cli", "score", "--model", str(rm), "--input", str(tmp_path / "in.jsonl"),
           "--output", str(out), "--micro-batch-tokens", "20", "--timeout", "600", *layout]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line)["score"] for line in out.read_text().splitlines()]
    ref = transformers_scores(rm, sequences)
    assert len(got) == len(sequences)
    assert max(abs(g - r) for g, r in zip(got, ref)) < 1e-5, (got, ref)
    assert len({round(r, 4) for r in ref}) == len(ref)  # the scores differ: a wrong position would show


@pytest.fixture
def no_score_launch(monkeypatch):
    """Fails the test if `megapo score` would start a process or build a model."""
    import megapo.launch.local
    from megapo.commands import score as score_cmd

    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(megapo.launch.local, "run_workers", refuse)
    monkeypatch.setattr(score_cmd, "_work", refuse)


def _args(model, tmp_path, **kw):
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        score_inputs(inp)
    base = dict(model=str(model), input=str(inp), output=str(tmp_path / "out.jsonl"), tp=1, pp=1, ep=1, dp=1,
                dispatcher="alltoall", micro_batch_tokens=64, precision="fp32", timeout=60, worker=False)
    base.update(kw)
    return argparse.Namespace(**base)


def without_score_tensor(rm: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(rm, out)
    tensors = load_file(out / "model.safetensors")
    del tensors["score.weight"]
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("case, words", [
    ("lm_folder", ["--model", "architectures", "ForSequenceClassification"]),
    ("no_score_tensor", ["--model", "'score.weight'"]),
    ("missing", ["--model", "config.json"]),
    ("tp3", ["tp=3", "num_attention_heads=4"]),
    ("empty_tokens", ["--input", "in.jsonl:1:"]),
    ("out_of_vocab", ["--input", "in.jsonl:1:", "512"]),
])
def test_bad_inputs_refused_before_any_process(tiny_model_factory, tiny_moe, tmp_path, capsys, no_score_launch,
                                               case, words):
    model = tiny_model_factory("qwen3_moe", head="score")
    kw = {}
    if case == "lm_folder":
        model = tiny_moe
    elif case == "no_score_tensor":
        model = without_score_tensor(model, tmp_path / "rm")
    elif case == "missing":
        model = tmp_path / "nope"
    elif case == "tp3":
        kw = dict(tp=3)
    else:
        (tmp_path / "in.jsonl").write_text('{"tokens": []}\n' if case == "empty_tokens" else '{"tokens": [1, 512]}\n')
    assert run_command("score", _args(model, tmp_path, **kw)) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
