"""The embedded engine (megapo/engines/torch_lm.py) on glm4_moe against transformers' fp32 forward on the same
weights: logits, sampled tokens' log-probs, greedy generation (transformers' own cache), and the routes it returns
(one column per MoE layer) against transformers' router choice. (That the learner's own routes are transformers'
choice is tests/test_deepseek_moe_replay.py; the engine and the learner agree in tests/test_deepseek_moe_train.py.)

Models: the tiny glm4_moe of tests/test_glm4_moe.py (4 layers: dense, then 3 MoE; q/k/v biases, q/k norms,
partial rotary 0.5, 2 routing groups of which a token may use 1, a non-zero expert bias) and a variant written
here with a quarter of each head rotary, no q/k norm, no attention bias and no group limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from megapo.engines.base import SamplingParams
from megapo.engines.embedded import EmbeddedEngine
from megapo.engines.torch_lm import TorchCausalLM, TorchLMSpec

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
TOL = 1e-4
MOE_LAYERS = 3


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
    base = Path(tiny_model_factory("glm4_moe", layers=MOE_LAYERS + 1, moe_ffn=32))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    variant = write_variant(base, tmp_path_factory.mktemp("glm_variant"), rope_parameters=rope, use_qk_norm=False,
                            attention_bias=False, n_group=1, topk_group=1)
    return {"tiny": base, "quarter_rotary_plain": variant}


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

    for name, (rope_dim, qk_norm, qkv_bias, groups) in {"tiny": (16, True, True, 2),
                                                          "quarter_rotary_plain": (8, False, False, 0)}.items():
        hf = json.loads((models[name] / "config.json").read_text())
        engine_spec = TorchLMSpec.from_config(hf)
        assert engine_spec == TorchLMSpec.from_model_spec(family_for(hf).spec(hf))
        assert (engine_spec.rope_dim, engine_spec.qk_norm, engine_spec.qkv_bias, engine_spec.router_groups) == (
            rope_dim, qk_norm, qkv_bias, groups), name
        assert engine_spec.moe_layers == (False, True, True, True) and engine_spec.mla is None
        assert (engine_spec.router_score, engine_spec.expert_bias, engine_spec.router_scaling,
                engine_spec.shared_ffn) == ("sigmoid", True, 2.5, hf["moe_intermediate_size"])


@pytest.mark.parametrize("name", ["tiny", "quarter_rotary_plain"])
def test_forward_and_routes_match_transformers(models, name):
    model, hf = TorchCausalLM.from_pretrained(models[name]), hf_model(models[name])
    ids = torch.randint(0, 512, (3, 37), generator=torch.Generator().manual_seed(0))
    logits, routes = model.logits(ids, with_routes=True)
    ref, ref_routes = hf_forward(hf, ids)
    assert routes.shape == (3, 37, MOE_LAYERS, 2)
    assert same_sets(routes, ref_routes).all()
    assert (logits - ref).abs().max().item() < TOL


def test_a_full_rotary_engine_would_differ(models):
    """The partial rotary is in use: the same weights with every dim rotated give other logits."""
    import dataclasses

    model = TorchCausalLM.from_pretrained(models["tiny"])
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(1))
    full = TorchCausalLM(dataclasses.replace(model.spec, rotary_percent=1.0))
    full.load((name, view) for name, view in model.weight_views.items())
    assert (full.logits(ids) - model.logits(ids)).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", ["tiny", "quarter_rotary_plain"])
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
            assert s.routes.shape == (len(seq) - 1, MOE_LAYERS, 2)
            assert same_sets(s.routes, routes[0, :-1].numpy()).all()


@pytest.mark.parametrize("name", ["tiny"])  # (the variant's cached decoding: the sampled log-probs above)
def test_greedy_equals_transformers_generate(models, name):
    engine, hf = EmbeddedEngine(models[name]), hf_model(models[name])
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))
    for prompt, [s] in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          eos_token_id=None, pad_token_id=0)
        assert s.output_ids == ref[0, len(prompt):].tolist()
