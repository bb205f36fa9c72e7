"""Routing replay on the real Megatron-core learner vs a Hugging Face forward with forced routing.

One torchrun launch (4 processes) of tests/distributed/replay_layouts.py runs TP=1 (x DP4), TP=2,
PP=2 (with full activation recompute, so training replays through the recompute FIFO under 1F1B; routes handed
out as the trainer does, so ranks other than 0 replay their stage's route columns only),
EP=2 (allgather dispatcher: rows padded to one width) and TP=2xEP=2, on a copy of the tiny Qwen3-MoE
whose router rows are permuted, so that its own routing differs from the replayed routes. Routes to
replay come from transformers' own routing of the unperturbed model (independent of the learner).
The main learner packs one sequence per row; a second one packs [rows x width] micro-batches (several
sequences per row, several rows per micro-batch), which must replay, report and differentiate the same.
The TP=2xEP=2 layout also runs an on-policy step without the old-log-prob pass against one with it (r2
and r3, real GSPO objective).

The reference written here: transformers' Qwen3-MoE forward with each layer's router output
replaced by the forced experts, gate weights = softmax over all experts gathered at those experts,
renormalised (norm_topk_prob) - and, where no route is forced, transformers' own top-k.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapo.launch.local import run_torchrun
from megapo.replay.routes import load_routes, save_routes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "replay_layouts.py"
OPTIM = dict(lr=0.02, grad_clip=0.0)
LAYOUTS = [
    dict(tp=1, pp=1, ep=1, dp=4),
    dict(tp=2, pp=1, ep=1, dp=2),
    dict(tp=1, pp=2, ep=1, dp=2, recompute=True),
    dict(tp=1, pp=1, ep=2, dp=4, dispatcher="allgather"),
    dict(tp=2, pp=1, ep=2, dp=2, r2=True, r3=True, on_policy=True),
]
R2R3 = "tp2_pp1_ep2_dp2_r2True_r3True_on_policyTrue"
PP2 = "tp1_pp2_ep1_dp2_recomputeTrue"
TOL = 1e-4


# ----------------------------------------------------------------------------- reference


def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_forced(model, tokens, routes=None, own=None):
    """log p(tokens[t] | tokens[:t]) for t >= 1 and the experts used [n, L, k], forcing `routes`
    ([m, L, k], entries < 0 = not forced) and letting transformers' router choose elsewhere.
    `own` (a dict): filled with the router's own top-k per layer, before forcing."""
    chosen = {}
    handles = []
    for layer_index, layer in enumerate(model.model.layers):
        def hook(gate, args, out, layer_index=layer_index):
            logits, _, idx = out
            if own is not None:
                own[layer_index] = idx.detach().clone()
            idx = idx.clone()
            if routes is not None and len(routes):
                forced = torch.as_tensor(np.asarray(routes)[:, layer_index], dtype=torch.long)
                known = (forced >= 0).all(-1)
                idx[: len(forced)][known] = forced[known]
            weights = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            chosen[layer_index] = idx.detach()
            return logits, weights.to(logits.dtype), idx
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        logits = model(torch.tensor([tokens])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return logp, torch.stack([chosen[i] for i in range(len(chosen))], dim=1)


def set_mismatch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[..., k] top-k sets: True where they differ."""
    return (np.sort(a, -1) != np.sort(b, -1)).any(-1)


# ----------------------------------------------------------------------------- data


def perturb_router(src: Path, dst: Path) -> Path:
    """Copy an HF folder, permuting the rows (experts) of every router weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("mlp.gate.weight"):
                perm = torch.roll(torch.arange(t.shape[0]), 3)
                tensors[name] = t[perm].clone() * 1.5
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def setup(tiny_moe, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    perturbed = perturb_router(Path(tiny_moe), tmp / "perturbed")
    rng = random.Random(0)
    sequences = [[rng.randrange(512) for _ in range(n)] for n in (17, 9, 23, 5, 12)]
    batch = []
    for n, p in [(10, 4), (16, 6), (7, 3), (20, 10), (5, 2)]:
        tokens = [rng.randrange(512) for _ in range(n)]
        batch.append(dict(tokens=tokens, prompt_len=p, advantage=rng.uniform(-1, 1), old_logp=[-6.0] * (n - p)))
    base = hf_model(tiny_moe)
    with torch.no_grad():
        full = [hf_forced(base, s)[1][:-1].numpy().astype(np.int32) for s in sequences]
        batch_routes = [hf_forced(base, s["tokens"])[1][:-1].numpy().astype(np.int32) for s in batch]
    partial = {1: full[1][:4], 2: full[2].copy(), 3: full[3], 4: full[4].copy()}  # 0: no routes at all
    partial[2][::2, 1] = -1  # every other position of layer 1 unknown
    partial[4][5:, 0, :] = -1
    paths = {k: tmp / f"{k}.npz" for k in ("full", "partial", "batch")}
    save_routes(paths["full"], full)
    save_routes(paths["batch"], batch_routes)
    np.savez(paths["partial"], **{str(i): r for i, r in partial.items()})
    engine_samples = engine_rollouts(tiny_moe)
    spec = dict(model=str(perturbed), sequences=sequences, batch=batch, optim=OPTIM, micro_batch_tokens=24,
                row_tokens=1, rows_variant=dict(row_tokens=32, micro_batch_tokens=4096),
                on_policy=dict(micro_batch_tokens=48, objective="gspo", loss_agg="seq-mean-token-mean"),
                layouts=LAYOUTS, work_dir=str(tmp), full_npz=str(paths["full"]),
                partial_npz=str(paths["partial"]), batch_npz=str(paths["batch"]), engine_samples=engine_samples)
    spec_path, out = tmp / "spec.json", tmp / "out.pt"
    spec_path.write_text(json.dumps(spec))
    rc = run_torchrun([str(SCRIPT), "--spec", str(spec_path), "--out", str(out)], 4, timeout_s=900)
    assert rc == 0, f"torchrun exit code {rc}"
    results = torch.load(out, weights_only=False)
    model = hf_model(perturbed)
    return dict(results=results, sequences=sequences, batch=batch, full=full, batch_routes=batch_routes,
                partial=load_routes(paths["partial"], len(sequences)), model=model, perturbed=perturbed,
                engine_samples=engine_samples, paths=paths, tmp=tmp)


def engine_rollouts(model_dir) -> list[dict]:
    """R3: samples from the embedded engine (unperturbed weights) with their routes."""
    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_dir)
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 8, 3)]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=7, return_routes=True, seed=3))
    engine.close()
    samples = []
    for group in out:
        for s in group:
            samples.append(dict(tokens=s.prompt_ids + s.output_ids, prompt_len=len(s.prompt_ids),
                                advantage=1.0, old_logp=list(s.logprobs), rollout_logp=list(s.logprobs),
                                routes=s.routes.tolist()))
    return samples


