"""The GLM-4.5 family (megapo/models/glm4_moe): its tiny model, its ModelSpec, the learner's log-probs against
transformers' fp32 forward on the same weights under TP=1, TP=2, PP=2, EP=2 (x DP=2) and TP=2xEP=2 (two launches
of tests/distributed/learner_layouts.py, world 1 and 2; the `megapo logprobs` command itself, at TP=1, PP=2 and
TP=2xEP=2 with the allgather dispatcher, is tests/test_family_replay.py), one optimizer step under each layout
vs TP=1, and the config.json values the Megatron model would compute differently, refused by name.

The tiny model (4 layers: dense, then 3 MoE layers) has GQA with q/k/v biases and q/k RMSNorms, partial rotary
0.5 (16 of 32 dims per head), 8 experts in 2 routing groups of which a token may use 1, one shared expert, a
routed scaling factor and a non-zero router expert bias (a buffer). transformers initialises the biases to zero and
the q/k norms to one; the tiny model's are random, and each of them (and the rotary share) is shown here to change
the reference, so a learner that dropped one fails the parity tests."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from megapo.config import ConfigError
from megapo.launch.local import run_torchrun
from megapo.models.family import family_for
from megapo.weights.safetensors_io import open_tensors

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "learner_layouts.py"
LAYERS = 4  # dense, MoE, MoE, MoE (PP=2: stage 0 the dense and the first MoE layer)
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
OPTIM = dict(lr=1000.0, adam_eps=1000.0, grad_clip=0.0)  # Adam's first step ~ lr * g / eps: linear in g
LAYOUTS = {1: [dict(tp=1, pp=1, ep=1, dp=1)],
           2: [dict(tp=2, pp=1, ep=1, dp=1), dict(tp=1, pp=2, ep=1, dp=1), dict(tp=1, pp=1, ep=2, dp=2),
               dict(tp=2, pp=1, ep=2, dp=1)]}
TP1 = "moe/tp1_pp1_ep1_dp1/alltoall"

# GLM-4.5's own config.json (zai-org/GLM-4.5), the keys the mapping reads
GLM45 = dict(model_type="glm4_moe", attention_bias=True, head_dim=128, hidden_act="silu", hidden_size=5120,
             partial_rotary_factor=0.5, intermediate_size=12288, max_position_embeddings=131072,
             moe_intermediate_size=1536, norm_topk_prob=True, num_attention_heads=96, n_group=1, topk_group=1,
             n_routed_experts=160, n_shared_experts=1, routed_scaling_factor=2.5, num_experts_per_tok=8,
             first_k_dense_replace=3, num_hidden_layers=92, num_key_value_heads=8, rms_norm_eps=1e-05,
             rope_scaling=None, rope_theta=1000000, num_nextn_predict_layers=1, tie_word_embeddings=False,
             use_qk_norm=True, vocab_size=151552)


@pytest.fixture(scope="module")
def tiny_glm(tiny_model_factory):
    return tiny_model_factory("glm4_moe", layers=LAYERS, moe_ffn=32)


def hf_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def load_hf(model_dir, **overrides):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    for key, value in overrides.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)


def reference_logprobs(model, sequences):
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0, :-1], -1)
                .gather(-1, torch.tensor(s[1:])[:, None])[:, 0] for s in sequences]


def max_diff(a, b) -> float:
    return max((torch.as_tensor(x) - y).abs().max().item() for x, y in zip(a, b))


def make_data(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (7, 12, 3, 20, 9)]
    batch = []
    for n, p in [(10, 4), (16, 6), (7, 3), (20, 10)]:
        tokens = [rng.randrange(vocab) for _ in range(n)]
        batch.append(dict(tokens=tokens, prompt_len=p, advantage=rng.uniform(-1, 1), old_logp=[-6.0] * (n - p)))
    return sequences, batch


def read_tensors(path) -> dict[str, torch.Tensor]:
    with open_tensors(path) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_tiny_model_loads_with_every_feature(tiny_glm):
    from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm

    hf = hf_config(tiny_glm)
    assert (hf["model_type"], hf["first_k_dense_replace"], hf["n_group"], hf["topk_group"], hf["n_shared_experts"],
            hf["n_routed_experts"], hf["num_experts_per_tok"], hf["num_nextn_predict_layers"]) == (
        "glm4_moe", 1, 2, 1, 1, 8, 2, 0)
    assert hf["rope_parameters"]["partial_rotary_factor"] == 0.5 and hf["head_dim"] == 32
    model = load_hf(tiny_glm)
    assert [type(layer.mlp) for layer in model.model.layers] == [hf_glm.Glm4MoeMLP] + [hf_glm.Glm4MoeMoE] * 3
    attn = model.model.layers[1].self_attn
    assert attn.use_qk_norm and (attn.q_norm.weight != 1).all() and (attn.k_norm.weight != 1).all()
    assert all(getattr(attn, p).bias.abs().min() > 0 for p in ("q_proj", "k_proj", "v_proj"))
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    assert model.model.rotary_emb.inv_freq.numel() == 8  # 16 rotary dims of 32


def test_spec_reads_the_config(tiny_glm):
    hf = hf_config(tiny_glm)
    spec = family_for(hf).spec(hf)
    assert spec.moe_layers == (False, True, True, True) and spec.num_moe_layers == 3
    assert (spec.qkv_bias, spec.qk_norm, spec.rotary_percent, spec.head_dim) == (True, True, 0.5, 32)
    assert (spec.router_score, spec.router_expert_bias, spec.router_groups, spec.router_group_topk) == ("sigmoid", True, 2, 1)
    assert spec.router_scaling == hf["routed_scaling_factor"] and spec.mla is None
    assert spec.shared_expert_ffn == hf["n_shared_experts"] * hf["moe_intermediate_size"]
    assert spec.ffn_hidden_size == hf["intermediate_size"] and spec.moe_ffn_hidden_size == hf["moe_intermediate_size"]


def test_glm45_own_config_reads():
    """GLM-4.5's config.json (partial_rotary_factor at the top level, transformers 4.x style) is accepted."""
    spec = family_for(GLM45).spec(GLM45)
    assert (spec.rotary_percent, spec.qkv_bias, spec.qk_norm, spec.num_kv_heads, spec.head_dim) == (0.5, True, True, 8, 128)
    assert spec.moe_layers == (False,) * 3 + (True,) * 89 and spec.router_groups == 0
    assert (spec.num_experts, spec.topk, spec.router_scaling, spec.rope_theta) == (160, 8, 2.5, 1e6)


