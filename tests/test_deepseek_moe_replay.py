"""Routing replay on the DeepSeekMoE block's mixed layers, in both families that use it (deepseek_v3: MLA;
glm4_moe: GQA with partial rotary): dense first layer, then MoE layers; sigmoid router with an expert bias, 2
routing groups of which a token may use 1, routed scaling, shared expert; through `megapo logprobs --routes-in /
--routes-out` (the learner's RouteReplayHook) at TP=1, PP=2 (stage 0: the dense layer and the first MoE layer,
stage 1: the other two) and TP=2xEP=2.

Routes have one column per MoE layer (the tiny model here has 4 layers: dense, MoE, MoE, MoE -> 3 columns).
- free: the learner's own routes (recorded, as R2 does) equal transformers' router choice;
- replay: the recorded routes come back exactly when replayed; forced routes (random experts, also outside
  the token's allowed group; partial rows fall back to the router's own choice) come back exactly;
- log-probs with routes forced equal the reference written here: transformers' fp32 forward with each MoE
  layer's router output replaced by the forced experts, their gates recomputed as DeepSeek-V3 and GLM-4.5 define them
  (sigmoid of the router logits, no expert bias, renormalised over the k, times routed_scaling_factor).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapo.replay.routes import load_routes, save_routes

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (5, 17, 2, 11, 9)
TOL = 1e-4
MOE_LAYERS = 3
LAYOUTS = {"tp1": [], "pp2": ["--pp", "2"], "tp2xep2": ["--tp", "2", "--ep", "2", "--dispatcher", "allgather"]}


def load_hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def moe_layers(model) -> list:
    return [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def hf_forced(model, tokens: list[int], routes=None):
    """log p(tokens[t] | tokens[:t]) (t >= 1) and the experts used [n, moe_layers, k], forcing `routes`
    ([m, moe_layers, k]; a (position, layer) entry with a negative id is not forced: transformers' own
    top-k there). Gates of the forced experts: sigmoid(logits) at those experts (no bias), / their sum
    when norm_topk_prob, x routed_scaling_factor."""
    chosen, handles = {}, []
    for column, layer in enumerate(moe_layers(model)):
        def hook(gate, args, out, column=column):
            logits, weights, idx = out
            if routes is not None and len(routes):
                forced = torch.as_tensor(np.asarray(routes)[:, column], dtype=torch.long)
                known = (forced >= 0).all(-1)
                idx = idx.clone()
                idx[: len(forced)][known] = forced[known]
                weights = torch.sigmoid(logits.float()).gather(1, idx)
                if gate.norm_topk_prob:
                    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
                weights = weights * gate.routed_scaling_factor
            chosen[column] = idx.detach()
            return logits, weights, idx
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return logp, torch.stack([chosen[c] for c in range(len(chosen))], dim=1)


def same_sets(a, b) -> np.ndarray:
    return (np.sort(np.asarray(a), -1) == np.sort(np.asarray(b), -1)).all(-1)


def random_routes(positions: int, layers: int, experts: int, topk: int, rng: np.random.Generator) -> np.ndarray:
    return np.stack([[rng.choice(experts, topk, replace=False) for _ in range(layers)]
                     for _ in range(positions)]).astype(np.int32)


def logprobs_cmd(model_dir, tmp: Path, name: str, layout: list[str], routes_in: Path | None) -> dict:
    """Run `megapo logprobs` (routes written to NAME.npz); its log-probs and routes."""
    out, routes_out = tmp / f"{name}.jsonl", tmp / f"{name}.npz"
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(model_dir), "--input", str(tmp / "in.jsonl"),
           "--output", str(out), "--routes-out", str(routes_out), "--micro-batch-tokens", "20", "--timeout", "300",
           *layout, *(["--routes-in", str(routes_in)] if routes_in else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logps = [torch.tensor(json.loads(line)["logprobs"]) for line in out.read_text().splitlines()]
    return dict(logprobs=logps, routes=load_routes(routes_out, len(logps)))


# family -> transformers' class names of its dense and MoE MLPs
MLP_CLASSES = {"deepseek_v3": ("DeepseekV3MLP", "DeepseekV3MoE"), "glm4_moe": ("Glm4MoeMLP", "Glm4MoeMoE")}


@pytest.fixture(scope="module", params=list(MLP_CLASSES))
def runs(request, tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory(request.param, layers=MOE_LAYERS + 1, moe_ffn=32)
    tmp = tmp_path_factory.mktemp(f"{request.param}_replay")
    rng = random.Random(3)
    sequences = [[rng.randrange(512) for _ in range(n)] for n in LENGTHS]
    (tmp / "in.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    free = logprobs_cmd(model_dir, tmp, "free", [], None)
    # what to replay: 0 its recorded routes; 1, 4 random experts; 2 none (missing key); 3 partial
    draw = np.random.default_rng(0)
    forced = {0: free["routes"][0], 1: random_routes(len(sequences[1]) - 1, MOE_LAYERS, 8, 2, draw),
              3: random_routes(len(sequences[3]) - 1, MOE_LAYERS, 8, 2, draw)[:7],
              4: random_routes(len(sequences[4]) - 1, MOE_LAYERS, 8, 2, draw)}
    forced[3][::2, 1] = -1  # every other position of the second MoE layer: the router's own choice
    np.savez(tmp / "forced_in.npz", **{str(i): r for i, r in forced.items()})
    out = dict(family=request.param, free=free, model_dir=model_dir, sequences=sequences, forced=load_routes(tmp / "forced_in.npz", len(sequences)))
    for name, layout in LAYOUTS.items():
        out[name] = logprobs_cmd(model_dir, tmp, name, layout, tmp / "forced_in.npz")
    out["hf"] = load_hf(model_dir)
    return out


def test_routes_have_one_column_per_moe_layer(runs):
    dense, moe = MLP_CLASSES[runs["family"]]
    assert [type(layer.mlp).__name__ for layer in runs["hf"].model.layers] == [dense] + [moe] * 3
    for seq, routes in zip(runs["sequences"], runs["free"]["routes"]):
        assert routes.shape == (len(seq) - 1, MOE_LAYERS, 2)


def test_free_routes_are_transformers_choice_and_log_probs_match(runs):
    for i, seq in enumerate(runs["sequences"]):
        logp, used = hf_forced(runs["hf"], seq)
        assert same_sets(runs["free"]["routes"][i], used[:-1].numpy()).all(), f"sequence {i}"
        assert (runs["free"]["logprobs"][i] - logp).abs().max().item() < TOL, f"sequence {i}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replayed_routes_come_back_exactly(runs, layout):
    """Given positions: the routes given, in their order; elsewhere: transformers' own choice (as a set)."""
    for i, (seq, given, used) in enumerate(zip(runs["sequences"], runs["forced"], runs[layout]["routes"])):
        assert used.shape == (len(seq) - 1, MOE_LAYERS, 2), i
        own = hf_forced(runs["hf"], seq)[1][:-1].numpy()
        known = np.zeros(used.shape[:2], dtype=bool)
        if given is not None:
            known[: len(given)] = (given >= 0).all(-1)
            np.testing.assert_array_equal(used[: len(given)][known[: len(given)]],
                                          given[(given >= 0).all(-1)], err_msg=f"sequence {i}")
        assert same_sets(used[~known], own[~known]).all(), f"sequence {i}"
    np.testing.assert_array_equal(runs[layout]["routes"][0], runs["free"]["routes"][0])  # recorded -> replayed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_with_routes_forced_equal_transformers_forced(runs, layout):
    moved = 0.0
    for i, (seq, given) in enumerate(zip(runs["sequences"], runs["forced"])):
        ref, _ = hf_forced(runs["hf"], seq, given)
        got = runs[layout]["logprobs"][i]
        assert got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err < TOL, f"sequence {i}: max |learner - transformers forced| = {err:.2e}"
        moved = max(moved, (ref - hf_forced(runs["hf"], seq)[0]).abs().max().item())
    assert moved > 1e-3  # the forced experts change the log-probs: a replay that ignored them would fail