def layouts():
    return ["_".join(f"{k}{v}" for k, v in layout.items()) for layout in LAYOUTS]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", layouts())
def test_replayed_routes_are_the_routes_reported(setup, layout):
    res = setup["results"][layout]
    global_list, hooked, moe_layers_here = res["instances"]
    assert global_list == hooked == moe_layers_here > 0
    out = res["full"]["routes_out"]
    for i, (given, used) in enumerate(zip(setup["full"], out)):
        assert used.shape == given.shape, i
        np.testing.assert_array_equal(used, given, err_msg=f"sequence {i}")
    assert res["metrics"]["replay/disagree_post"] == 0.0


@pytest.mark.parametrize("layout", layouts())
def test_replay_differs_from_own_routing_of_perturbed_router(setup, layout):
    """The replayed routes are not what this router would choose: its own choice (recorded with no
    routes) agrees with transformers' own routing of the perturbed model and differs from the routes."""
    res = setup["results"][layout]
    differ = np.concatenate([set_mismatch(f, g).ravel() for f, g in zip(res["free"], setup["full"])])
    assert differ.mean() > 0.3
    with torch.no_grad():
        hf_free = [hf_forced(setup["model"], s)[1][:-1].numpy() for s in setup["sequences"]]
    same = np.concatenate([~set_mismatch(f, h).ravel() for f, h in zip(res["free"], hf_free)])
    assert same.mean() > 0.98