@pytest.mark.parametrize("change", ["expert_bias", "qkv_bias", "qk_norm", "partial_rotary"])
def test_each_feature_changes_the_reference(tiny_glm, change):
    """Without each feature transformers' log-probs move: a learner that left the expert bias or a q/k/v bias at
    zero, the q/k norms at one, or rotated every dim, fails the parity tests below."""
    sequences, _ = make_data(hf_config(tiny_glm)["vocab_size"])
    model = load_hf(tiny_glm)
    full = reference_logprobs(model, sequences)
    if change == "partial_rotary":
        model = load_hf(tiny_glm, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 1.0})
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if change == "expert_bias" and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
            elif change == "qkv_bias":
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.zero_()
            elif change == "qk_norm":
                attn.q_norm.weight.fill_(1.0)
                attn.k_norm.weight.fill_(1.0)
    assert max_diff(reference_logprobs(model, sequences), full) > 1e-3


@pytest.fixture(scope="module")
def layout_runs(tiny_glm, tmp_path_factory):
    """{f"moe/{layout}/alltoall": {"logprobs", "weights" (after one REINFORCE step), ...}} for every layout."""
    tmp = tmp_path_factory.mktemp("glm_layouts")
    sequences, batch = make_data(hf_config(tiny_glm)["vocab_size"])
    base = dict(models={"moe": str(tiny_glm)}, sequences=sequences, batch=batch, optim=OPTIM, micro_batch_tokens=24,
                row_tokens=1, objective="reinforce", loss_agg="token-mean", dispatchers=["alltoall"])
    results = {}
    for world, layouts in LAYOUTS.items():
        (tmp / f"spec{world}.json").write_text(json.dumps(dict(base, layouts=layouts)))
        out = tmp / f"results{world}.pt"
        rc = run_torchrun([str(SCRIPT), "--spec", str(tmp / f"spec{world}.json"), "--out", str(out)], world,
                          timeout_s=600)
        assert rc == 0, f"world {world}: exit {rc}"
        results.update(torch.load(out, weights_only=False))
    return dict(results=results, sequences=sequences, hf=load_hf(tiny_glm))


