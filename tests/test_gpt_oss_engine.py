"""The embedded engine (megapo/engines/torch_lm.py) on gpt_oss against transformers' fp32 forward on the same
weights: logits, sampled tokens' log-probs (prompts of different lengths: left padding), greedy generation
(transformers' own cache with its sliding-window layers), and the routes it returns against transformers'
router choice and the learner's own routing (`megapo logprobs --routes-out`).

Model: the tiny gpt_oss of tests/test_gpt_oss.py (sliding window 4, then full attention; random non-zero
sinks and q/k/v/o, router and expert biases; swiglu_limit 0.1, so the clamps cut; that each of these changes
transformers' log-probs is shown there), on sequences much longer than the window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from megapo.engines.base import SamplingParams
from megapo.engines.embedded import EmbeddedEngine
from megapo.engines.torch_lm import TorchCausalLM, TorchLMSpec
from megapo.replay.routes import load_routes

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_oss(tiny_model_factory):
    return Path(tiny_model_factory("gpt_oss", moe_ffn=32))


@pytest.fixture(scope="module")
def hf(tiny_oss):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_oss, dtype=torch.float32).eval()


def hf_forward(hf, ids: torch.Tensor):
    """transformers' logits [B, T, V] and its routers' top-k [B, T, layers, k]."""
    chosen, handles = [], []
    for layer in hf.model.layers:
        handles.append(layer.mlp.router.register_forward_hook(lambda m, a, out: chosen.append(out[2])))
    try:
        with torch.no_grad():
            logits = hf(ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    return logits, torch.stack([c.view(*ids.shape, -1) for c in chosen], dim=2)


def same_sets(a, b) -> np.ndarray:
    return (np.sort(np.asarray(a), -1) == np.sort(np.asarray(b), -1)).all(-1)


def test_spec_comes_from_the_learners_model_spec(tiny_oss):
    from megapo.models.family import family_for

    config = json.loads((tiny_oss / "config.json").read_text())
    spec = TorchLMSpec.from_config(config)
    assert spec == TorchLMSpec.from_model_spec(family_for(config).spec(config))
    assert (spec.linear_bias, spec.sinks, spec.sliding_window, spec.window_layers) == (True, True, 4, (True, False))
    assert (spec.glu_clamp, spec.glu_linear_offset, spec.norm_topk) == (config["swiglu_limit"], 1.0, True)


def test_forward_and_routes_match_transformers(tiny_oss, hf):
    model = TorchCausalLM.from_pretrained(tiny_oss)
    ids = torch.randint(0, 512, (3, 37), generator=torch.Generator().manual_seed(0))
    logits, routes = model.logits(ids, with_routes=True)
    ref, ref_routes = hf_forward(hf, ids)
    assert routes.shape == (3, 37, 2, 2)
    assert same_sets(routes, ref_routes).all()
    assert (logits - ref).abs().max().item() < TOL


def test_sampled_logprobs_and_routes_match_transformers(tiny_oss, hf):
    engine = EmbeddedEngine(tiny_oss)
    temperature = 0.7
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=10, seed=3,
                                                  return_routes=True))
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            seq = prompt + s.output_ids
            logits, routes = hf_forward(hf, torch.tensor([seq]))
            ref = torch.log_softmax(logits[0] / temperature, dim=-1)[len(prompt) - 1:-1]
            ref = ref.gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
            assert np.abs(np.asarray(s.logprobs) - ref.numpy()).max() < TOL
            assert s.routes.shape == (len(seq) - 1, 2, 2)
            assert same_sets(s.routes, routes[0, :-1].numpy()).all()


def test_greedy_equals_transformers_generate(tiny_oss, hf):
    engine = EmbeddedEngine(tiny_oss)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))
    for prompt, [s] in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          eos_token_id=None, pad_token_id=0)
        assert s.output_ids == ref[0, len(prompt):].tolist()


def test_routes_equal_the_learners_free_routes(tiny_oss, tmp_path):
    """The routes R3 would replay are the learner's own choice on the same weights (as sets per position)."""
    engine = EmbeddedEngine(tiny_oss)
    samples = [s for group in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=5,
                                                                       return_routes=True)) for s in group]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s.prompt_ids + s.output_ids}) + "\n"
                                               for s in samples))
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(tiny_oss), "--input",
           str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--routes-out",
           str(tmp_path / "routes.npz"), "--timeout", "300"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    learner = load_routes(tmp_path / "routes.npz", len(samples))
    learner_logps = [json.loads(line)["logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for i, s in enumerate(samples):
        assert learner[i].shape == s.routes.shape, i
        assert same_sets(learner[i], s.routes).all(), f"sample {i}"
        response = np.asarray(learner_logps[i][len(s.prompt_ids) - 1:])  # temperature 1: the policy's log-probs
        assert np.abs(response - np.asarray(s.logprobs)).max() < TOL, f"sample {i}"


def test_yarn_forward_matches_transformers(tiny_oss, tmp_path):
    """gpt-oss's YaRN rope (its own factor and betas, the original context shortened to 16 so that 300 tokens
    span the ramp): logits within 1e-4 of transformers'."""
    import shutil

    yarn = tmp_path / "yarn"
    shutil.copytree(tiny_oss, yarn)
    config = json.loads((yarn / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}
    (yarn / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(2))
    ref = hf_forward(transformers.AutoModelForCausalLM.from_pretrained(yarn, dtype=torch.float32).eval(), ids)[0]
    plain = TorchCausalLM.from_pretrained(tiny_oss).logits(ids)
    assert (plain - ref).abs().max().item() > 1e-3  # YaRN changes the logits
    assert (TorchCausalLM.from_pretrained(yarn).logits(ids) - ref).abs().max().item() < TOL
