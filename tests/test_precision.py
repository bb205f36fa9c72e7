"""The learner in bf16 and fp16 (megapo/learner/precision.py) against independent references.

- Log-probs under TP=1 (DP=2 of TP=1 ranks), TP=2, PP=2, EP=2xDP=2 and TP=2xEP=2, for qwen3_moe and deepseek_v3,
  against transformers' forward in the same dtype, the learner replaying transformers' routes of that forward. The
  tolerance: transformers' own gap between its fp32 and its bf16 (fp16) forward on the same inputs (YARDSTICK x
  that gap, max and mean): two implementations in one half-precision dtype round differently, by about as much as
  the dtype itself moves the result. Each must also be away from transformers' fp32 by more than fp32 parity
  (1e-5): it really ran in half precision. Routing freely, a router near-tie can go the other way in one of the two
  (measured here: deepseek_v3 bf16 TP=2, one token 7e-2 away): the mismatch itself, which the learner's own routes
  show (at most MAX_FLIPS of the (token, layer) decisions differ from transformers').
- One bf16 step at DP=2 with the distributed optimizer: the fp32 main parameters after it equal an AdamW step
  written out here, applied to the main parameters with the gradients the bf16 model produced; the model's
  parameters are the bf16 rounding of the main parameters.
- fp16: an overflow (a loss scaled by 1e12) skips the step, leaves weights and Adam's state as they were and
  halves the loss scale; the next clean step applies.
- Resume: a bf16 and an fp16 learner saved after 2 steps and loaded by a fresh learner take steps 3-4 exactly as
  the uninterrupted one does (model weights, fp32 main parameters, Adam's moments, the loss scale).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.launch.local import run_torchrun

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import hf_forward as family_forward, same_sets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "precision_layouts.py"
LAYOUTS = [dict(tp=1, dp=2), dict(tp=2), dict(pp=2), dict(ep=2, dp=2), dict(tp=2, ep=2)]
FAMILIES = ("qwen3_moe", "deepseek_v3")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
YARDSTICK = 1.5  # x transformers' own fp32-vs-half gap (max and mean over every token)
MAX_FLIPS = 0.05  # share of router decisions a free-routing learner may take otherwise than transformers
STEP_OPTIM = dict(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, grad_clip=0.0)


def sequences(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (7, 33, 12, 40, 20, 9)]


def batch(vocab: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n, p in [(12, 4), (30, 6), (9, 3), (24, 10)]:
        out.append(dict(tokens=[rng.randrange(vocab) for _ in range(n)], prompt_len=p, advantage=rng.uniform(-1, 1)))
    return out


def hf_forward(model_dir, seqs, dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' forward in `dtype`: its logits' log-softmax in fp32 (as the learner takes it), all tokens; and
    the routes its MoE layers chose for the tokens whose logits predict one ([n-1, layers, k] per sequence)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    logps, routes = [], []
    for s in seqs:
        logits, chosen = family_forward(model, torch.tensor([s]))
        logps.append(torch.log_softmax(logits[0].float(), -1)[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0])
        routes.append(chosen[0, :-1])
    return torch.cat(logps), routes


def hf_logprobs(model_dir, seqs, dtype) -> torch.Tensor:
    return hf_forward(model_dir, seqs, dtype)[0]


@pytest.fixture(scope="module")
def run(tiny_model_factory, tmp_path_factory):
    models = {f: str(tiny_model_factory(f)) for f in FAMILIES}
    tmp = tmp_path_factory.mktemp("precision")
    seqs = sequences(512)
    step = dict(model=models["qwen3_moe"], batch=[dict(s, old_logp=[-6.0] * (len(s["tokens"]) - s["prompt_len"]))
                                                  for s in batch(512)], optim=STEP_OPTIM)
    refs = {f"{f}/{name}": hf_forward(models[f], seqs, dtype) for f in FAMILIES for name, dtype in DTYPES.items()}
    routes = {key: [r.tolist() for r in ref[1]] for key, ref in refs.items()}
    rng = random.Random(2)
    train_batch = [dict(tokens=q, prompt_len=2, advantage=rng.uniform(-1, 1), old_logp=[-6.0] * (len(q) - 2))
                   for q in seqs]
    spec = dict(models=models, precisions=list(DTYPES), layouts=LAYOUTS, sequences=seqs, step=step, routes=routes,
                train_batch=train_batch)
    (tmp / "spec.json").write_text(json.dumps(spec))
    rc = run_torchrun([str(SCRIPT), "--spec", str(tmp / "spec.json"), "--out", str(tmp / "out.pt")], 2, timeout_s=900)
    assert rc == 0, f"exit code {rc}"
    return models, seqs, refs, torch.load(tmp / "out.pt", weights_only=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_logprobs_match_transformers_in_the_same_dtype(run, family):
    models, seqs, refs, results = run
    fp32 = hf_logprobs(models[family], seqs, torch.float32)
    for name in DTYPES:
        ref, hf_routes = refs[f"{family}/{name}"]
        gap = (ref - fp32).abs()
        assert gap.max() > 1e-5, "transformers' half-precision forward should differ from its fp32 one"
        for layout in LAYOUTS:
            key = "-".join(f"{k}{v}" for k, v in layout.items())
            ours = torch.cat(results[f"logprobs/{family}/{name}/{key}"])
            diff = (ours - ref).abs()
            where = f"{family} {name} {key}: max {diff.max():.2e} mean {diff.mean():.2e}, yardstick max " \
                    f"{gap.max():.2e} mean {gap.mean():.2e}"
            assert diff.max() <= YARDSTICK * gap.max() and diff.mean() <= YARDSTICK * gap.mean(), where
            assert (ours - fp32).abs().max() > 1e-5, f"{where}: as close to fp32 as an fp32 learner"
            step = results[f"train/{family}/{name}/{key}"]  # a step under the layout, replaying the routes
            assert step["update_ok"] and step["loss"] == step["loss"] and step["replay/disagree_post"] == 0, where
            own = results[f"routes/{family}/{name}/{key}"]
            flips = sum(int((~same_sets(a, b)).sum()) for a, b in zip(own, hf_routes))
            assert flips <= MAX_FLIPS * sum(r[..., 0].numel() for r in hf_routes), f"{where}: {flips} flips"


def test_bf16_distributed_optimizer_step_is_fp32_adamw_on_the_main_parameters(run):
    """Written out (torch.optim.AdamW's update, decoupled weight decay, step 1): m = (1 - b1) g, v = (1 - b2) g²,
    p' = p (1 - lr wd) - lr (m / (1 - b1)) / (sqrt(v / (1 - b2)) + eps); in float64 from the fp32 values. wd
    applies to matrices only, not to vectors (norm weights, biases), as in Megatron-LM."""
    step = run[3]["step"]
    assert step["metrics"]["update_ok"] and step["main_dtypes"] == ["torch.float32"]
    assert step["model_dtypes"] == ["torch.bfloat16"]
    o = STEP_OPTIM
    b1, b2, lr, wd, eps = o["adam_beta1"], o["adam_beta2"], o["lr"], o["weight_decay"], o["adam_eps"]
    assert len(step["before"]) == len(step["after"]) == len(step["model"]) > 0
    moved = 0
    assert len(step["dims"]) == len(step["model"]) and {1, 2} <= set(step["dims"])
    for (p, g), after, model, dim in zip(step["before"], step["after"], step["model"], step["dims"]):
        p64, g64 = p.double(), g.double()
        m, v = (1 - b1) * g64, (1 - b2) * g64 * g64
        decay = wd if dim > 1 else 0.0
        expected = p64 * (1 - lr * decay) - lr * (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps)
        torch.testing.assert_close(after.double(), expected, rtol=0, atol=1e-6)
        assert torch.equal(model, after.to(torch.bfloat16)), "model weights are not the bf16 rounding of the main ones"
        moved += int((after != p).sum())
    assert moved > 0
    assert sum(float(g.abs().sum()) for _, g in step["before"]) > 0, "no gradient reached the main parameters"


STEPS_SCRIPT = r"""
import json, sys
import torch
from megapo.algorithms import policy_loss
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.learner.precision import Precision

model, precision, ckpt, batch = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
scale = {"factor": 1.0}


def loss_fn(*args, **kwargs):  # policy_loss, times a factor: 1e12 makes the fp16 backward overflow
    loss, metrics = policy_loss(*args, **kwargs)
    return loss * scale["factor"], metrics


def learner():
    return Learner(model, ParallelConfig(), OptimConfig(lr=1e-2, warmup_steps=0), total_steps=8, loss_fn=loss_fn,
                   precision=Precision(precision, loss_scale_hysteresis=1))


def state(l):
    inner = [o.optimizer for o in l.optimizer.chained_optimizers]
    weights = [p.detach().clone() for p in l.module.parameters()]
    main = [p.detach().clone() for o in inner for g in o.param_groups for p in g["params"]]
    moments = [torch.as_tensor(v).clone() for o in inner for g in o.param_groups for p in g["params"]
               for _, v in sorted(o.state.get(p, {}).items())]  # (in parameter order: a loaded state is re-keyed)
    return weights, main, moments


def same(a, b):
    return all(len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b))


