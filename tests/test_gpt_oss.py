"""The gpt-oss family (megapo/models/gpt_oss): its tiny model, its ModelSpec, the fused expert tensors read
and written back, the learner's log-probs against transformers' fp32 forward under TP=1, TP=2, PP=2, EP=2 x
DP=2 and TP=2xEP=2, one REINFORCE step at TP=1 against the same step done in transformers (Adam's first
step written out here), every other layout's step against TP=1, and the config.json values the Megatron
model would compute differently, refused by name.

The tiny model has alternating sliding-window (window 4) and full-attention layers, random non-zero
attention sinks, q/k/v/o, router and expert biases, and a swiglu_limit small enough that the clamps cut;
the first test shows each of them changes transformers' log-probs, so a learner that dropped one fails
the parity tests. The sequences are packed several to a row (micro-batches of 40 tokens), so the sliding
window is checked together with the packing mask."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.config import ConfigError
from megapo.models.family import family_for
from megapo.weights.safetensors_io import open_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_runs import run_layout_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "learner_layouts.py"
OPTIM = dict(lr=1000.0, adam_eps=1000.0, grad_clip=0.0)  # Adam's first step ~ lr * g / (|g| + eps): ~ g
LAYOUTS = {1: [dict(tp=1, pp=1, ep=1, dp=1)],
           2: [dict(tp=2, pp=1, ep=1, dp=1), dict(tp=1, pp=2, ep=1, dp=1), dict(tp=1, pp=1, ep=2, dp=2),
               dict(tp=2, pp=1, ep=2, dp=1)]}
TP1 = "moe/tp1_pp1_ep1_dp1/alltoall"
# gpt-oss's own YaRN, with the original context shortened so that the test sequences span its ramp
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}


@pytest.fixture(scope="module")
def tiny_oss(tiny_model_factory):
    return tiny_model_factory("gpt_oss", moe_ffn=32)


def hf_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def load_hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def read_tensors(path) -> dict[str, torch.Tensor]:
    with open_tensors(path) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def sequence_logprobs(model, tokens: list[int]) -> torch.Tensor:
    t = torch.tensor([tokens])
    return torch.log_softmax(model(t).logits[0, :-1], -1).gather(-1, t[0, 1:, None])[:, 0]


def reference_logprobs(model, sequences):
    with torch.no_grad():
        return [sequence_logprobs(model, s) for s in sequences]


def make_data(vocab: int, seed: int = 3):
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 2, 11)]
    batch = [dict(tokens=[rng.randrange(vocab) for _ in range(n)], prompt_len=p, advantage=rng.uniform(-1, 1),
                  old_logp=[-6.0] * (n - p)) for n, p in [(10, 4), (16, 6), (7, 3), (20, 10)]]
    return sequences, batch


def test_tiny_model_has_every_feature_and_each_changes_the_reference(tiny_oss):
    hf = hf_config(tiny_oss)
    assert hf["model_type"] == "gpt_oss" and hf["layer_types"] == ["sliding_attention", "full_attention"]
    assert hf["sliding_window"] < 17 and hf["rope_parameters"]["rope_type"] == "default"
    sequences, _ = make_data(hf["vocab_size"])
    model = load_hf(tiny_oss)
    base = reference_logprobs(model, sequences)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp

    def zeroed(tensor):
        saved = tensor.detach().clone()
        tensor.data.zero_()
        return lambda: tensor.data.copy_(saved)

    def no_window():
        model.config.sliding_window = 10_000
        return lambda: setattr(model.config, "sliding_window", hf["sliding_window"])

    def no_clamp():
        mlp.experts.limit = 1e9
        return lambda: setattr(mlp.experts, "limit", hf["swiglu_limit"])

    changes = {"sinks": lambda: zeroed(attn.sinks), "window": no_window, "clamp": no_clamp,
               **{name: (lambda t=t: zeroed(t)) for name, t in [
                   ("q bias", attn.q_proj.bias), ("o bias", attn.o_proj.bias), ("router bias", mlp.router.bias),
                   ("gate_up bias", mlp.experts.gate_up_proj_bias), ("down bias", mlp.experts.down_proj_bias)]}}
    for name, change in changes.items():
        undo = change()
        moved = max((a - b).abs().max().item() for a, b in zip(reference_logprobs(model, sequences), base))
        undo()
        assert moved > 1e-3, f"{name}: log-probs moved only {moved:.1e}"


def test_spec_reads_the_config(tiny_oss):
    hf = hf_config(tiny_oss)
    spec = family_for(hf).spec(hf)
    assert (spec.num_experts, spec.topk, spec.moe_ffn_hidden_size) == (hf["num_local_experts"],
                                                                      hf["num_experts_per_tok"], hf["intermediate_size"])
    assert spec.router_pre_softmax is False and spec.router_score == "softmax"
    assert (spec.qkv_bias, spec.linear_bias, spec.attention_sinks) == (True, True, True)
    assert (spec.sliding_window, spec.window_layers) == (hf["sliding_window"], (True, False))
    assert (spec.activation, spec.glu_clamp, spec.glu_linear_offset) == ("quick_gelu", hf["swiglu_limit"], 1.0)


def test_fused_experts_read_per_expert_and_pack_back_bit_exact(tiny_oss):
    """Per-expert views of the fused file tensors (what the loader reads) are transformers' gate = [..., ::2],
    up = [..., 1::2] of gate_up_proj[e] transposed; packing them back gives the file's tensors."""
    from megapo.models.gpt_oss.mapping import FusedExperts, pack
    from megapo.weights.hf_load import SafetensorsReader

    hf = hf_config(tiny_oss)
    spec = family_for(hf).spec(hf)
    files = read_tensors(Path(tiny_oss) / "model.safetensors")
    view = FusedExperts(SafetensorsReader(tiny_oss))
    per_expert = []
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for e in range(spec.num_experts):
            gate_up, bias = files[prefix + "gate_up_proj"][e], files[prefix + "gate_up_proj_bias"][e]
            expected = {"gate_proj.weight": gate_up[:, 0::2].t(), "up_proj.weight": gate_up[:, 1::2].t(),
                        "gate_proj.bias": bias[0::2], "up_proj.bias": bias[1::2],
                        "down_proj.weight": files[prefix + "down_proj"][e].t(),
                        "down_proj.bias": files[prefix + "down_proj_bias"][e]}
            for suffix, tensor in expected.items():
                name = f"{prefix}{e}.{suffix}"
                assert torch.equal(view.get(name), tensor) and view.shape(name) == list(tensor.shape), name
                per_expert.append((name, view.get(name)))
    plain = [(n, t) for n, t in files.items() if ".mlp.experts." not in n]
    packed = dict(pack(spec, iter(plain + per_expert)))
    assert sorted(packed) == sorted(files)
    assert all(torch.equal(packed[n], files[n]) for n in files)


