"""The DeepSeek-V3 family (megapo/models/deepseek_v3): its tiny model, its ModelSpec, `megapo logprobs`
against transformers' fp32 forward on the same weights under TP=1, PP=2, EP=2 (x DP=2) and TP=2xEP=2,
the learner's export right after loading vs the HF file (expert bias included), one optimizer step under
TP=2xEP=2 vs TP=1 (tests/distributed/deepseek_v3_step.py), and the config.json values the Megatron model
would compute differently, refused by name.

The tiny model has MLA with low ranks, a dense first layer, 8 experts in 2 routing groups of which a
token may use 1, one shared expert, a routed scaling factor and a non-zero router expert bias (a buffer,
not a parameter): the parity tests see whether that bias is loaded because it changes the reference
(checked here too)."""

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
from megapo.launch.local import run_torchrun
from megapo.models.family import family_for
from megapo.weights.safetensors_io import open_tensors

ROOT = Path(__file__).resolve().parents[1]
STEP_SCRIPT = ROOT / "tests" / "distributed" / "deepseek_v3_step.py"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def tiny_ds(tiny_model_factory):
    return tiny_model_factory("deepseek_v3", moe_ffn=32)


def hf_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def load_hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def reference_logprobs(model, sequences):
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0, :-1], -1)
                .gather(-1, torch.tensor(s[1:])[:, None])[:, 0] for s in sequences]


def write_input(path: Path, vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 2, 11)]
    path.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    return sequences


def test_tiny_model_loads_with_every_feature(tiny_ds):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

    hf = hf_config(tiny_ds)
    assert (hf["model_type"], hf["first_k_dense_replace"], hf["n_group"], hf["topk_group"], hf["n_shared_experts"],
            hf["n_routed_experts"], hf["num_experts_per_tok"]) == ("deepseek_v3", 1, 2, 1, 1, 8, 2)
    assert hf["q_lora_rank"] < hf["hidden_size"] and hf["kv_lora_rank"] < hf["hidden_size"]
    model = load_hf(tiny_ds)
    first, second = model.model.layers
    assert type(first.mlp) is hf_ds.DeepseekV3MLP and type(second.mlp) is hf_ds.DeepseekV3MoE
    assert second.mlp.gate.e_score_correction_bias.abs().min() > 0


def test_spec_reads_the_config(tiny_ds):
    hf = hf_config(tiny_ds)
    spec = family_for(hf).spec(hf)
    assert spec.moe_layers == (False, True) and spec.num_moe_layers == 1
    assert (spec.router_score, spec.router_expert_bias, spec.router_groups, spec.router_group_topk) == ("sigmoid", True, 2, 1)
    assert spec.router_scaling == hf["routed_scaling_factor"]
    assert spec.shared_expert_ffn == hf["n_shared_experts"] * hf["moe_intermediate_size"]
    assert spec.ffn_hidden_size == hf["intermediate_size"] and spec.moe_ffn_hidden_size == hf["moe_intermediate_size"]
    mla = spec.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        hf["q_lora_rank"], hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"])
    assert spec.head_dim == hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]


def test_expert_bias_changes_the_reference(tiny_ds, tmp_path):
    """Without the bias the routing (and so the log-probs) differ: a loader that left Megatron's expert_bias
    buffer at zero fails the parity tests below."""
    sequences = write_input(tmp_path / "in.jsonl", hf_config(tiny_ds)["vocab_size"])
    model = load_hf(tiny_ds)
    with_bias = reference_logprobs(model, sequences)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    without = reference_logprobs(model, sequences)
    assert max((a - b).abs().max().item() for a, b in zip(with_bias, without)) > 1e-3


@pytest.mark.parametrize("layout", [
    [],
    ["--pp", "2"],  # stage 0 the dense layer, stage 1 the MoE layer
    ["--ep", "2", "--dp", "2"],
    ["--tp", "2", "--ep", "2", "--dispatcher", "allgather"],
], ids=["tp1", "pp2", "ep2xdp2", "tp2xep2-allgather"])
def test_logprobs_command_matches_transformers(tiny_ds, tmp_path, layout):
    sequences = write_input(tmp_path / "in.jsonl", hf_config(tiny_ds)["vocab_size"])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(tiny_ds), "--input", str(tmp_path / "in.jsonl"),
           "--output", str(out), "--micro-batch-tokens", "20", "--timeout", "300", *layout]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    ref = reference_logprobs(load_hf(tiny_ds), sequences)
    assert [len(g) for g in got] == [len(s) - 1 for s in sequences]
    assert max((torch.tensor(g) - r).abs().max().item() for g, r in zip(got, ref)) < 1e-4