@pytest.mark.parametrize("layout", layouts())
def test_disagreement_metric_per_layer(setup, layout):
    """replay/disagree_pre/layerL: the router's own top-k (on the hidden states of the replayed pass)
    vs the replayed routes, over all positions; reference: transformers' router inside the forced forward."""
    metrics = setup["results"][layout]["metrics"]
    differ = {0: [], 1: []}
    with torch.no_grad():
        for s, given in zip(setup["sequences"], setup["full"]):
            own = {}
            hf_forced(setup["model"], s, given, own=own)
            for layer in differ:
                differ[layer].append(set_mismatch(own[layer][:-1].numpy(), given[:, layer]))
    total = []
    for layer, parts in differ.items():
        frac = np.concatenate(parts).mean()
        total.append(frac)
        assert metrics[f"replay/disagree_pre/layer{layer}"] == pytest.approx(frac, abs=0.01)
    assert metrics["replay/disagree_pre"] == pytest.approx(np.mean(total), abs=0.01)
    assert metrics["replay/disagree_post"] == 0.0 and metrics["replay/fallback_frac"] == 0.0


@pytest.mark.parametrize("layout", layouts())
def test_replayed_logprobs_match_forced_routing_forward(setup, layout):
    res = setup["results"][layout]
    with torch.no_grad():
        for i, s in enumerate(setup["sequences"]):
            ref, _ = hf_forced(setup["model"], s, setup["full"][i])
            err = (res["full"]["logprobs"][i] - ref).abs().max().item()
            assert err < TOL, f"sequence {i}: {err}"


@pytest.mark.parametrize("layout", layouts())
def test_partial_routes_fall_back_to_own_choice(setup, layout):
    res = setup["results"][layout]["partial"]
    for i, s in enumerate(setup["sequences"]):
        given = setup["partial"][i]
        with torch.no_grad():
            ref, chosen = hf_forced(setup["model"], s, given)
        err = (res["logprobs"][i] - ref).abs().max().item()
        assert err < TOL, f"sequence {i}: {err}"
        used = res["routes_out"][i]
        assert used.shape == (len(s) - 1, 2, 2)
        forced = np.zeros(used.shape[:2], dtype=bool)
        if given is not None:
            known = (given >= 0).all(-1)
            forced[: len(given)] = known
            np.testing.assert_array_equal(used[: len(given)][known], given[known])
        fallback = ~forced
        if fallback.any():  # transformers' own choice on the same (partially forced) hidden states
            assert not set_mismatch(used[fallback], chosen[:-1].numpy()[fallback]).any(), f"sequence {i}"


@pytest.mark.parametrize("layout", layouts())
def test_router_gradients_under_replay_match_forced_routing(setup, layout):
    """One train step replaying the batch's routes with loss -(adv*logp).sum()/N: the router weights'
    gradients equal transformers' autograd gradients through the forced gates."""
    res = setup["results"][layout]["train"]
    model = setup["model"]
    model.zero_grad()
    batch = setup["batch"]
    total = sum(len(s["tokens"]) - s["prompt_len"] for s in batch)
    loss = 0.0
    for s, routes in zip(batch, setup["batch_routes"]):
        logp, _ = hf_forced(model, s["tokens"], routes)
        loss = loss - s["advantage"] * logp[s["prompt_len"] - 1:].sum() / total
    loss.backward()
    for layer, grad in res["grads"].items():
        ref = model.model.layers[layer].mlp.gate.weight.grad
        assert ref.norm() > 1e-4  # the router does get a gradient through the replayed gates
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6)
    for used, given in zip(res["routes"], setup["batch_routes"]):
        np.testing.assert_array_equal(used, given)
    assert res["metrics"]["replay/disagree_post"] == 0.0
    assert res["metrics"]["replay/fallback_frac"] == 0.0