@pytest.fixture(scope="module")
def runs(tiny_oss, tmp_path_factory):
    """One process at TP=1 and one 2-process launch over TP=2, PP=2, EP=2xDP=2, TP=2xEP=2: log-probs, one
    REINFORCE step, the weights after it (tests/distributed/learner_layouts.py)."""
    tmp = tmp_path_factory.mktemp("oss_layouts")
    sequences, batch = make_data(hf_config(tiny_oss)["vocab_size"])
    base = dict(models={"moe": str(tiny_oss)}, sequences=sequences, batch=batch, optim=OPTIM, micro_batch_tokens=40,
                row_tokens=0, objective="reinforce", loss_agg="token-mean", dispatchers=["alltoall"])
    results = {}
    for world in (1, 2):
        saved = run_layout_script(SCRIPT, dict(base, layouts=LAYOUTS[world]), world, tmp)
        results.update(saved)
    return dict(results=results, sequences=sequences, batch=batch)


def test_logprobs_match_transformers_in_every_layout(tiny_oss, runs):
    ref = reference_logprobs(load_hf(tiny_oss), runs["sequences"])
    assert len(runs["results"]) == 5
    for key, result in runs["results"].items():
        assert [g.shape for g in result["logprobs"]] == [r.shape for r in ref], key
        err = max((g - r).abs().max().item() for g, r in zip(result["logprobs"], ref))
        assert err < 1e-4, f"{key}: max |logp - transformers| = {err:.2e}"


