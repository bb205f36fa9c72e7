"""The embedded engine (megapo/engines/torch_lm.py) on deepseek_v3 against transformers' fp32 forward on the
same weights: logits, sampled tokens' log-probs, greedy generation (transformers' own MLA cache), and the
routes it returns (one column per MoE layer) against transformers' router choice and the learner's own
routing (`megapo logprobs --routes-out`).

Models: the tiny deepseek_v3 with 3 layers (dense, MoE, MoE; q through the q_lora_rank bottleneck, 2 routing
groups of which a token may use 1, a non-zero expert bias) and a variant written here without the q
bottleneck (q_proj) and without group-limited routing (n_group=1)."""

from __future__ import annotations

import json
import shutil
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


def write_variant(base: Path, out: Path, seed: int = 1, **changes) -> Path:
    """A copy of the tiny model's config with `changes`, fresh transformers weights and a random expert bias."""
    config = transformers.AutoConfig.from_pretrained(base)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    model.save_pretrained(out)
    for f in base.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    base = Path(tiny_model_factory("deepseek_v3", layers=3, moe_ffn=32))
    variant = write_variant(base, tmp_path_factory.mktemp("ds_variant"), q_lora_rank=None, n_group=1, topk_group=1)
    return {"tiny": base, "q_proj_one_group": variant}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_forward(hf, ids: torch.Tensor):
    """transformers' logits [B, T, V] and its routers' top-k [B, T, moe_layers, k]."""
    chosen, handles = [], []
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2])))
    try:
        with torch.no_grad():
            logits = hf(ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    return logits, torch.stack([c.view(*ids.shape, -1) for c in chosen], dim=2)


def same_sets(a, b) -> np.ndarray:
    return (np.sort(np.asarray(a), -1) == np.sort(np.asarray(b), -1)).all(-1)


def test_spec_comes_from_the_learners_model_spec(models):
    from megapo.models.family import family_for

    hf = json.loads((models["tiny"] / "config.json").read_text())
    spec = family_for(hf).spec(hf)
    assert TorchLMSpec.from_config(hf) == TorchLMSpec.from_model_spec(spec)
    engine_spec = TorchLMSpec.from_config(hf)
    assert engine_spec.moe_layers == (False, True, True) and engine_spec.num_moe_layers == 2
    assert (engine_spec.router_score, engine_spec.expert_bias, engine_spec.router_groups,
            engine_spec.router_group_topk, engine_spec.router_scaling) == ("sigmoid", True, 2, 1, 2.5)
    assert engine_spec.mla == spec.mla and engine_spec.shared_ffn == hf["moe_intermediate_size"]


@pytest.mark.parametrize("name", ["tiny", "q_proj_one_group"])
def test_forward_and_routes_match_transformers(models, name):
    model, hf = TorchCausalLM.from_pretrained(models[name]), hf_model(models[name])
    ids = torch.randint(0, 512, (3, 37), generator=torch.Generator().manual_seed(0))
    logits, routes = model.logits(ids, with_routes=True)
    ref, ref_routes = hf_forward(hf, ids)
    assert routes.shape == (3, 37, 2, 2)
    assert same_sets(routes, ref_routes).all()
    assert (logits - ref).abs().max().item() < TOL


def test_the_expert_bias_is_loaded_and_chooses(models):
    """Zeroing the engine's expert bias changes its routes: the loaded bias is in use."""
    model = TorchCausalLM.from_pretrained(models["tiny"])
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(1))
    _, with_bias = model.logits(ids, with_routes=True)
    for layer in model.layers:
        if layer.get("expert_bias") is not None:
            layer["expert_bias"].zero_()
    _, without = model.logits(ids, with_routes=True)
    assert not same_sets(with_bias, without).all()


@pytest.mark.parametrize("name", ["tiny", "q_proj_one_group"])
def test_sampled_logprobs_and_routes_match_transformers(models, name):
    engine, hf = EmbeddedEngine(models[name]), hf_model(models[name])
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


@pytest.mark.parametrize("name", ["tiny", "q_proj_one_group"])
def test_greedy_equals_transformers_generate(models, name):
    engine, hf = EmbeddedEngine(models[name]), hf_model(models[name])
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))
    for prompt, [s] in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          eos_token_id=None, pad_token_id=0)
        assert s.output_ids == ref[0, len(prompt):].tolist()


def test_routes_equal_the_learners_free_routes(models, tmp_path):
    """The routes R3 would replay are the learner's own choice on the same weights (as sets per position)."""
    engine = EmbeddedEngine(models["tiny"])
    samples = [s for group in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=5,
                                                                       return_routes=True)) for s in group]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s.prompt_ids + s.output_ids}) + "\n"
                                               for s in samples))
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(models["tiny"]), "--input",
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
