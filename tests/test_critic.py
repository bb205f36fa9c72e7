"""The critic (megapo/learner/critic.py): a trainable Megatron value model.

References written here: transformers' AutoModelForSequenceClassification (fp32) on the same folder, V_t = its last
hidden state (output_hidden_states, after the final norm) · score.weight at positions prompt_len - 1 .. len - 2,
with the given routes forced into its routers (Qwen3-MoE's gates: softmax over all experts gathered at the forced
ones, renormalised); PPO's clipped value loss written out from its formula, differentiated by torch autograd through
that model. Layouts: TP=1 in one process, TP=2 x EP=2 (x DP=2) and PP=2 (x DP=2) in one torchrun launch, all
replaying random routes (R3), micro-batches of 24 tokens so the batch splits over micro-batches and DP ranks.
Resume: a critic saved after one step and loaded fresh takes the second step to the weights of the run that went
on. A critic from a causal-LM folder starts from its body with a zero head; one beside a policy learner shares its
process groups and leaves its log-probs alone.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapo.config import ConfigError, ParallelConfig
from megapo.launch.local import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "critic_layouts.py"
LAYOUTS = {1: {"tp1_r3": dict(layout=dict(tp=1, pp=1, ep=1, dp=1), r3=True)},
           4: {"tp2xep2_r3": dict(layout=dict(tp=2, pp=1, ep=2, dp=2), r3=True),
               "pp2_r3": dict(layout=dict(tp=1, pp=2, ep=1, dp=2), r3=True)}}
CLIP = 0.1


# ----------------------------------------------------------------------------- reference


def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)


def hf_values(model, tokens: list[int], prompt_len: int, routes=None) -> torch.Tensor:
    """transformers' V at positions prompt_len - 1 .. len - 2 (differentiable), `routes` [len - 1, layers, k]
    forced into the routers."""
    handles = []
    for column, layer in enumerate(model.model.layers):
        def force(gate, args, out, column=column):
            logits, weights, idx = out
            if routes is None:
                return out
            idx = torch.as_tensor(np.asarray(routes)[:, column], dtype=torch.long)
            idx = torch.cat([idx, out[2][len(idx):]])  # the last token: its own choice (it predicts nothing)
            weights = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), idx
        handles.append(layer.mlp.gate.register_forward_hook(force))
    try:
        hidden = model.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    finally:
        for h in handles:
            h.remove()
    return (hidden @ model.score.weight[0])[prompt_len - 1:len(tokens) - 1]


def value_loss(values, old, returns, clip: float) -> torch.Tensor:
    """PPO's clipped value loss: ½·max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²), averaged over
    every response token of the batch."""
    v, o, r = torch.cat(values), torch.cat(old), torch.cat(returns)
    plain = (v - r) ** 2
    clipped = (o + torch.clamp(v - o, -clip, clip) - r) ** 2
    return 0.5 * torch.maximum(plain, clipped).mean()


def transformers_step(model_dir, samples, returns, old) -> dict:
    """Free and forced values, the loss and every parameter's gradient, from transformers with autograd."""
    model = hf_model(model_dir)
    with torch.no_grad():
        free = [hf_values(model, s["tokens"], s["prompt_len"]) for s in samples]
    values = [hf_values(model, s["tokens"], s["prompt_len"], s["routes"]) for s in samples]
    loss = value_loss(values, [torch.tensor(o) for o in old], [torch.tensor(r) for r in returns], CLIP)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return dict(free=free, values=[v.detach() for v in values], loss=float(loss.detach()), grads=grads)


# ----------------------------------------------------------------------------- data