def test_pp2_ranks_receive_only_their_stages_columns(setup):
    """PP=2: routes handed out as the trainer hands out a train batch (megapo.trainer.handout). Rank 0 keeps every
    MoE layer, every other rank receives only its stage's column (the tiny model's 2 MoE layers, one per stage),
    and its hook replays them as such; log-probs equal the forced-routing reference and the full-route pass, and
    the train step replaying the cut routes gives the reference's router gradients
    (test_router_gradients_under_replay_match_forced_routing)."""
    res = setup["results"][PP2]
    layers = res["stage"]["rank_layers"]
    assert len(layers) == 4 and sorted({tuple(x) for x in layers}) == [(0,), (1,)]
    for case, full in (("stage", setup["full"]), ("train", setup["batch_routes"])):
        for rank, (got, width) in enumerate(zip(res[case]["received"], res[case]["columns"])):
            assert width == (2 if rank == 0 else 1), (case, rank)
            for i, (a, f) in enumerate(zip(got, full)):
                want = f if rank == 0 else f[:, layers[rank]]
                assert a.shape == want.shape, (case, rank, i)
                np.testing.assert_array_equal(a, want, err_msg=f"{case}, rank {rank}, sequence {i}")
    stage = res["stage"]
    with torch.no_grad():
        for i, s in enumerate(setup["sequences"]):
            ref, _ = hf_forced(setup["model"], s, setup["full"][i])
            assert (stage["logprobs"][i] - ref).abs().max().item() < TOL, i
            assert (stage["logprobs"][i] - res["full"]["logprobs"][i]).abs().max().item() < 1e-6, i
            np.testing.assert_array_equal(stage["routes_out"][i], setup["full"][i])
    assert stage["metrics"] == pytest.approx(res["metrics"], abs=1e-9)
    # PP=1: one broadcast, every rank replays every MoE layer
    one = setup["results"]["tp2_pp1_ep1_dp2"]
    assert one["stage"]["rank_layers"] is None and one["train"]["columns"] == [2, 2, 2, 2]


def test_r2_two_optimizer_steps_replay_the_old_logprob_routing(setup):
    res = setup["results"][R2R3]["r2"]
    old = res["old_routes"]
    for step in res["steps"]:
        for a, b in zip(step["routes"], old):
            np.testing.assert_array_equal(a, b)
        assert step["metrics"]["replay/disagree_post"] == 0.0
    # without replay the updated router would route differently: the replay is doing something
    differ = np.concatenate([set_mismatch(f, o).ravel() for f, o in zip(res["free_after"], old)])
    assert differ.mean() > 0
    assert res["steps"][1]["metrics"]["replay/disagree_pre"] > 0


def test_r3_engine_routes_replayed_end_to_end(setup):
    res = setup["results"][R2R3]["r3"]
    engine = [np.asarray(s["routes"]) for s in setup["engine_samples"]]
    for e, old, train in zip(engine, res["old_routes"], res["train_routes"]):
        np.testing.assert_array_equal(old, e)
        np.testing.assert_array_equal(train, e)
    assert res["old_metrics"]["replay/disagree_pre"] > 0.3  # the perturbed router disagrees with the engine
    assert res["old_metrics"]["replay/disagree_post"] == 0.0
    assert res["train_metrics"]["replay/disagree_post"] == 0.0
    forced, free, rollout = [], [], []
    with torch.no_grad():
        for s, lp in zip(setup["engine_samples"], res["old_logp"]):
            ref, _ = hf_forced(setup["model"], s["tokens"], np.asarray(s["routes"]))
            assert (lp - ref[s["prompt_len"] - 1:]).abs().max().item() < TOL
            forced.append(ref[s["prompt_len"] - 1:])
            free.append(hf_forced(setup["model"], s["tokens"])[0][s["prompt_len"] - 1:])
            rollout.append(torch.tensor(s["rollout_logp"]))
    rollout = torch.cat(rollout)

    def k3(logp):  # KL(rollout || learner) estimated on rollout samples: r - 1 - log r, r = p/q
        log_r = torch.cat(logp) - rollout
        return float((log_r.exp() - 1 - log_r).mean())

    assert res["kl"]["replay/kl_k3"] == pytest.approx(k3(forced), rel=1e-3, abs=1e-6)
    assert res["kl"]["replay/kl_k3_free"] == pytest.approx(k3(free), rel=1e-3, abs=1e-6)
    assert res["kl"]["replay/kl_k3"] != pytest.approx(res["kl"]["replay/kl_k3_free"], rel=1e-2)