def main():  # (dist_checkpointing starts a helper process: the script needs a __main__ guard)
    out = {}
    first = learner()
    first.train_step(batch, "ppo")
    if precision == "fp16":  # an overflow: skipped, state untouched, the scale halved; then a clean step applies
        before, scale_before = state(first), float(first.optimizer.get_loss_scale())
        scale["factor"] = 1e12
        m = first.train_step(batch, "ppo")
        scale["factor"] = 1.0
        out["overflow"] = {"update_ok": m["update_ok"], "skipped_steps": m["skipped_steps"], "scale_before": scale_before,
                           "loss_scale": m["loss_scale"], "unchanged": same(before, state(first)), "step": first.step,
                           "counted_as": [m["overflow"], m["skipped_nonfinite"]]}
    first.train_step(batch, "ppo")
    out["saved_scale"] = float(first.optimizer.get_loss_scale())
    first.save(ckpt)
    torch.save(dict(first.hf_state_dict()), ckpt + ".weights.pt")  # what a conversion of the checkpoint must give
    metrics = [first.train_step(batch, "ppo") for _ in range(2)]
    straight = state(first)
    first.close()
    second = learner()
    second.load(ckpt)
    out["loaded_scale"] = float(second.optimizer.get_loss_scale())
    out["loaded_skipped"] = second.skipped_steps
    resumed_metrics = [second.train_step(batch, "ppo") for _ in range(2)]
    out["identical"] = same(straight, state(second))
    out["weights_dtype"] = str(next(second.module.parameters()).dtype)
    out["losses"] = [[m["loss"] for m in metrics], [m["loss"] for m in resumed_metrics]]
    out["scales"] = [[m.get("loss_scale") for m in metrics], [m.get("loss_scale") for m in resumed_metrics]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
"""


def _steps(tmp_path, model, precision) -> dict:
    (tmp_path / "steps.py").write_text(STEPS_SCRIPT)
    samples = [dict(s, old_logp=[-6.0] * (len(s["tokens"]) - s["prompt_len"])) for s in batch(512)]
    proc = subprocess.run([sys.executable, str(tmp_path / "steps.py"), str(model), precision, str(tmp_path / "ckpt"),
                           json.dumps(samples)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bf16_run_resumes_bit_identically_and_converts_to_bf16_safetensors(tmp_path, tiny_moe):
    from safetensors.torch import load_file

    r = _steps(tmp_path, tiny_moe, "bf16")
    assert r["weights_dtype"] == "torch.bfloat16"
    assert r["identical"], r
    assert r["losses"][0] == r["losses"][1]
    out = tmp_path / "hf_bf16"
    proc = subprocess.run([sys.executable, "-m", "megapo.cli", "convert", "megatron-to-hf", "--ckpt",
                           str(tmp_path / "ckpt"), "--model", str(tiny_moe), "--out", str(out), "--dtype", "bf16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    saved = torch.load(str(tmp_path / "ckpt") + ".weights.pt")
    assert written.keys() == saved.keys()
    for name, tensor in saved.items():  # the learner's bf16 weights, written exactly, in bf16
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name], tensor.to(torch.bfloat16)), name


def test_fp16_overflow_is_skipped_and_halves_the_scale_and_a_run_resumes_with_its_scale(tmp_path, tiny_moe):
    r = _steps(tmp_path, tiny_moe, "fp16")
    o = r["overflow"]
    assert not o["update_ok"] and o["unchanged"] and o["skipped_steps"] == 1 and o["step"] == 1, o
    assert o["counted_as"] == [1, 0]  # an overflow, not a non-finite update (which the collapse rule counts)
    assert o["loss_scale"] == o["scale_before"] / 2, o
    assert r["saved_scale"] == o["loss_scale"]  # the clean step after it applied without growing the scale back
    assert r["loaded_scale"] == r["saved_scale"] and r["loaded_skipped"] == 1  # from the checkpoint, not initial
    assert r["identical"], r
    assert r["losses"][0] == r["losses"][1] and r["scales"][0] == r["scales"][1]


def test_logprobs_command_takes_the_precision(tmp_path, tiny_moe):
    """`megapo logprobs --precision bf16` (one process) gives transformers' bf16 log-probs within the yardstick;
    a precision it does not know is refused naming the flag before anything starts."""
    seqs = sequences(512)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in seqs))
    megapo = [sys.executable, "-m", "megapo.cli", "logprobs", "--model", str(tiny_moe), "--input",
              str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    bad = subprocess.run(megapo + ["--precision", "fp8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--precision" in bad.stderr and not (tmp_path / "out.jsonl").exists()
    proc = subprocess.run(megapo + ["--precision", "bf16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = torch.tensor([x for line in (tmp_path / "out.jsonl").read_text().splitlines()
                         for x in json.loads(line)["logprobs"]])
    ref, fp32 = hf_logprobs(tiny_moe, seqs, torch.bfloat16), hf_logprobs(tiny_moe, seqs, torch.float32)
    assert (ours - ref).abs().max() <= YARDSTICK * (ref - fp32).abs().max()
    assert (ours - fp32).abs().max() > 1e-5


# ----------------------------------------------------------------------------- config


def _config(tmp_path, *overrides):
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, ROOT / "megapo/configs/tiny_moe_addition.yaml",
                       [f"train.output_dir={tmp_path / 'run'}", "model.path=" + str(tmp_path / "m"), *overrides],
                       validate=False)


@pytest.mark.parametrize("overrides, field, words", [
    (["train.precision=fp64"], "train.precision", "fp32, bf16, fp16"),
    (["train.fp8=e5m2"], "train.fp8", "none, e4m3, hybrid"),
    (["train.fp8=hybrid"], "train.fp8", "precision=bf16"),
    (["train.precision=bf16", "train.fp8=hybrid", "train.fp8_recipe=nvfp4"], "train.fp8_recipe", "mxfp8"),
    (["train.precision=bf16", "train.fp8=e4m3"], "train.fp8", "Transformer Engine on a GPU"),
])
def test_precision_fields_are_refused_naming_the_field(tmp_path, monkeypatch, overrides, field, words):
    from megapo.config import ConfigError
    from megapo.learner import model

    monkeypatch.setattr(model, "detect_backend", lambda: model.Backend("cpu", "gloo", False))  # as on CPU machines
    cfg = _config(tmp_path, *overrides)
    with pytest.raises(ConfigError) as err:
        cfg._validate_train()
    assert err.value.field == field and words in str(err.value)


def test_parallel_fp8_moved_to_train_fp8(tmp_path):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _config(tmp_path, "parallel.fp8=true")
    assert err.value.field == "parallel.fp8" and "train.fp8" in str(err.value)


def test_rollout_dtype_auto_follows_the_learner_precision(tmp_path):
    assert _config(tmp_path).rollout.compute_dtype("fp32") == "float32"  # the embedded engine's own default
    assert _config(tmp_path).rollout.compute_dtype("bf16") == "bfloat16"
    assert _config(tmp_path).rollout.compute_dtype("fp16") == "float16"
    assert _config(tmp_path, "rollout.dtype=float32").rollout.compute_dtype("bf16") == "float32"


def test_weight_sync_sends_a_half_precision_learners_dtype(tmp_path):
    """train.precision=bf16: the tensor transport hands the engine bf16 tensors (half of fp32's bytes), each the
    exact bf16 value of the learner's weight; fp32 sends fp32."""
    from megapo.trainer.fleet import sync_in_time
    from megapo.weights.transports import TensorTransport

    weights = {"a": torch.randn(4, 8).to(torch.bfloat16).float(), "b": torch.randn(16).to(torch.bfloat16).float()}

    class Learner:  # what sync_in_time reads of a learner: its full HF tensors (fp32 copies of bf16 parameters)
        def hf_state_dict(self):
            return ((n, t.clone()) for n, t in weights.items())

    class Engine:
        weight_version = 0

        def __init__(self):
            self.got = {}

        def pause(self):
            pass

        def resume(self):
            pass

        def update_weights(self, bucket, version):
            self.got.update(bucket)
            self.weight_version = version

    for precision, dtype, size in (("bf16", torch.bfloat16, 2), ("fp32", torch.float32, 4)):
        engine = Engine()
        out = sync_in_time(Learner(), engine, 1, _config(tmp_path, f"train.precision={precision}"), TensorTransport())
        assert out["sync/bytes"] == size * sum(t.numel() for t in weights.values())
        for name, tensor in weights.items():
            assert engine.got[name].dtype == dtype and torch.equal(engine.got[name].float(), tensor)
