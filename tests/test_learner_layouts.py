"""The Megatron learner under every parallel layout vs Hugging Face transformers and vs TP=1.

Three launches (world 1, 2 and 4 processes) of tests/distributed/learner_layouts.py cover TP=2,
PP=2, EP=2 (x DP=2), TP=2xEP=2, PP=2xEP=2 (x DP=2), TP=2xPP=2xEP=2, DP=2 with the distributed
optimizer and TP=2 with full activation recompute, each with both MoE token dispatchers, for a tiny Qwen3-MoE and a tiny dense Qwen2 (the dense model runs each layout with ep=1).
Each run computes log-probs, takes one REINFORCE optimizer step and gathers the weights to HF names,
with one sequence per row (one row per micro-batch) and again with the batch packed into [rows x width]
micro-batches (several sequences per row, several rows per micro-batch; equal shapes under the
allgather dispatcher), which must give the same log-probs and gradients.

References: log-probs from transformers' fp32 forward; the TP=1 step from transformers' autograd
gradient of the REINFORCE loss written out here, put through Adam's first step by hand; every other
layout from the TP=1 run. Adam's eps is set huge (1e3, with lr 1e3) so that its first step is
lr*g/(|g|+eps) ~ g, linear in the gradient: a sign-only update would hide gradient errors.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_runs import run_layout_script  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "learner_layouts.py"
OPTIM = dict(lr=1000.0, adam_eps=1000.0, grad_clip=0.0)
LAYOUTS = {
    1: [dict(tp=1, pp=1, ep=1, dp=1)],
    2: [dict(tp=2, pp=1, ep=1, dp=1), dict(tp=1, pp=2, ep=1, dp=1), dict(tp=1, pp=1, ep=2, dp=2),
        dict(tp=2, pp=1, ep=2, dp=1, save=True), dict(tp=1, pp=1, ep=1, dp=2, distributed_optimizer=True),
        dict(tp=2, pp=1, ep=1, dp=1, recompute=True)],
    4: [dict(tp=1, pp=2, ep=2, dp=2), dict(tp=2, pp=2, ep=2, dp=1)],
}


# per-sequence mean: the share of each micro-batch must not depend on how the batch was split
AGG_VARIANTS = [dict(loss_agg="seq-mean-token-mean", micro_batch_tokens=24),
                dict(loss_agg="seq-mean-token-mean", micro_batch_tokens=4096)]


def make_data(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (7, 12, 3, 20, 9)]
    batch = []
    for n, p in [(10, 4), (16, 6), (7, 3), (20, 10), (5, 2)]:
        tokens = [rng.randrange(vocab) for _ in range(n)]
        batch.append(dict(tokens=tokens, prompt_len=p, advantage=rng.uniform(-1, 1), old_logp=[-6.0] * (n - p)))
    return sequences, batch


@pytest.fixture(scope="module")
def runs(tiny_moe, tiny_dense, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    sequences, batch = make_data(512)
    base = dict(models={"moe": str(tiny_moe), "dense": str(tiny_dense)}, sequences=sequences, batch=batch,
                optim=OPTIM, micro_batch_tokens=24, row_tokens=1, objective="reinforce", loss_agg="token-mean",
                rows_variant=dict(row_tokens=32, micro_batch_tokens=4096))
    ckpt = tmp / "ckpt"
    results = {}
    for world in (2, 1, 4):  # 2 saves the checkpoint that 1 loads
        spec = dict(base, layouts=LAYOUTS[world])
        if world == 2:
            spec["save_dir"] = str(ckpt)
        if world == 1:
            spec["load_dir"] = str(ckpt)
            spec["agg_variants"] = AGG_VARIANTS
        saved = run_layout_script(SCRIPT, spec, world, tmp)
        results.update(saved)
    return dict(results=results, sequences=sequences, batch=batch, models=base["models"])


def hf_logprobs(model_dir, sequences):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = model(torch.tensor([s])).logits[0]
            out.append(torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def hf_reinforce_step(model_dir, batch, out_dir, loss_agg="token-mean"):
    """Weights after one Adam step on the REINFORCE loss (token-mean, or mean over sequences of each
    sequence's token mean), all in transformers."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = sum(len(s["tokens"]) - s["prompt_len"] for s in batch)
    loss = 0.0
    for s in batch:
        tokens = torch.tensor([s["tokens"]])
        logp = torch.log_softmax(model(tokens).logits[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
        response = logp[s["prompt_len"] - 1:]  # logits at t-1 predict token t
        if loss_agg == "token-mean":
            loss = loss + (-s["advantage"] * response).sum() / total
        else:
            loss = loss + (-s["advantage"] * response).mean() / len(batch)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():  # Adam's first step: bias-corrected m = g, v = g^2
            p -= OPTIM["lr"] * p.grad / (p.grad.abs() + OPTIM["adam_eps"])
    model.save_pretrained(out_dir)
    return load_file(str(Path(out_dir) / "model.safetensors")), float(loss.detach())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def keys(results, model):
    """model/layout/dispatcher runs (not the resume, load or aggregation extras)."""
    return [k for k in results if k.startswith(model + "/") and k.count("/") == 2]


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_logprobs_match_transformers_in_every_layout(runs, model):
    ref = hf_logprobs(runs["models"][model], runs["sequences"])
    checked = keys(runs["results"], model)
    assert len(checked) == (18 if model == "moe" else 9)
    for key in checked:
        got = runs["results"][key]["logprobs"]
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g.shape == r.shape, key
            err = (g - r).abs().max().item()
            assert err < 1e-4, f"{key}: max |logp - transformers| = {err:.2e}"


def hf_response_hidden(model_dir, batch):
    """The final hidden state (after the last norm: the LM head's input) at each sample's response positions
    prompt_len-1 .. len-2, from transformers' fp32 forward."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([s["tokens"]]), output_hidden_states=True).hidden_states[-1][0,
                s["prompt_len"] - 1:len(s["tokens"]) - 1] for s in batch]


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_response_hidden_matches_transformers_in_every_layout(runs, model):
    """Learner.response_hidden (DelTA's input): the LM head's input at the response slots, under TP=2 with sequence
    parallel (gathered over the TP ranks), PP=2, EP, DP and both packings, equals transformers' last hidden state."""
    ref = hf_response_hidden(runs["models"][model], runs["batch"])
    for key in [k for k in runs["results"] if k.startswith(model + "/") and "hidden" in runs["results"][k]]:
        got = runs["results"][key]["hidden"]
        assert [tuple(g.shape) for g in got] == [tuple(r.shape) for r in ref], key
        for g, r in zip(got, ref):
            err = (g - r).abs().max().item()
            assert err < 1e-4, f"{key}: max |hidden - transformers| = {err:.2e}"


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_attention_entropy_matches_transformers_in_every_layout(runs, model):
    """Learner.response_attention_entropy (the stage attention_entropy's input) at layer 0, under TP=2 with sequence
    parallel (the heads' probabilities summed over the TP ranks), PP=2 (the layer on the first stage), EP, DP and
    both packings, equals the head-averaged eager attention entropy of transformers (tests/test_attention_entropy.py
    writes it out)."""
    from test_attention_entropy import hf_attention_entropy

    ref = hf_attention_entropy(runs["models"][model], runs["batch"], 0)
    checked = [k for k in runs["results"] if k.startswith(model + "/") and "attention_entropy" in runs["results"][k]]
    assert any("tp2" in k for k in checked) and any("pp2" in k for k in checked)
    for key in checked:
        got = runs["results"][key]["attention_entropy"]
        assert [tuple(g.shape) for g in got] == [tuple(r.shape) for r in ref], key
        for g, r in zip(got, ref):
            err = (g - r).abs().max().item()
            assert err < 1e-6, f"{key}: max |H - transformers| = {err:.2e}"


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_tp1_step_matches_transformers_adam_step(runs, model, tmp_path):
    expected, loss = hf_reinforce_step(runs["models"][model], runs["batch"], tmp_path)
    got = runs["results"][f"{model}/tp1_pp1_ep1_dp1/alltoall"]
    assert set(got["weights"]) == set(expected)
    assert abs(got["loss"] - loss) < 1e-5
    from safetensors.torch import load_file

    initial = load_file(str(Path(runs["models"][model]) / "model.safetensors"))
    moved = max((expected[k] - initial[k]).abs().max().item() for k in expected)
    assert moved > 1e-3  # the step is large enough for the comparison to mean something
    for name, tensor in expected.items():
        err = (got["weights"][name] - tensor).abs().max().item()
        assert err < 2e-6, f"{name}: max |megapo - transformers| after one step = {err:.2e}"


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_every_layout_steps_like_tp1(runs, model):
    results = runs["results"]
    for key in keys(results, model):
        dispatcher = key.rsplit("/", 1)[1]
        ref = results[f"{model}/tp1_pp1_ep1_dp1/{dispatcher}"]
        got = results[key]
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], key
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), key
        for name, tensor in ref["weights"].items():
            r = rel(got["weights"][name], tensor)
            assert r < 1e-6, f"{key} {name}: relative difference to TP=1 after one step {r:.2e}"


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_rows_x_width_packing_matches_one_sequence_per_row(runs, model):
    """Several sequences per row and several rows per micro-batch (block-diagonal masks, per-row
    positions, routers seeing [width, rows]) vs one sequence per row: log-probs, every parameter's
    gradient (gathered to HF names; the distributed optimizer's layout: the weights after the step)."""
    results = runs["results"]
    for key in keys(results, model):
        one, rows = results[key], results[key + "/rows"]
        for a, b in zip(rows["logprobs"], one["logprobs"]):
            err = (a - b).abs().max().item()
            assert err < 1e-6, f"{key}: max |logp rows - logp one per row| = {err:.2e}"
        assert abs(rows["grad_norm"] - one["grad_norm"]) <= 1e-6 * one["grad_norm"], key
        # the loss is a sum of per-micro-batch shares, and the two packings cut the batch into different
        # micro-batches: float32 summation order alone moves it by a few ulp (measured 1.0e-6 relative)
        assert abs(rows["loss"] - one["loss"]) <= 4e-6 * abs(one["loss"]), key
        compared = "grads" if "grads" in one else "weights"
        for name, tensor in one[compared].items():
            r = rel(rows[compared][name], tensor)
            assert r < 1e-6, f"{key} {name}: relative difference of the {compared} {r:.2e}"


def test_seq_mean_step_independent_of_micro_batches_and_matches_transformers(runs, tmp_path):
    expected, loss = hf_reinforce_step(runs["models"]["moe"], runs["batch"], tmp_path, "seq-mean-token-mean")
    small, large = runs["results"]["moe/variant0"], runs["results"]["moe/variant1"]
    assert small["micro_batch_tokens"] == 24 and large["micro_batch_tokens"] == 4096
    for got in (small, large):
        assert abs(got["loss"] - loss) < 1e-5
        for name, tensor in expected.items():
            err = (got["weights"][name] - tensor).abs().max().item()
            assert err < 2e-6, f"{got['micro_batch_tokens']} {name}: {err:.2e}"


def test_resume_from_checkpoint_continues_exactly(runs):
    results = runs["results"]
    continuous = results["moe/tp2_pp1_ep2_dp1_save1/alltoall"]["two_step_weights"]
    resumed = results["moe/resumed"]
    assert resumed["step"] == 2
    for name, tensor in continuous.items():
        assert torch.equal(resumed["two_step_weights"][name], tensor), name


def test_checkpoint_weights_reshard_to_tp1(runs):
    results = runs["results"]
    saved = results["moe/tp2_pp1_ep2_dp1_save1/alltoall"]["weights"]  # gathered right after the saved step
    loaded = results["moe/loaded"]["weights"]
    assert set(loaded) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
