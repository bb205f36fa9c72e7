"""`megapo logprobs` end to end (single process and a torchrun layout) vs transformers, and bad
layouts / inputs refused with the numbers before any process starts."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.learner import logprobs_cmd

ROOT = Path(__file__).resolve().parents[1]


def write_input(path: Path, vocab: int = 512, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 2, 11)]
    path.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    return sequences


def transformers_logprobs(model_dir, sequences):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = model(torch.tensor([s])).logits[0, :-1]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


@pytest.mark.parametrize("family, layout", [
    ("qwen3_moe", []),
    ("qwen3_moe", ["--tp", "2", "--ep", "2", "--dispatcher", "allgather"]),
    ("mixtral", ["--tp", "2", "--ep", "2"]),  # router order (softmax after top-k) must match HF
], ids=["qwen3_moe-tp1", "qwen3_moe-tp2xep2", "mixtral-tp2xep2"])
def test_logprobs_command_matches_transformers(tiny_model_factory, tmp_path, family, layout):
    tiny_moe = tiny_model_factory(family)
    sequences = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(tiny_moe), "--input",
           str(tmp_path / "in.jsonl"), "--output", str(out), "--micro-batch-tokens", "20", "--timeout", "300", *layout]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    ref = transformers_logprobs(tiny_moe, sequences)
    assert [len(g) for g in got] == [len(s) - 1 for s in sequences]
    for g, r in zip(got, ref):
        assert (torch.tensor(g) - r).abs().max().item() < 1e-4


def _args(model, tmp_path, **kw):
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        write_input(inp)
    base = dict(model=str(model), input=str(inp), output=str(tmp_path / "out.jsonl"), tp=1, pp=1, ep=1, dp=1,
                dispatcher="alltoall", micro_batch_tokens=64, timeout=60, worker=False)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw, words", [
    (dict(tp=3), ["tp=3", "num_attention_heads=4"]),
    (dict(pp=3), ["pp=3", "num_hidden_layers=2"]),
    (dict(ep=3, dp=3), ["ep=3", "(8)"]),
    (dict(ep=2), ["2", "tp*dp", "1"]),
    (dict(tp=0), ["parallel.tp", "0"]),
])
def test_bad_layout_refused_before_any_process(tiny_moe, tmp_path, capsys, no_launch, kw, words):
    assert logprobs_cmd.run(_args(tiny_moe, tmp_path, **kw)) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_dense_model_with_ep_refused(tiny_dense, tmp_path, capsys, no_launch):
    assert logprobs_cmd.run(_args(tiny_dense, tmp_path, ep=2, dp=2)) == 2
    assert "dense" in capsys.readouterr().err


@pytest.mark.parametrize("content, words", [
    ('{"tokens": [1]}\n', ["--input", "in.jsonl:1:", "at least 2"]),
    ('{"toks": [1, 2]}\n', ["--input", "in.jsonl:1:"]),
    ('{"tokens": [1, 99999]}\n', ["--input", "in.jsonl:1:", "512"]),
])
def test_bad_input_refused(tiny_moe, tmp_path, capsys, no_launch, content, words):
    (tmp_path / "in.jsonl").write_text(content)
    assert logprobs_cmd.run(_args(tiny_moe, tmp_path)) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_missing_model_refused(tmp_path, capsys, no_launch):
    assert logprobs_cmd.run(_args(tmp_path / "nope", tmp_path)) == 2
    assert "config.json" in capsys.readouterr().err