def hf_reinforce_step(model_dir, batch) -> tuple[dict[str, torch.Tensor], float]:
    """Weights after one Adam step on the token-mean REINFORCE loss, all in transformers."""
    model = load_hf(model_dir)
    total = sum(len(s["tokens"]) - s["prompt_len"] for s in batch)
    loss = sum((-s["advantage"] * sequence_logprobs(model, s["tokens"])[s["prompt_len"] - 1:]).sum() / total
               for s in batch)
    loss.backward()
    with torch.no_grad():  # Adam's first step: bias-corrected m = g, v = g^2
        return {n: p - OPTIM["lr"] * p.grad / (p.grad.abs() + OPTIM["adam_eps"])
                for n, p in model.named_parameters()}, float(loss)


def test_tp1_step_matches_transformers_adam_step(tiny_oss, runs):
    expected, loss = hf_reinforce_step(tiny_oss, runs["batch"])
    got = runs["results"][TP1]
    assert set(got["weights"]) == set(expected) and abs(got["loss"] - loss) < 1e-5
    initial = read_tensors(Path(tiny_oss) / "model.safetensors")
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                 "model.layers.0.mlp.experts.down_proj_bias", "model.layers.1.mlp.experts.gate_up_proj"):
        assert (expected[name] - initial[name]).abs().max() > 1e-4, f"{name} barely moves: the test means nothing"
    for name, tensor in expected.items():
        err = (got["weights"][name] - tensor).abs().max().item()
        assert err < 2e-6, f"{name}: max |megapo - transformers| after one step = {err:.2e}"


def test_every_layout_steps_like_tp1(runs):
    ref = runs["results"][TP1]
    for key, got in runs["results"].items():
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], key
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), key
        for name, tensor in ref["weights"].items():
            err = (got["weights"][name] - tensor).abs().max().item()
            assert err < 1e-6, f"{key} {name}: max |layout - TP=1| after one step = {err:.2e}"


@pytest.mark.parametrize("change, words", [
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 150000.0}), ["rope_parameters.rope_type", "longrope"]),
    (dict(rope_parameters={**YARN, "attention_factor": 1.0}), ["YaRN", "attention_factor"]),
    (dict(attention_bias=False), ["attention_bias=false"]),
    (dict(swiglu_alpha=1.5), ["swiglu_alpha=1.5"]),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), ["layer_types", "chunked_attention"]),
    (dict(sliding_window=None), ["sliding_window=None"]),
], ids=["longrope", "yarn_attention_factor", "attention_bias", "swiglu_alpha", "layer_types", "sliding_window"])
def test_configs_it_would_compute_differently_are_refused(tiny_oss, change, words):
    hf = {**copy.deepcopy(hf_config(tiny_oss)), **change}
    with pytest.raises(ConfigError) as err:
        family_for(hf).spec(hf)
    assert all(w in str(err.value) for w in words), str(err.value)


def write_yarn_variant(model_dir: Path, out: Path) -> Path:
    """The tiny model's weights under gpt-oss's YaRN rope."""
    import shutil

    shutil.copytree(model_dir, out)
    config = {**hf_config(model_dir), "rope_parameters": YARN}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_yarn_logprobs_match_transformers_at_tp2(tiny_oss, tmp_path):
    """YaRN through Megatron's YarnRotaryEmbedding (cos/sin x 0.1 ln(factor) + 1 in attention), per-sequence
    positions of packed rows, TP=2: == transformers' fp32 forward, which YaRN visibly moves."""
    yarn = write_yarn_variant(Path(tiny_oss), tmp_path / "yarn")
    spec = family_for(hf_config(yarn)).spec(hf_config(yarn))
    assert (spec.yarn.factor, spec.yarn.original_max_positions, spec.yarn.truncate) == (32.0, 16, False)
    sequences, _ = make_data(512)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(yarn), "--input", str(tmp_path / "in.jsonl"),
           "--output", str(tmp_path / "out.jsonl"), "--micro-batch-tokens", "20", "--timeout", "300", "--tp", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [torch.tensor(json.loads(line)["logprobs"]) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    ref = reference_logprobs(load_hf(yarn), sequences)
    plain = reference_logprobs(load_hf(tiny_oss), sequences)
    assert max((r - p).abs().max().item() for r, p in zip(ref, plain)) > 5e-4  # YaRN changes the reference
    assert max((g - r).abs().max().item() for g, r in zip(got, ref)) < 1e-4