def random_samples(model_dir, seed: int = 0, vocab: int = 512) -> list[dict]:
    """Samples of several prompt and response lengths, each with random routes (k distinct experts per position
    and MoE layer) at every position fed to the model."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    experts, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    layers = cfg["num_hidden_layers"] - len(cfg["mlp_only_layers"])  # every other layer is MoE
    rng = random.Random(seed)
    out = []
    for prompt, response in [(4, 6), (9, 3), (2, 12), (6, 1), (5, 8)]:
        n = prompt + response
        routes = [[rng.sample(range(experts), k) for _ in range(layers)] for _ in range(n - 1)]
        out.append(dict(tokens=[rng.randrange(1, vocab) for _ in range(n)], prompt_len=prompt, routes=routes))
    return out


def targets(values, seed: int) -> tuple[list[list[float]], list[list[float]]]:
    """(returns, old values): returns anywhere in [-1, 1]; old values within 0.3 of the values, so that the
    clip (0.1) binds at some tokens and not at others."""
    rng = random.Random(seed)
    returns = [[rng.uniform(-1, 1) for _ in v] for v in values]
    old = [[float(x) + rng.uniform(-0.3, 0.3) for x in v] for v in values]
    return returns, old


@pytest.fixture(scope="module")
def critic_runs(tiny_model_factory, tiny_moe, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("critic_layouts")
    model = tiny_model_factory("qwen3_moe", head="score")
    samples = random_samples(model)
    with torch.no_grad():
        start = [hf_values(hf_model(model), s["tokens"], s["prompt_len"], s["routes"]) for s in samples]
    returns, old = targets(start, seed=1)
    returns2, _ = targets(start, seed=2)
    bad = {"one_short": returns[:-1], "wrong_length": [returns[0], returns[1][:-1], *returns[2:]]}
    results, logs = {}, {}
    for world, layouts in LAYOUTS.items():
        spec = dict(model=str(model), samples=samples, returns=returns, returns2=returns2, old_values=old, clip=CLIP,
                    bad=bad, optim=dict(lr=0.01, grad_clip=0.0, warmup_steps=1), micro_batch_tokens=24,
                    layouts=list(layouts.values()), ckpt=str(tmp / f"ckpt{world}"),
                    lm_model=str(tiny_moe) if world == 1 else None,
                    policy=dict(model=str(tiny_moe), layout=layouts["tp2xep2_r3"]["layout"]) if world == 4 else None)
        spec_path, out = tmp / f"spec{world}.json", tmp / f"out{world}.pt"
        spec_path.write_text(json.dumps(spec))
        args = [str(SCRIPT), "--spec", str(spec_path), "--out", str(out)]
        if world == 1:
            proc = subprocess.run([sys.executable, *args], cwd=ROOT, timeout=900, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr[-3000:]
            logs[world] = proc.stdout
        else:
            assert run_torchrun(args, world, timeout_s=900) == 0, f"world {world}"
        loaded = torch.load(out, weights_only=False)
        for extra in ("from_lm", "beside_policy"):
            if extra in loaded:
                results[extra] = loaded.pop(extra)
        results.update(zip(layouts, loaded.values()))
    return dict(results=results, logs=logs, samples=samples, lm_model=tiny_moe,
                reference=transformers_step(model, samples, returns, old))


ALL = [name for layouts in LAYOUTS.values() for name in layouts]


# ----------------------------------------------------------------------------- values and the loss


@pytest.mark.parametrize("layout", ALL)
def test_values_equal_transformers_with_routes_replayed(critic_runs, layout):
    got, ref = critic_runs["results"][layout]["values"], critic_runs["reference"]
    for s, v, r in zip(critic_runs["samples"], got, ref["values"]):
        assert v.dtype == torch.float32 and v.shape == (len(s["tokens"]) - s["prompt_len"],)
        assert (v - r).abs().max().item() < 1e-5, (v, r)
    # the forced routes change the values: a critic routing freely would fail the check above
    assert max((f - r).abs().max().item() for f, r in zip(ref["free"], ref["values"])) > 1e-3
    assert "the value head is its score head" in critic_runs["logs"][1]


@pytest.mark.parametrize("layout", ALL)
def test_value_loss_gradient_equals_transformers_autograd(critic_runs, layout):
    got, ref = critic_runs["results"][layout], critic_runs["reference"]
    assert abs(got["metrics"]["loss"] - ref["loss"]) < 1e-6
    assert 0.0 < got["metrics"]["clip_frac"] < 1.0  # both branches of the max are exercised
    assert got["metrics"]["tokens"] == sum(len(s["tokens"]) - s["prompt_len"] for s in critic_runs["samples"])
    assert got["metrics"]["replay/disagree_post"] == 0.0  # routes used == routes given
    # transformers keeps the experts fused in memory; every other parameter has its checkpoint name
    shared = sorted(set(ref["grads"]) & set(got["grads"]))
    assert {"score.weight", "model.norm.weight", "model.embed_tokens.weight"} <= set(shared)
    assert len(shared) >= 12, shared
    for name in shared:
        r = ref["grads"][name]
        err = (got["grads"][name] - r).abs().max().item()
        assert err <= 1e-5 + 1e-4 * r.abs().max().item(), (name, err, r.abs().max().item())


@pytest.mark.parametrize("layout", ALL)
def test_resume_takes_the_uninterrupted_step(critic_runs, layout):
    got = critic_runs["results"][layout]
    assert got["steps"] == got["resumed_steps"] == 2
    assert got["second"]["lr"] == got["resumed_second"]["lr"] > 0  # the scheduler resumed past its warm-up step
    assert got["second"]["loss"] == got["resumed_second"]["loss"]
    assert set(got["uninterrupted"]) == set(got["resumed"])
    for name, w in got["uninterrupted"].items():
        assert torch.equal(w, got["resumed"][name]), name
    # the second step moved the weights (so equal weights say the optimizer's moments came back too)
    assert not torch.equal(got["uninterrupted"]["score.weight"], got["first"]["score.weight"])
    assert got["second"]["loss"] != got["metrics"]["loss"]


def test_bad_returns_named(critic_runs):
    errors = critic_runs["results"]["tp1_r3"]["errors"]
    assert errors["one_short"].startswith("returns: expected one entry per sample (5), got 4"), errors
    assert errors["wrong_length"].startswith("returns[1]: expected 3 values (one per response token), got 2"), errors


def test_critic_from_a_causal_lm_starts_from_its_body_with_a_zero_head(critic_runs):
    from safetensors.torch import load_file

    got = critic_runs["results"]["from_lm"]
    assert "a causal LM: its body, the value head starting at zeros" in critic_runs["logs"][1]
    folder = load_file(Path(critic_runs["lm_model"]) / "model.safetensors")
    assert "lm_head.weight" in folder and "lm_head.weight" not in got["initial"]
    assert set(got["initial"]) == set(folder) - {"lm_head.weight"} | {"score.weight"}
    assert not got["initial"]["score.weight"].any()
    for name, w in folder.items():
        if name != "lm_head.weight":
            assert torch.equal(got["initial"][name], w.float()), name
    for s, v in zip(critic_runs["samples"], got["values"]):
        assert v.shape == (len(s["tokens"]) - s["prompt_len"],) and not v.any()
    # its head learns: one step on the value loss moves the values off zero
    assert got["metrics"]["update_ok"] and all(v.abs().max() > 0 for v in got["values_after"])


def test_critic_beside_a_policy_learner_shares_its_groups_and_leaves_it_alone(critic_runs):
    """As the trainer holds them (TP=2 x EP=2 x DP=2, both replaying the routes): the critic's values are still
    transformers', its step and its close leave the policy's log-probs as they were."""
    got, ref = critic_runs["results"]["beside_policy"], critic_runs["reference"]
    for v, r in zip(got["values"], ref["values"]):
        assert (v - r).abs().max().item() < 1e-5
    assert got["metrics"]["update_ok"] and got["metrics"]["replay/disagree_post"] == 0.0
    for before, beside, after in zip(got["logp_before"], got["logp_beside"], got["logp_after_close"]):
        assert torch.equal(before, beside) and torch.equal(before, after)


# ----------------------------------------------------------------------------- refusals before anything is built


def test_missing_folder_refused_naming_the_field(tmp_path):
    from megapo.learner.critic import Critic

    with pytest.raises(ConfigError) as err:
        Critic(tmp_path / "nope", ParallelConfig())
    assert err.value.field == "algorithm.critic.path" and "config.json" in str(err.value)


def test_family_without_score_head_refused_naming_the_field(tiny_moe, monkeypatch):
    import megapo.learner.learner
    from megapo.learner.critic import Critic
    from megapo.models import family as family_lib

    real = family_lib.family_for
    monkeypatch.setattr(family_lib, "family_for", lambda hf: dataclasses.replace(real(hf), score_rules=None))

    def refuse(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(megapo.learner.learner.Learner, "__init__", refuse)
    with pytest.raises(ConfigError) as err:
        Critic(tiny_moe, ParallelConfig(), field="critic")
    assert err.value.field == "critic" and "no score head" in str(err.value)