def layout_key(layout: dict) -> str:
    return "moe/" + "_".join(f"{k}{v}" for k, v in layout.items()) + "/alltoall"


ALL_LAYOUTS = [layout_key(lay) for lays in LAYOUTS.values() for lay in lays]


@pytest.mark.parametrize("key", ALL_LAYOUTS)
def test_learner_logprobs_match_transformers(layout_runs, key):
    ref = reference_logprobs(layout_runs["hf"], layout_runs["sequences"])
    got = layout_runs["results"][key]["logprobs"]
    assert [len(g) for g in got] == [len(r) for r in ref]
    assert max_diff(got, ref) < 1e-4


@pytest.mark.parametrize("key", ALL_LAYOUTS[1:])
def test_one_step_equals_tp1(tiny_glm, layout_runs, key):
    hf = read_tensors(Path(tiny_glm) / "model.safetensors")
    one, other = layout_runs["results"][TP1]["weights"], layout_runs["results"][key]["weights"]
    assert sorted(one) == sorted(other) == sorted(hf)
    assert max((one[k] - hf[k]).abs().max().item() for k in hf) > 1e-2  # the step is large enough to show errors
    for name in hf:
        err = (other[name] - one[name]).abs().max().item()
        assert err < 1e-6, f"{name}: max |{key} - TP1| after the step = {err:.2e}"


def test_the_step_trains_biases_and_norms_and_keeps_the_expert_bias(tiny_glm, layout_runs):
    hf = read_tensors(Path(tiny_glm) / "model.safetensors")
    one = layout_runs["results"][TP1]["weights"]
    for name in ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_norm.weight",
                 "model.layers.1.mlp.gate.weight"):
        assert not torch.equal(one[name], hf[name]), name
    for results in layout_runs["results"].values():  # no aux-loss-free balancing updates during RL
        assert torch.equal(results["weights"][BIAS], hf[BIAS])


@pytest.mark.parametrize("change, words", [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3}),
     ["partial_rotary_factor=0.3", "head_dim=32"]),
    (dict(partial_rotary_factor=0.25), ["partial_rotary_factor=0.25", "disagree"]),
    (dict(num_experts_per_tok=4), ["num_experts_per_tok=4", "topk_group=1", "top-2"]),
    (dict(norm_topk_prob=False), ["norm_topk_prob"]),
    (dict(num_experts_per_tok=1, n_group=1, topk_group=1), ["num_experts_per_tok=1", "norm_topk_prob=true"]),
    (dict(n_group=3), ["n_group=3", "n_routed_experts=8"]),
    (dict(hidden_act="gelu"), ["hidden_act"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), ["yarn"]),
], ids=["odd_rotary_dims", "two_rotary_factors", "group_topk", "norm_topk_prob", "top1_norm", "groups", "gelu", "yarn"])
def test_configs_it_would_compute_differently_are_refused(tiny_glm, change, words):
    hf = {**copy.deepcopy(hf_config(tiny_glm)), **change}
    with pytest.raises(ConfigError) as err:
        family_for(hf).spec(hf)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_expected_hf_tensors_are_the_files(tiny_glm):
    """The tensor names and shapes `megapo train` checks model.path against (convert.support.expected_hf_tensors:
    q/k/v biases, q/k norms, a dense first layer, router, expert bias, shared and routed experts)."""
    from megapo.convert.support import expected_hf_tensors

    hf = hf_config(tiny_glm)
    family = family_for(hf)
    written = {name: tuple(t.shape) for name, t in read_tensors(Path(tiny_glm) / "model.safetensors").items()}
    assert expected_hf_tensors(family, family.spec(hf)) == written
