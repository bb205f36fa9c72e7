"""Checks shared by the MoE family tests (deepseek_v3, glm4_moe, gpt_oss): the tiny models the engine is compared
on, transformers' forward with its routers' choice recorded or forced, `megapo logprobs` / `train` run in a
subprocess, `megapo convert` through its own planner and runner, and the learner's checkpoint read without megapo
code. Imported by tests/test_family_engines.py,
tests/test_family_replay.py (the checks parametrized over families) and tests/test_<family>_*.py (each family's
own checks)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megapo.replay.routes import load_routes
from megapo.weights.safetensors_io import open_tensors

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # |engine or learner - transformers fp32| on log-probs and logits


# --- the engine's models and transformers' reference ---------------------------------------------------------------

@dataclass(frozen=True)
class EngineModel:
    """A tiny model the embedded engine is compared on: tiny_model_factory(family, **tiny), or a variant of it
    with `changes` written into its config and fresh weights (see write_variant)."""

    family: str
    tiny: dict
    moe_layers: int  # route columns
    changes: dict | None = None


ENGINE_MODELS = {
    # 3 layers (dense, MoE, MoE); q through the q_lora_rank bottleneck, 2 routing groups of which a token may use 1
    "deepseek_v3": EngineModel("deepseek_v3", dict(layers=3, moe_ffn=32), 2),
    # without the q bottleneck (q_proj) and without group-limited routing
    "deepseek_v3-q_proj_one_group": EngineModel("deepseek_v3", dict(layers=3, moe_ffn=32), 2,
                                                dict(q_lora_rank=None, n_group=1, topk_group=1)),
    # 4 layers (dense, then 3 MoE); q/k/v biases, q/k norms, partial rotary 0.5, 2 routing groups of which 1 used
    "glm4_moe": EngineModel("glm4_moe", dict(layers=4, moe_ffn=32), 3),
    # a quarter of each head rotary, no q/k norm, no attention bias, no group limit
    "glm4_moe-quarter_rotary_plain": EngineModel(
        "glm4_moe", dict(layers=4, moe_ffn=32), 3,
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
             use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1)),
    # sliding window 4, then full attention; sinks, q/k/v/o, router and expert biases; clamped GLU
    "gpt_oss": EngineModel("gpt_oss", dict(moe_ffn=32), 2),
}


def write_variant(base: Path, out: Path, seed: int = 1, **changes) -> Path:
    """A copy of the tiny model's config with `changes`, fresh transformers weights and a random expert bias."""
    import transformers

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


def engine_model(name: str, tiny_model_factory, tmp_path_factory) -> Path:
    """The folder of ENGINE_MODELS[name] (a variant is written anew on each call)."""
    m = ENGINE_MODELS[name]
    base = Path(tiny_model_factory(m.family, **m.tiny))
    return base if m.changes is None else write_variant(base, tmp_path_factory.mktemp(name), **m.changes)


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def max_sample_dlogp(model, state: dict, samples) -> float:
    """The largest |engine log-prob − transformers' fp32 log-prob| over the response tokens of `samples` (engine
    Samples), `model` (a transformers causal LM) loaded with `state` first."""
    model.load_state_dict(state)
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.output_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            worst = max(worst, float((lp[len(s.prompt_ids) - 1:] - torch.tensor(s.logprobs)).abs().max()))
    return worst


