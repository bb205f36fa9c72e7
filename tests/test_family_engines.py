"""The embedded engine (megapo/engines/torch_lm.py) against transformers' fp32 forward on the same weights, on each
MoE family's tiny models (tests/family_checks.py ENGINE_MODELS: deepseek_v3, glm4_moe and gpt_oss, and variants):
logits, sampled tokens' log-probs (prompts of different lengths: left padding), greedy generation (transformers'
own cache: MLA, partial rotary, sliding-window layers), and the routes it returns (one column per MoE layer)
against transformers' router choice and the learner's own routing (`megapo logprobs --routes-out`).
Each family's own engine checks: tests/test_<family>_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import ENGINE_MODELS, ROOT, TOL, engine_model, hf_forward, hf_model, same_sets  # noqa: E402

from megapo.engines.base import SamplingParams  # noqa: E402
from megapo.engines.embedded import EmbeddedEngine  # noqa: E402
from megapo.engines.torch_lm import TorchCausalLM  # noqa: E402
from megapo.replay.routes import load_routes  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
# (glm4_moe's variant's cached decoding: its sampled log-probs)
GREEDY = [name for name in ENGINE_MODELS if name != "glm4_moe-quarter_rotary_plain"]
WITH_LEARNER = ["deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    """model_dir(name) -> the folder of ENGINE_MODELS[name], written once in this module."""
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = engine_model(name, tiny_model_factory, tmp_path_factory)
        return written[name]

    return get


@pytest.mark.parametrize("name", list(ENGINE_MODELS))
def test_forward_and_routes_match_transformers(model_dir, name):
    model, hf = TorchCausalLM.from_pretrained(model_dir(name)), hf_model(model_dir(name))
    ids = torch.randint(0, 512, (3, 37), generator=torch.Generator().manual_seed(0))
    logits, routes = model.logits(ids, with_routes=True)
    ref, ref_routes = hf_forward(hf, ids)
    assert routes.shape == (3, 37, ENGINE_MODELS[name].moe_layers, 2)
    assert same_sets(routes, ref_routes).all()
    assert (logits - ref).abs().max().item() < TOL


@pytest.mark.parametrize("name", list(ENGINE_MODELS))
def test_sampled_logprobs_and_routes_match_transformers(model_dir, name):
    engine, hf = EmbeddedEngine(model_dir(name)), hf_model(model_dir(name))
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
            assert s.routes.shape == (len(seq) - 1, ENGINE_MODELS[name].moe_layers, 2)
            assert same_sets(s.routes, routes[0, :-1].numpy()).all()


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_equals_transformers_generate(model_dir, name):
    engine, hf = EmbeddedEngine(model_dir(name)), hf_model(model_dir(name))
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))
    for prompt, [s] in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          eos_token_id=None, pad_token_id=0)
        assert s.output_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", WITH_LEARNER)
def test_routes_equal_the_learners_free_routes(model_dir, name, tmp_path):
    """The routes R3 would replay are the learner's own choice on the same weights (as sets per position)."""
    engine = EmbeddedEngine(model_dir(name))
    samples = [s for group in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=5,
                                                                       return_routes=True)) for s in group]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s.prompt_ids + s.output_ids}) + "\n"
                                               for s in samples))
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(model_dir(name)), "--input",
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
