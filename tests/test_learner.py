"""`megapo logprobs` end to end (single process and a torchrun layout) vs transformers, and bad
layouts / inputs refused with the numbers before any process starts."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.cli import run_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_rank import ONE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def write_input(path: Path, vocab: int = 512, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 2, 11)]
    path.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    return sequences


def transformers_logprobs(model_dir, sequences):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = model(torch.tensor([s])).logits[0, :-1]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


@pytest.mark.parametrize("family, layout", [
    ("qwen3_moe", []),
    ("qwen3_moe", ["--tp", "2", "--ep", "2", "--dispatcher", "allgather"]),
    ("mixtral", ["--tp", "2", "--ep", "2"]),  # router order (softmax after top-k) must match HF
], ids=["qwen3_moe-tp1", "qwen3_moe-tp2xep2", "mixtral-tp2xep2"])
def test_logprobs_command_matches_transformers(tiny_model_factory, tmp_path, family, layout):
    tiny_moe = tiny_model_factory(family)
    sequences = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(tiny_moe), "--input",
           str(tmp_path / "in.jsonl"), "--output", str(out), "--micro-batch-tokens", "20", "--timeout", "300", *layout]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    ref = transformers_logprobs(tiny_moe, sequences)
    assert [len(g) for g in got] == [len(s) - 1 for s in sequences]
    for g, r in zip(got, ref):
        assert (torch.tensor(g) - r).abs().max().item() < 1e-4


def _args(model, tmp_path, **kw):
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        write_input(inp)
    base = dict(model=str(model), input=str(inp), output=str(tmp_path / "out.jsonl"), tp=1, pp=1, ep=1, dp=1,
                dispatcher="alltoall", micro_batch_tokens=64, timeout=60, worker=False)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw, words", [
    (dict(tp=3), ["tp=3", "num_attention_heads=4"]),
    (dict(pp=3), ["pp=3", "num_hidden_layers=2"]),
    (dict(ep=3, dp=3), ["ep=3", "(8)"]),
    (dict(ep=2), ["2", "tp*dp", "1"]),
    (dict(tp=0), ["parallel.tp", "0"]),
])
def test_bad_layout_refused_before_any_process(tiny_moe, tmp_path, capsys, no_launch, kw, words):
    assert run_command("logprobs", _args(tiny_moe, tmp_path, **kw)) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_dense_model_with_ep_refused(tiny_dense, tmp_path, capsys, no_launch):
    assert run_command("logprobs", _args(tiny_dense, tmp_path, ep=2, dp=2)) == 2
    assert "dense" in capsys.readouterr().err


@pytest.mark.parametrize("content, words", [
    ('{"tokens": [1]}\n', ["--input", "in.jsonl:1:", "at least 2"]),
    ('{"toks": [1, 2]}\n', ["--input", "in.jsonl:1:"]),
    ('{"tokens": [1, 99999]}\n', ["--input", "in.jsonl:1:", "512"]),
])
def test_bad_input_refused(tiny_moe, tmp_path, capsys, no_launch, content, words):
    (tmp_path / "in.jsonl").write_text(content)
    assert run_command("logprobs", _args(tiny_moe, tmp_path)) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_missing_model_refused(tmp_path, capsys, no_launch):
    assert run_command("logprobs", _args(tmp_path / "nope", tmp_path)) == 2
    assert "config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------- on-policy step


ON_POLICY_SCRIPT = ROOT / "tests" / "distributed" / "on_policy_step.py"
# step-timing metrics differ between any two runs
TIMING = ("train/step_time_s", "train/tokens_per_s")


def engine_samples(model_dir, count=4, n=4, seed=5) -> list[dict]:
    """Rollouts (with routes and log-probs) of another model than the learner's, so that the learner's
    routers disagree with the routes and its log-probs with the engine's."""
    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_dir)
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(4, 9))] for _ in range(count)]
    groups = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=6, return_routes=True, seed=seed))
    engine.close()
    return [dict(tokens=s.prompt_ids + s.output_ids, prompt_len=len(s.prompt_ids), advantage=rng.uniform(-1, 1),
                 rollout_logp=list(s.logprobs), routes=s.routes.tolist()) for g in groups for s in g]