def routers(hf) -> list:
    """The routers of a transformers model's MoE layers in layer order (DeepSeekMoE: mlp.gate, gpt-oss:
    mlp.router); each returns (logits, gates, top-k ids)."""
    return [layer.mlp.gate if hasattr(layer.mlp, "gate") else layer.mlp.router
            for layer in hf.model.layers if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")]


def hf_forward(hf, ids: torch.Tensor):
    """transformers' logits [B, T, V] and its routers' top-k [B, T, moe_layers, k]."""
    chosen = []
    handles = [r.register_forward_hook(lambda m, a, out: chosen.append(out[2])) for r in routers(hf)]
    try:
        with torch.no_grad():
            logits = hf(ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    return logits, torch.stack([c.view(*ids.shape, -1) for c in chosen], dim=2)


def hf_forced(model, tokens: list[int], gates, routes=None):
    """log p(tokens[t] | tokens[:t]) (t >= 1) and the experts used [n, moe_layers, k], forcing `routes`
    ([m, moe_layers, k]; a (position, layer) entry with a negative id is not forced: transformers' own top-k
    there). The forced experts' gates: gates(router, router_logits, ids), the family's own formula."""
    chosen, handles = {}, []
    for column, router in enumerate(routers(model)):
        def hook(router, args, out, column=column):
            logits, weights, idx = out
            if routes is not None and len(routes):
                forced = torch.as_tensor(np.asarray(routes)[:, column], dtype=torch.long)
                known = (forced >= 0).all(-1)
                idx = idx.clone()
                idx[: len(forced)][known] = forced[known]
                weights = gates(router, logits, idx)
            chosen[column] = idx.detach()
            return logits, weights, idx
        handles.append(router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return logp, torch.stack([chosen[c] for c in range(len(chosen))], dim=1)


def same_sets(a, b) -> np.ndarray:
    """Per position: the same experts in any order."""
    return (np.sort(np.asarray(a), -1) == np.sort(np.asarray(b), -1)).all(-1)


def engine_spec(model_dir: Path) -> tuple:
    """The engine's spec of a model folder, checked equal to the one it derives from the learner's ModelSpec,
    and the folder's config.json."""
    from megapo.engines.torch_lm import TorchLMSpec
    from megapo.models.family import family_for

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    spec = TorchLMSpec.from_config(hf)
    assert spec == TorchLMSpec.from_model_spec(family_for(hf).spec(hf))
    return spec, hf


# --- `megapo logprobs` with routes in and out (routing replay) -----------------------------------------------------

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


def replay_runs(model_dir, tmp: Path, layouts: dict[str, list[str]], moe_layers: int, gates,
                lengths=(5, 17, 2, 11, 9), experts: int = 8, topk: int = 2) -> dict:
    """`megapo logprobs` on random sequences: free (its own routes recorded), then under each layout with
    forced routes: sequence 0 its recorded routes; 1, 4 random experts; 2 none (missing key); 3 partial (every
    other position of the second MoE layer: the router's own choice). Also transformers' model and `gates`."""
    rng = random.Random(3)
    sequences = [[rng.randrange(512) for _ in range(n)] for n in lengths]
    (tmp / "in.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    free = logprobs_cmd(model_dir, tmp, "free", [], None)
    draw = np.random.default_rng(0)
    forced = {0: free["routes"][0], 1: random_routes(len(sequences[1]) - 1, moe_layers, experts, topk, draw),
              3: random_routes(len(sequences[3]) - 1, moe_layers, experts, topk, draw)[:7],
              4: random_routes(len(sequences[4]) - 1, moe_layers, experts, topk, draw)}
    forced[3][::2, 1] = -1
    np.savez(tmp / "forced_in.npz", **{str(i): r for i, r in forced.items()})
    out = dict(free=free, model_dir=model_dir, sequences=sequences, route_shape=(moe_layers, topk), gates=gates,
               forced=load_routes(tmp / "forced_in.npz", len(sequences)))
    for name, layout in layouts.items():
        out[name] = logprobs_cmd(model_dir, tmp, name, layout, tmp / "forced_in.npz")
    out["hf"] = hf_model(model_dir)
    return out


def check_free_routes_are_transformers_choice(runs):
    """The learner's own routes are transformers' choice (as sets) and its log-probs transformers'."""
    for i, seq in enumerate(runs["sequences"]):
        logp, used = hf_forced(runs["hf"], seq, runs["gates"])
        assert runs["free"]["routes"][i].shape == (len(seq) - 1, *runs["route_shape"])
        assert same_sets(runs["free"]["routes"][i], used[:-1].numpy()).all(), f"sequence {i}"
        assert (runs["free"]["logprobs"][i] - logp).abs().max().item() < TOL, f"sequence {i}"


def check_replayed_routes_come_back_exactly(runs, layout: str):
    """Given positions: the routes given, in their order; elsewhere: transformers' own choice (as a set)."""
    for i, (seq, given, used) in enumerate(zip(runs["sequences"], runs["forced"], runs[layout]["routes"])):
        assert used.shape == (len(seq) - 1, *runs["route_shape"]), i
        own = hf_forced(runs["hf"], seq, runs["gates"])[1][:-1].numpy()
        known = np.zeros(used.shape[:2], dtype=bool)
        if given is not None:
            known[: len(given)] = (given >= 0).all(-1)
            np.testing.assert_array_equal(used[: len(given)][known[: len(given)]],
                                          given[(given >= 0).all(-1)], err_msg=f"sequence {i}")
        assert same_sets(used[~known], own[~known]).all(), f"sequence {i}"
    np.testing.assert_array_equal(runs[layout]["routes"][0], runs["free"]["routes"][0])  # recorded -> replayed


def check_log_probs_with_routes_forced(runs, layout: str):
    """The learner's log-probs with the routes forced equal transformers' forced forward (hf_forced)."""
    moved = 0.0
    for i, (seq, given) in enumerate(zip(runs["sequences"], runs["forced"])):
        ref, _ = hf_forced(runs["hf"], seq, runs["gates"], given)
        got = runs[layout]["logprobs"][i]
        assert got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err < TOL, f"sequence {i}: max |learner - transformers forced| = {err:.2e}"
        moved = max(moved, (ref - hf_forced(runs["hf"], seq, runs["gates"])[0]).abs().max().item())
    assert moved > 1e-3  # the forced experts change the log-probs: a replay that ignored them would fail


# --- `megapo convert` ----------------------------------------------------------------------------------------------

def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files."""
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open_tensors(path) as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def read_checkpoint(folder: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Tensors of the learner's torch_dist checkpoint, read with torch.distributed.checkpoint (no megapo code)."""
    import torch.distributed.checkpoint as dcp

    out = {name: torch.empty(shape) for name, shape in shapes.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return out


def _to_megatron(source: Path, ckpt: Path) -> list[str]:
    return ["hf-to-megatron", "--hf", str(source), "--out", str(ckpt), "--tp", "2", "--ep", "2"]


def _to_hf(ckpt: Path, back: Path) -> list[str]:
    return ["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--pp", "2", "--verify"]


def convert_round_trips(sources: dict[str, Path], tmp_path_factory) -> dict[str, dict]:
    """HF -> torch_dist saved under TP=2xEP=2, back to HF loaded under PP=2 with --verify, for several models,
    through the command's own planner and runner (megapo.commands.convert, what `megapo convert` runs): every
    hf-to-megatron plan in one torchrun launch, every megatron-to-hf in a second.
    Each round trip's log holds what its plans printed after the workers (the checkpoint written, the verdict)."""
    import argparse
    import contextlib
    import io

    from megapo.commands import convert as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)

    def plan(planner, argv: list[str], log: io.StringIO):
        made = planner(parser.parse_args(argv), scratch)
        finish = made.finish

        def finish_into_log() -> bool:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                return finish()

        made.finish = finish_into_log
        return made

    def launch(plans: list) -> None:
        codes = command.run_plans(plans, timeout_s=600)
        assert codes == [0] * len(plans), [r["log"].getvalue()[-2000:] for r in trips.values()]

    scratch = tmp_path_factory.mktemp("convert_scratch")
    trips = {}
    for name, source in sources.items():
        tmp = tmp_path_factory.mktemp(f"{name}_convert")
        trips[name] = dict(source=source, ckpt=tmp / "ckpt", back=tmp / "hf", log=io.StringIO())
    launch([plan(command.plan_hf_to_megatron, _to_megatron(r["source"], r["ckpt"]), r["log"]) for r in trips.values()])
    launch([plan(command.plan_megatron_to_hf, _to_hf(r["ckpt"], r["back"]), r["log"]) for r in trips.values()])
    return {name: dict(r, log=r["log"].getvalue()) for name, r in trips.items()}


def check_round_trip_is_bit_exact(round_trip: dict) -> dict[str, torch.Tensor]:
    """Every source tensor comes back with torch.equal, --verify passed, the config is the source's; the source
    tensors, for the family's own checks."""
    src, back = read_tensors(round_trip["source"]), read_tensors(round_trip["back"])
    assert sorted(back) == sorted(src)
    for name, ref in src.items():
        assert back[name].dtype == ref.dtype and torch.equal(back[name], ref), name
    assert "verify OK" in round_trip["log"]
    assert json.loads((round_trip["back"] / "config.json").read_text()) == json.loads(
        (round_trip["source"] / "config.json").read_text())
    return src


def check_convert_refuses(source: Path, tmp_path: Path, capsys, change: dict, words: list[str]):
    """`megapo convert hf-to-megatron` on the source with `change` in its config: exit 2 naming `words`, and
    nothing written."""
    from megapo.cli import main as megapo_main

    hf = tmp_path / "hf"
    shutil.copytree(source, hf)
    config = {**json.loads((hf / "config.json").read_text()), **change}
    (hf / "config.json").write_text(json.dumps(config))
    code = megapo_main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and all(w in err for w in words), err
    assert not (tmp_path / "ckpt").exists()


# --- `megapo train` ------------------------------------------------------------------------------------------------

TRAIN_CONFIG = ROOT / "megapo/configs/tiny_moe_addition.yaml"


def train_r3(model: Path, tmp_path: Path, steps: int) -> Path:
    """`megapo train` with the embedded engine and R3 for `steps` RL steps in a subprocess, checkpoint at the
    last; its output folder. Its metrics checked: every replayed route used as given and given for every
    position, and from step 2 (samples from the weights the step before wrote) the learner's old log-probs the
    engine's."""
    (tmp_path / "e2e_parity_reward.py").write_text(
        "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megapo.cli", "train", str(TRAIN_CONFIG),
           f"model.path={model}", "sft.enabled=false", f"train.output_dir={out}", f"train.steps={steps}",
           f"train.eval_every={steps}", "train.eval_prompts=20", f"train.ckpt_every={steps}", "train.log=[jsonl]",
           "data.prompts_per_step=4", "rollout.n_samples=4", "data.dynamic_sampling=false",
           "data.reward=e2e_parity_reward:parity", "data.truncated_reward=null", "algorithm.routing_replay=r3",
           "optim.lr=0.01", "optim.warmup_steps=0"]  # a visible update, so a lost weight sync would show
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1))
    for r in rows[1:]:
        assert r["train/replay/disagree_post"] == 0.0  # routes used == routes given
        assert r["train/replay/fallback_frac"] == 0.0  # the engine gave a route for every position
        assert 0.0 <= r["reward"] <= 1.0 and r["response_len"] > 0
    for r in rows[2:]:  # samples drawn from the weights the step before wrote
        assert r["train/mismatch_max_abs_dlogp"] < 1e-3, r["step"]
        assert r["train/mismatch_k3"] < 1e-6, r["step"]
    assert rows[steps]["replay/kl_k3"] < 1e-6
    return out


def train_with_vllm_on_cpu(model: Path, tmp_path: Path, capsys) -> str:
    """`megapo train` with rollout.engine=vllm here (CPU): refused before anything starts (exit 2, the message
    naming rollout.engine, no output folder); the message."""
    from megapo.cli import main

    capsys.readouterr()  # (what writing the model printed)
    out = tmp_path / "run"
    code = main(["train", str(TRAIN_CONFIG), f"model.path={model}",
                 "sft.enabled=false", f"train.output_dir={out}", "rollout.engine=vllm", "rollout.weight_sync=disk",
                 "algorithm.routing_replay=r2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("megapo train: rollout.engine: vLLM"), err
    assert not out.exists()
    return err