@pytest.mark.parametrize("change, words", [
    (dict(rope_interleave=False), ["rope_interleave"]),
    (dict(num_experts_per_tok=4), ["num_experts_per_tok=4", "topk_group=1", "top-2"]),
    (dict(norm_topk_prob=False), ["norm_topk_prob"]),
    (dict(num_experts_per_tok=1, n_group=1, topk_group=1), ["num_experts_per_tok=1", "norm_topk_prob=true"]),
    (dict(scoring_func="softmax"), ["scoring_func"]),
    (dict(attention_bias=True), ["attention_bias"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}), ["yarn"]),
], ids=["rope_interleave", "group_topk", "norm_topk_prob", "top1_norm", "scoring_func", "attention_bias", "yarn"])
def test_configs_it_would_compute_differently_are_refused(tiny_ds, change, words):
    hf = {**copy.deepcopy(hf_config(tiny_ds)), **change}
    with pytest.raises(ConfigError) as err:
        family_for(hf).spec(hf)
    assert all(w in str(err.value) for w in words), str(err.value)


def read_tensors(path) -> dict[str, torch.Tensor]:
    with open_tensors(path) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def step_runs(tiny_ds, tmp_path_factory):
    """{layout: {"loaded": tensors exported right after loading, "stepped": after one REINFORCE step}}."""
    tmp = tmp_path_factory.mktemp("ds_step")
    rng = random.Random(0)
    batch = [dict(tokens=[rng.randrange(512) for _ in range(n)], prompt_len=p, advantage=rng.uniform(-1, 1),
                  old_logp=[-6.0] * (n - p)) for n, p in [(10, 4), (16, 6), (7, 3), (20, 10)]]
    (tmp / "batch.json").write_text(json.dumps(batch))
    args = [str(STEP_SCRIPT), "--model", str(tiny_ds), "--batch", str(tmp / "batch.json")]
    proc = subprocess.run([sys.executable, *args, "--out", str(tmp / "tp1")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_torchrun([*args, "--out", str(tmp / "tp2xep2"), "--tp", "2", "--ep", "2"], 2, timeout_s=600) == 0
    return {name: {part: read_tensors(tmp / name / f"{part}.safetensors") for part in ("loaded", "stepped")}
            for name in ("tp1", "tp2xep2")}


@pytest.mark.parametrize("layout", ["tp1", "tp2xep2"])
def test_export_after_loading_equals_the_hf_file_expert_bias_included(tiny_ds, step_runs, layout):
    hf = read_tensors(Path(tiny_ds) / "model.safetensors")
    loaded = step_runs[layout]["loaded"]
    assert sorted(loaded) == sorted(hf)
    for name, ref in hf.items():
        assert torch.equal(loaded[name], ref), name


def test_one_step_tp2xep2_equals_tp1_and_keeps_the_expert_bias(tiny_ds, step_runs):
    hf = read_tensors(Path(tiny_ds) / "model.safetensors")
    one, four = step_runs["tp1"]["stepped"], step_runs["tp2xep2"]["stepped"]
    moved = max((one[k] - hf[k]).abs().max().item() for k in hf)
    assert moved > 1e-2  # the step is large enough to show a gradient error
    for name in hf:
        err = (four[name] - one[name]).abs().max().item()
        assert err < 1e-6, f"{name}: max |TP2xEP2 - TP1| after the step = {err:.2e}"
    # the router learns; its expert bias is kept (no aux-loss-free balancing updates during RL)
    assert not torch.equal(one["model.layers.1.mlp.gate.weight"], hf["model.layers.1.mlp.gate.weight"])
    assert torch.equal(one[BIAS], hf[BIAS]) and torch.equal(four[BIAS], hf[BIAS])



def test_expected_hf_tensors_are_the_files(tiny_ds, tiny_model_factory):
    """The tensor names and shapes `megapo train` checks model.path against (convert.support.expected_hf_tensors:
    MLA, a dense first layer, router, expert bias, shared and routed experts) are what transformers wrote."""
    from megapo.convert.support import expected_hf_tensors

    for folder in (tiny_ds, tiny_model_factory("deepseek_v3", layers=3, moe_ffn=32)):
        hf = hf_config(folder)
        family = family_for(hf)
        written = {name: tuple(t.shape) for name, t in read_tensors(Path(folder) / "model.safetensors").items()}
        assert expected_hf_tensors(family, family.spec(hf)) == written