@pytest.fixture(scope="module")
def on_policy_runs(tiny_model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("on_policy")
    samples = engine_samples(tiny_model_factory("qwen3_moe", seed=1))  # another model's rollouts
    spec = dict(model=str(tiny_model_factory("qwen3_moe")), samples=samples,
                modes=["off", "r2", "r3"], optim=dict(lr=0.05, grad_clip=1.0), layout=dict(tp=1, pp=1, ep=1, dp=1),
                micro_batch_tokens=48, objective="gspo", loss_agg="seq-mean-token-mean")
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(ON_POLICY_SCRIPT), "--spec", str(tmp / "spec.json"), "--out",
                           str(tmp / "out.pt")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
def test_on_policy_step_without_the_old_pass_gives_the_same_update_and_metrics(on_policy_runs, mode):
    """Reference: the two-pass step (old-log-prob pass, KL measurement, train step on its π_old)."""
    two, one = on_policy_runs[f"{mode}/two_passes"], on_policy_runs[f"{mode}/one_pass"]
    for name, ref in two["weights"].items():
        err = (one["weights"][name] - ref).abs().max().item()
        assert err < 1e-6, f"{mode} {name}: max |one pass - two passes| after the step = {err:.2e}"
    expected = {k: v for k, v in two["metrics"].items() if k not in TIMING}
    assert set(expected) <= set(one["metrics"]), set(expected) - set(one["metrics"])
    for key, value in expected.items():
        assert one["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert two["metrics"]["train/update_ok"] and two["metrics"]["train/grad_norm"] > 0
    if mode != "off":
        assert {"replay/disagree_pre", "replay/fallback_frac", "replay/kl_k3", "replay/kl_k3_free",
                "train/replay/disagree_pre", "train/replay/fallback_frac"} <= set(expected)
    if mode == "r3":  # the routes are another model's: the metrics have something to agree on
        assert expected["replay/disagree_pre"] > 0.2 and expected["train/replay/fallback_frac"] == 0.0
        assert expected["replay/kl_k3"] != pytest.approx(expected["replay/kl_k3_free"], rel=1e-3)


# ----------------------------------------------------------------------------- non-finite updates


NONFINITE_SCRIPT = r"""
import json, sys
import torch
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner

fault = {"on": None}


class InfGrad(torch.autograd.Function):  # identity forward, an inf gradient backward
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def loss_fn(*args, **kwargs):  # policy_loss; its gradient made inf while fault is "grad" (the loss stays finite)
    from megapo.algorithms import policy_loss
    args = list(args)
    if fault["on"] == "grad":
        args[1] = InfGrad.apply(args[1])
    return policy_loss(*args, **kwargs)


def inner_optimizers(learner):
    return [o.optimizer for o in learner.optimizer.chained_optimizers]


def poison_after_step(opt, args, kwargs):  # an update that leaves a parameter non-finite
    if fault["on"] == "param":
        opt.param_groups[0]["params"][0].data.view(-1)[0] = float("inf")


def snapshot(learner):
    weights = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    state = [{k: v.clone() for k, v in s.items()} for o in inner_optimizers(learner) for s in o.state.values()]
    return weights, state


def same(a, b):
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and len(a[1]) == len(b[1]) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                               for x, y in zip(a[1], b[1])))


if __name__ == "__main__":
    learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=0.01, warmup_steps=0), total_steps=8,
                      loss_fn=loss_fn)
    for o in inner_optimizers(learner):
        o.register_step_post_hook(poison_after_step)
    batch = [{"tokens": [5, 6, 7, 8, 9, 10], "prompt_len": 3, "advantage": a, "old_logp": [-6.0] * 3}
             for a in (1.0, -1.0)]
    out = {}
    for name in ("param", "grad", "none", "grad", "param", "none"):  # faults before and after Adam has state
        fault["on"] = name if name != "none" else None
        before, sched = snapshot(learner), learner.scheduler.num_steps
        m = learner.train_step(batch, "ppo")
        after = snapshot(learner)
        out.setdefault(name, []).append({
            "skipped": m["skipped_nonfinite"], "update_ok": m["update_ok"], "loss_finite": m["loss"] == m["loss"],
            "unchanged": same(before, after), "sched_moved": learner.scheduler.num_steps != sched,
            "states": len(after[1]), "all_finite": all(bool(torch.isfinite(w).all()) for w in after[0].values())})
    out["step"] = learner.step
    learner.close()
    # without the copy: inf gradients are still refused before the optimizer; a poisoned update raises
    learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=0.01, warmup_steps=0, restore_nonfinite=False),
                      total_steps=8, loss_fn=loss_fn)
    for o in inner_optimizers(learner):
        o.register_step_post_hook(poison_after_step)
    learner.train_step(batch, "ppo")
    fault["on"] = "grad"
    before = snapshot(learner)
    m = learner.train_step(batch, "ppo")
    out["no_copy_grad"] = {"skipped": m["skipped_nonfinite"], "unchanged": same(before, snapshot(learner))}
    fault["on"] = "param"
    try:
        learner.train_step(batch, "ppo")
        out["no_copy_param"] = "no error"
    except RuntimeError as err:
        out["no_copy_param"] = str(err)
    print(json.dumps(out))
"""


def test_nonfinite_update_is_refused_weights_and_adam_state_kept(tmp_path, tiny_dense):
    """Inf gradients (finite loss) are refused before the optimizer; an update that leaves a parameter inf
    (an optimizer hook) is undone. Reference: the weights and every Adam state tensor copied before the step."""
    (tmp_path / "nonfinite.py").write_text(NONFINITE_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "nonfinite.py"), str(tiny_dense)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for fault in ("param", "grad"):
        for i, step in enumerate(r[fault]):
            assert step["skipped"] == 1 and not step["update_ok"] and step["loss_finite"], (fault, i, step)
            assert step["unchanged"] and not step["sched_moved"] and step["all_finite"], (fault, i, step)
    assert r["param"][0]["states"] == r["grad"][0]["states"] == 0  # refused before Adam ever stepped: no state
    assert r["grad"][1]["states"] > 0 and r["param"][1]["states"] > 0  # refused with Adam's state in place
    for step in r["none"]:
        assert step["skipped"] == 0 and step["update_ok"] and not step["unchanged"] and step["all_finite"]
    assert r["step"] == 2
    assert r["no_copy_grad"] == {"skipped": 1, "unchanged": True}
    assert "restore_nonfinite=False" in r["no_copy_param"]


# ----------------------------------------------------------------------------- vocabulary-parallel log-probs


def test_logprobs_and_entropy_with_gradients_match_log_softmax():
    """One rank holding a padded vocabulary slice (11 logits, vocabulary 9): log-probs, entropy and the
    gradient of both against torch.log_softmax over the real vocabulary; entropy_grad=False keeps no graph."""
    from megapo.learner.logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    logits = torch.randn(7, 11, requires_grad=True)  # (computed in float32)
    targets = torch.randint(0, 9, (7,))
    logp, entropy = vocab_parallel_logprobs(logits, targets, vocab_size=9, with_entropy=True, group=ONE)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_all = torch.log_softmax(ref_logits[:, :9], dim=-1)
    ref_logp = ref_all.gather(1, targets[:, None])[:, 0]
    ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-6)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    (ref_logp.sum() + 0.5 * ref_entropy.sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-6)
    _, metric_only = vocab_parallel_logprobs(logits, targets, vocab_size=9, with_entropy=True, entropy_grad=False,
                                             group=ONE)
    assert not metric_only.requires_grad
    torch.testing.assert_close(metric_only, ref_entropy.detach(), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the head at the selected slots


HEAD_SCRIPT = r"""
import json, sys
import torch
from megapo.config import ParallelConfig
from megapo.learner.learner import Learner

learner = Learner(sys.argv[1], ParallelConfig(), micro_batch_tokens=40, share_prefix="off")
rows = []
learner.module.output_layer.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0] * args[0].shape[1]))
sequences = json.loads(sys.argv[2])
logps = learner.logprobs(sequences)
print(json.dumps({"logprobs": [l.tolist() for l in logps], "head_rows": rows}))
"""


def test_the_lm_head_runs_at_the_selected_slots_only(tmp_path, tiny_moe):
    """The head's input holds one row per predicted position (sum of len - 1 over the sequences), not rows x width
    of the packed micro-batches, and the log-probs still equal transformers' forward."""
    sequences = write_input(tmp_path / "in.jsonl")
    (tmp_path / "head.py").write_text(HEAD_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "head.py"), str(tiny_moe), json.dumps(sequences)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(r["head_rows"]) == sum(len(s) - 1 for s in sequences)
    assert len(r["head_rows"]) > 1  # several micro-batches, each its own selection
    for got, ref in zip(r["logprobs"], transformers_logprobs(tiny_moe, sequences)):
        assert (torch.tensor(got) - ref).abs().max().item() < 1e-4


# ----------------------------------------------------------------------------- padding slots skip the experts


PADDING_SCRIPT = r"""
import json, sys
import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megapo.config import ParallelConfig
from megapo.learner.learner import Learner

learner = Learner(sys.argv[1], ParallelConfig(), micro_batch_tokens=40, share_prefix="off")
routed, slots = [], []
for m in learner.module.modules():
    if isinstance(m, SequentialMLP):
        m.register_forward_hook(lambda m, args, out: routed.append(int(torch.as_tensor(args[1]).sum())))
learner.module.embedding.register_forward_hook(lambda m, args, out: slots.append(out.shape[0] * out.shape[1]))
sequences = json.loads(sys.argv[2])
logps = learner.logprobs(sequences)
print(json.dumps({"logprobs": [l.tolist() for l in logps], "routed": routed, "slots": slots,
                  "layers": learner.spec.num_moe_layers, "topk": learner.spec.topk}))
"""


def test_padding_slots_reach_no_expert(tmp_path, tiny_moe):
    """Packed micro-batches hold padding; the experts of every MoE layer get top-k x the real tokens only (the
    sequences' lengths summed), fewer than the slots, and the log-probs still equal transformers' forward."""
    sequences = write_input(tmp_path / "in.jsonl")
    (tmp_path / "pads.py").write_text(PADDING_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "pads.py"), str(tiny_moe), json.dumps(sequences)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    real = sum(len(s) for s in sequences)
    assert sum(r["slots"]) > real  # the packing padded some slots
    assert sum(r["routed"]) == r["layers"] * r["topk"] * real
    for got, ref in zip(r["logprobs"], transformers_logprobs(tiny_moe, sequences)):
        assert (torch.tensor(got) - ref).abs().max().item() < 1e-4