@pytest.mark.parametrize("layout", layouts())
def test_rows_x_width_packing_replays_like_one_sequence_per_row(setup, layout):
    """[rows x width] micro-batches (routers see [width, rows] flattened, sliced over TP) vs one sequence per
    row: the replayed log-probs, the routes reported and the router gradients of the replayed step."""
    res = setup["results"][layout]
    rows, one = res["rows"], res["full"]
    for i, (a, b) in enumerate(zip(rows["logprobs"], one["logprobs"])):
        err = (a - b).abs().max().item()
        assert err < 1e-6, f"sequence {i}: {err:.2e}"
    for used, given in zip(rows["routes_out"], setup["full"]):
        np.testing.assert_array_equal(used, given)
    for layer, grad in res["train"]["grads"].items():
        got = rows["train"]["grads"][layer]
        assert float((got - grad).norm() / grad.norm()) < 1e-6, layer
    for used, given in zip(rows["train"]["routes"], setup["batch_routes"]):
        np.testing.assert_array_equal(used, given)
    assert rows["train"]["metrics"]["replay/disagree_post"] == 0.0


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_on_policy_step_without_old_pass_under_tp2_ep2(setup, mode):
    """TP=2 x EP=2 x DP=2: the on-policy step on the train forward's own π_old (r3: the engine's routes
    replayed in it) updates the weights and reports the metrics of the two-pass step."""
    runs = setup["results"][R2R3]["on_policy"]
    two, one = runs[f"{mode}/two_passes"], runs[f"{mode}/one_pass"]
    for name, ref in two["weights"].items():
        err = (one["weights"][name] - ref).abs().max().item()
        assert err < 1e-6, f"{name}: {err:.2e}"
    expected = {k: v for k, v in two["metrics"].items() if k not in ("train/step_time_s", "train/tokens_per_s")}
    assert set(expected) <= set(one["metrics"])
    for key, value in expected.items():
        assert one["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    if mode == "r3":  # the perturbed router disagrees with the engine's routes
        assert expected["replay/disagree_pre"] > 0.3 and expected["train/replay/disagree_pre"] > 0.3


def test_logprobs_command_routes_in_out(setup):
    """The real command line, single process: --routes-in replayed, --routes-out reports them."""
    tmp = setup["tmp"]
    inp, out, routes_out = tmp / "cli_in.jsonl", tmp / "cli_out.jsonl", tmp / "cli_routes.npz"
    inp.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in setup["sequences"]))
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(setup["perturbed"]), "--input", str(inp),
           "--output", str(out), "--routes-in", str(setup["paths"]["full"]), "--routes-out", str(routes_out),
           "--micro-batch-tokens", "24"]
    assert subprocess.run(cmd, cwd=ROOT, timeout=600).returncode == 0
    used = load_routes(routes_out, len(setup["sequences"]))
    lines = [json.loads(x)["logprobs"] for x in out.read_text().splitlines()]
    with torch.no_grad():
        for i, s in enumerate(setup["sequences"]):
            np.testing.assert_array_equal(used[i], setup["full"][i])
            ref, _ = hf_forced(setup["model"], s, setup["full"][i])
            assert (torch.tensor(lines[i]) - ref).abs().max().item() < TOL
