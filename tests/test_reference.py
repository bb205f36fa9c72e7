"""The KL reference π_ref (megapo/learner/reference.py, algorithm.reference).

References: transformers' fp32 forward of the same HF weights (free routing, and forcing the replayed routes
with test_replay_layouts.hf_forced); the learner's log-probs on the same weights and routes before any update.
Layouts: TP=1 in one process; TP=2 x EP=2 and PP=2 in one launch of two gloo processes
(tests/distributed/reference_layouts.py).
The distillation teacher (megapo/trainer/distill.py builds it on the same frozen-model seam) in the same launches:
folders of other random weights than the student's, one of the student's MoE shape (it replays the student's
routes under r3) and one with 4 experts (it routes itself); reference: transformers on the teacher's folder.
A `megapo train` run with kl_coef > 0: KL 0 at step 1 (π_ref is the starting policy) and > 0 after updates.
Bad combinations refused at config time naming algorithm.reference.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_runs import run_layout_script  # noqa: E402
from test_replay_layouts import hf_forced, hf_model  # noqa: E402  (transformers forcing given routes)

from megapo.config import ConfigError, load_config  # noqa: E402
from megapo.trainer.config import RunConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "reference_layouts.py"
CONFIG = ROOT / "megapo/configs/tiny_moe_addition.yaml"
LAYOUTS = {1: {"tp1": dict(tp=1, pp=1, ep=1, dp=1)},
           2: {"tp2xep2": dict(tp=2, pp=1, ep=2, dp=1), "pp2": dict(tp=1, pp=2, ep=1, dp=1)}}
NAMES = [name for layouts in LAYOUTS.values() for name in layouts]
TOL = 1e-4
TEACHER_TOL = 1e-5  # issue 31: the teacher's log-probs equal transformers' in fp32 to 1e-5


def make_batch(vocab=512, layers=2, experts=8, topk=2, seed=0):
    """Samples of several lengths (so micro_batch_tokens=24 packs several micro-batches) and random routes."""
    rng = random.Random(seed)
    batch, routes = [], []
    for n, p in [(10, 4), (16, 6), (7, 3), (20, 10), (5, 2)]:
        batch.append(dict(tokens=[rng.randrange(vocab) for _ in range(n)], prompt_len=p, advantage=rng.uniform(-1, 1)))
        routes.append([[rng.sample(range(experts), topk) for _ in range(layers)] for _ in range(n - 1)])
    return batch, routes


@pytest.fixture(scope="module")
def runs(tiny_moe, tmp_path_factory):
    from family_checks import write_variant

    tmp = tmp_path_factory.mktemp("reference")
    batch, routes = make_batch()
    teachers = {"same_shape": write_variant(Path(tiny_moe), tmp / "teacher", seed=7),
                "four_experts": write_variant(Path(tiny_moe), tmp / "teacher4", seed=8, num_local_experts=4)}
    results = {}
    for world, layouts in LAYOUTS.items():
        spec = dict(model=str(tiny_moe), batch=batch, routes=routes, micro_batch_tokens=24,
                    layouts=list(layouts.values()), teachers={k: str(v) for k, v in teachers.items()})
        saved = run_layout_script(SCRIPT, spec, world, tmp)
        results.update(zip(layouts, saved.values()))  # in layout order
    return dict(results=results, batch=batch, routes=routes, model=tiny_moe, teachers=teachers)


def _close(got, want, tol=TOL):
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        assert (torch.tensor(g) - torch.as_tensor(w)).abs().max().item() < tol


@pytest.mark.parametrize("layout", NAMES)
def test_megatron_reference_matches_transformers_and_replays_routes(runs, layout):
    r, batch, routes = runs["results"][layout], runs["batch"], runs["routes"]
    model = hf_model(runs["model"])
    with torch.no_grad():
        free = [hf_forced(model, s["tokens"])[0][s["prompt_len"] - 1:] for s in batch]
        forced = [hf_forced(model, s["tokens"], np.asarray(rt))[0][s["prompt_len"] - 1:] for s, rt in zip(batch, routes)]
    _close(r["free"], free)
    _close(r["replayed"], forced)  # the routes were applied: transformers forced onto them agrees...
    assert max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(r["replayed"], r["free"])) > 1e-2
    # ...and so does the learner replaying them on the same (starting) weights
    _close(r["replayed"], r["learner_replayed"])
    assert r["rng_kept"]  # building it left torch's generator where the learner had it


@pytest.mark.parametrize("layout", NAMES)
def test_megatron_reference_stays_frozen(runs, layout):
    r = runs["results"][layout]
    assert r["after"]["reference"] == r["free"]  # the learner's update did not reach it
    moved = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(r["after"]["learner"], r["free"]))
    assert moved > 1e-4  # the learner did move
    f = r["frozen"]
    assert not f["requires_grad"] and not f["grads"] and not f["optimizer"] and f["train_refused"]
    assert f["numel"] == f["learner_numel"]  # this rank's shard of the model, as the learner's


@pytest.fixture(scope="module")
def teacher_references(runs):
    """transformers on each teacher's folder: free log-probs, and forced onto the batch's routes where the teacher
    has the student's MoE shape (it replays the student's routes; the 4-expert one routes itself)."""
    out = {}
    for name, folder in runs["teachers"].items():
        model, replays = hf_model(folder), name == "same_shape"
        with torch.no_grad():
            free = [hf_forced(model, s["tokens"])[0][s["prompt_len"] - 1:] for s in runs["batch"]]
            forced = [hf_forced(model, s["tokens"], np.asarray(rt))[0][s["prompt_len"] - 1:]
                      for s, rt in zip(runs["batch"], runs["routes"])] if replays else free
            full = [torch.log_softmax(model(torch.tensor([s["tokens"]])).logits[0].float(), -1)[s["prompt_len"] - 1:-1]
                    for s in runs["batch"]]
        out[name] = dict(free=free, replayed=forced, replays=replays,
                         topk=[(ids, logp) for logp, ids in (f.topk(5, dim=-1) for f in full)])
    return out


@pytest.mark.parametrize("layout", NAMES)
def test_teacher_logprobs_match_transformers_on_the_teachers_folder(runs, teacher_references, layout):
    r = runs["results"][layout]
    for name, want in teacher_references.items():
        got = r["teachers"][name]
        assert got["replays"] == want["replays"], name
        _close(got["free"], want["free"], TEACHER_TOL)
        _close(got["replayed"], want["replayed"], TEACHER_TOL)
        if want["replays"]:  # the routes were applied: they move the log-probs away from free routing
            assert max((torch.tensor(a) - torch.tensor(b)).abs().max().item()
                       for a, b in zip(got["replayed"], got["free"])) > 1e-2
        # the teacher's own weights, not the student's: far from the student's log-probs
        assert max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(got["free"], r["free"])) > 1e-2
        # its top-k (topk_forward_kl): transformers' top 5 of the full log_softmax, ids and log-probs, in every layout
        for (ids, logp), (want_ids, want_logp) in zip(got["topk"], want["topk"], strict=True):
            assert torch.equal(torch.tensor(ids), want_ids), name
            assert (torch.tensor(logp) - want_logp).abs().max().item() < TEACHER_TOL


def test_train_with_kl_reference_is_zero_at_step_1_then_positive(tmp_path, tiny_moe):
    (tmp_path / "ref_parity_reward.py").write_text(
        "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megapo.cli", "train", str(CONFIG), f"model.path={tiny_moe}", "sft.enabled=false",
           f"train.output_dir={out}", "train.steps=2", "train.eval_every=0", "train.ckpt_every=0", "train.log=[jsonl]",
           "data.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=6", "data.dynamic_sampling=false",
           "data.reward=ref_parity_reward:parity", "data.truncated_reward=null", "optim.lr=0.01",
           "optim.warmup_steps=0", "algorithm.kl_coef=0.05"]  # routing_replay r3 (the config's): auto = megatron
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "KL reference: megatron (algorithm.reference=auto)" in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["kl"] == rows[0]["train/kl"]
    assert abs(rows[0]["kl"]) < 1e-7  # π_θ = π_ref at step 1 (same weights, same routes)
    assert all(r["kl"] > 1e-6 for r in rows[1:])  # the updates moved π_θ away from π_ref
    assert rows[0]["time/ref_logp"] > 0


def _cfg(model, **over) -> RunConfig:
    items = {"model.path": str(model), "algorithm.routing_replay": "off", "rollout.n_samples": 4,
             "rollout.max_new_tokens": 8, "data.task": "addition", "data.max_prompt_tokens": 16,
             "data.prompts_per_step": 4, "train.output_dir": "/tmp/unused_reference", "algorithm.kl_coef": 0.1}
    items.update(over)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in items.items()])


def test_auto_rule(tiny_moe):
    from megapo.layout import read_hf_config

    hf = read_hf_config(tiny_moe)
    on_gpu = torch.cuda.is_available()
    assert _cfg(tiny_moe).reference(hf) == ("megatron" if on_gpu else "plain")  # one CPU process, no replay
    assert _cfg(tiny_moe, **{"algorithm.routing_replay": "r3"}).reference(hf) == "megatron"
    assert _cfg(tiny_moe, **{"parallel.dp": 2}).reference(hf) == "megatron"
    assert _cfg(tiny_moe, **{"algorithm.reference": "megatron"}).reference(hf) == "megatron"
    assert _cfg(tiny_moe, **{"algorithm.reference": "plain"}).reference(hf) == "plain"
    assert _cfg(tiny_moe, **{"algorithm.kl_coef": 0.0}).algorithm.needs_reference() is False


@pytest.mark.parametrize("over, words", [
    ({"algorithm.reference": "frozen"}, ["auto, megatron, plain", "'frozen'"]),
    ({"algorithm.reference": "megatron", "algorithm.kl_coef": 0.0}, ["kl_coef is 0"]),
    ({"algorithm.reference": "plain", "parallel.dp": 2}, ["= 2 processes", "megatron"]),
    ({"algorithm.reference": "plain", "algorithm.routing_replay": "r3"}, ["routing_replay=r3", "megatron"]),
], ids=["unknown", "unused", "plain-multi-process", "plain-replay"])
def test_bad_reference_refused_naming_the_field(tiny_moe, over, words):
    with pytest.raises(ConfigError) as err:
        _cfg(tiny_moe, **over)
    assert err.value.field == "algorithm.reference"
    for w in words:
        assert w in err.value.message
