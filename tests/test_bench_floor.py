"""The floor benchmark's own math (tools/bench/floor.py), against references written independently of it:
transformers' forward, the GSPO and GRPO formulas written out here, finite differences; and one end-to-end
step of `megapo bench floor` writing its JSON (nothing is timed here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tools.bench.floor import FloorMoE, floor_generate, grpo_advantages, gspo_loss, sequence_batch, sequence_logprobs

REPO = Path(__file__).resolve().parents[1]


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits_and_routes(hf, ids: torch.Tensor):
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    B, T = ids.shape
    routes = torch.stack([torch.topk(r.float(), k, -1).indices.view(B, T, k) for r in out.router_logits], 2)
    return out.logits.float(), routes


def test_floor_forward_matches_transformers(tiny_moe):
    floor, hf = FloorMoE.from_folder(tiny_moe), hf_model(tiny_moe)
    ids = torch.randint(0, 512, (3, 21), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_routes = hf_logits_and_routes(hf, ids)
    with torch.no_grad():
        logits, routes = floor(ids, torch.arange(21).expand(3, 21))
        # replaying transformers' own routes changes nothing
        replayed, _ = floor(ids, torch.arange(21).expand(3, 21), routes=ref_routes)
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert torch.equal(routes, ref_routes)
    assert (replayed - ref_logits).abs().max().item() < 1e-4


def test_floor_replay_routes_tokens_to_the_given_experts(tiny_moe):
    """Routes other than the router's own: the experts the floor computes are the given ones (a gradient reaches
    exactly those experts' weights), and the output differs from free routing."""
    floor = FloorMoE.from_folder(tiny_moe)
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(1))
    forced = torch.zeros(2, 6, floor.n_layers, floor.topk, dtype=torch.long)
    forced[..., 0], forced[..., 1] = 3, 5
    logits, used = floor(ids, torch.arange(6).expand(2, 6), routes=forced)
    assert torch.equal(used, forced)
    logits.sum().backward()
    for layer in floor.layers:
        touched = {e for e in range(floor.experts) if layer["gate_proj"].grad[e].abs().sum() > 0}
        assert touched == {3, 5}
    with torch.no_grad():
        free, _ = floor(ids, torch.arange(6).expand(2, 6))
    assert (free - logits.detach()).abs().max() > 1e-4


def test_floor_sampler_logprobs_and_routes_match_transformers(tiny_moe):
    """KV-cache generation with left padding and rows that stop early: every sample's log-probs and routes are
    transformers' on the full sequence."""
    floor, hf = FloorMoE.from_folder(tiny_moe), hf_model(tiny_moe)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26]]
    free = floor_generate(floor, prompts, 3, 8, stop_id=-1, temperature=1.0, gen=torch.Generator().manual_seed(0))
    stop_id = free[0][0].output[2]  # a token some samples draw: they stop there
    out = floor_generate(floor, prompts, 3, 8, stop_id=stop_id, temperature=1.0, gen=torch.Generator().manual_seed(0))
    assert any(s.stopped for g in out for s in g)
    for prompt, group in zip(prompts, out):
        assert len(group) == 3
        for s in group:
            assert s.stopped == (s.output[-1] == stop_id) and (s.stopped or len(s.output) == 8)
            assert stop_id not in s.output[:-1]
            seq = torch.tensor([prompt + s.output])
            logits, routes = hf_logits_and_routes(hf, seq)
            ref = torch.log_softmax(logits[0], -1)[len(prompt) - 1:-1].gather(1, torch.tensor(s.output)[:, None])
            assert np.allclose(s.logprobs, ref[:, 0].numpy(), atol=1e-4)
            assert torch.equal(s.routes, routes[0, :-1])


def test_floor_sampler_unpadded_prompts_and_a_reused_cache_match_transformers(tiny_moe):
    """Prompts of one length (no left padding: attention runs unmasked) and back-to-back calls of different
    sizes (the KV cache kept on the model is reused, then regrown): log-probs and routes are transformers'."""
    floor, hf = FloorMoE.from_folder(tiny_moe), hf_model(tiny_moe)
    gen = torch.Generator().manual_seed(3)
    for prompts, n, max_new in (([[5, 6, 7, 8], [30, 31, 32, 33]], 3, 6), ([[9, 10, 11, 12]], 2, 4),
                                ([[40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55], [1, 2, 3, 4, 5, 6]], 4, 7)):
        free = floor_generate(floor, prompts, n, max_new, stop_id=-1, temperature=1.0, gen=gen)
        stop_id = free[0][0].output[1]  # some rows stop early: the cache's running rows move to its front
        out = floor_generate(floor, prompts, n, max_new, stop_id=stop_id, temperature=1.0, gen=gen)
        for prompt, group in zip(prompts, out):
            for s in group:
                seq = torch.tensor([prompt + s.output])
                logits, routes = hf_logits_and_routes(hf, seq)
                ref = torch.log_softmax(logits[0], -1)[len(prompt) - 1:-1].gather(1, torch.tensor(s.output)[:, None])
                assert np.allclose(s.logprobs, ref[:, 0].numpy(), atol=1e-4)
                assert torch.equal(s.routes, routes[0, :-1])


def test_sequence_logprobs_match_transformers(tiny_moe):
    """The old-log-prob / train forward: right-padded sequences of several lengths, routes replayed."""
    floor, hf = FloorMoE.from_folder(tiny_moe), hf_model(tiny_moe)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 14, 5)]
    samples = []
    for q in seqs:
        _, routes = hf_logits_and_routes(hf, torch.tensor([q]))
        samples.append(type("S", (), {"prompt": q[:3], "output": q[3:], "routes": routes[0, :-1]})())
    batch = sequence_batch(samples)
    with torch.no_grad():
        logp = sequence_logprobs(floor, batch)
        # the train step's path: lm head and log-softmax at the response positions only
        assert (sequence_logprobs(floor, batch, response_only=True) - logp[batch[-1]]).abs().max() < 1e-6
    for i, q in enumerate(seqs):
        logits, _ = hf_logits_and_routes(hf, torch.tensor([q]))
        ref = torch.log_softmax(logits[0], -1)[:-1].gather(1, torch.tensor(q[1:])[:, None])[:, 0]
        assert (logp[i, :len(q) - 1] - ref).abs().max() < 1e-4
        assert batch[-1][i].tolist() == [False] * 2 + [True] * (len(q) - 3) + [False] * (batch[0].shape[1] - len(q) + 1)


def gspo_by_hand(logp, old, adv, lengths, eps_low, eps_high):
    """GSPO (Zheng et al. 2025) with seq-mean-token-mean: 1/S sum_i max(-A_i s_i, -A_i clip(s_i)),
    s_i = exp(1/|y_i| sum_t (logp - old))."""
    total = 0.0
    for i, n in enumerate(lengths):
        s = math.exp(sum(logp[i][t] - old[i][t] for t in range(n)) / n)
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        total += max(-adv[i] * s, -adv[i] * clipped)
    return total / len(lengths)


def test_gspo_loss_matches_the_formula_and_finite_differences():
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 5, 1, 4]
    S, T = len(lengths), 5
    mask = torch.tensor([[t < n for t in range(T)] for n in lengths], dtype=torch.float64)
    old = -torch.rand(S, T, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(S, T, generator=gen, dtype=torch.float64) * 0.3  # some sequences clip, some do not
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    eps = (0.05, 0.1)
    got = gspo_loss(logp * mask, old * mask, adv, mask, *eps).item()
    assert got == pytest.approx(gspo_by_hand(logp.tolist(), old.tolist(), adv.tolist(), lengths, *eps), rel=1e-12)
    # the gradient through the unclipped sequences, against finite differences
    x = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: gspo_loss(lp * mask, old * mask, adv, mask, *eps), (x,))


def test_grpo_advantages_match_the_formula():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    got = grpo_advantages(rewards, eps=1e-6)
    for g, row in enumerate(rewards.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        assert got[g].tolist() == pytest.approx([(r - mean) / (std + 1e-6) for r in row], rel=1e-6)


def test_bench_runs_one_step_and_writes_its_json(tiny_moe, tmp_path):
    """`megapo bench floor` end to end on a tiny model for one timed step; the step-0 check compares the floor's
    log-probs with megapo's learner (Megatron, engine routes replayed) on the same batch."""
    out = tmp_path / "floor.json"
    cmd = [sys.executable, "-m", "megapo.cli", "bench", "floor", "--out", str(out), "--steps", "1", "--warmup", "0",
           "--sampler-rounds", "1", "--paired-rounds", "1", "--work-dir", str(tmp_path / "work"),
           f"model.path={tiny_moe}", "sft.enabled=false",
           "data.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=4", "data.dynamic_sampling=false",
           "train.eval_every=0"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    check = result["step0_logprobs"]
    assert check["ok"] and check["max_abs_diff"] < 1e-4 and check["sequences"] == 16 and check["response_tokens"] > 0
    for side in ("floor", "megapo"):
        phases = result["phases_median_s"][side]
        assert all(phases[p] >= 0 for p in ("generate", "old_logp", "train", "sync", "step"))
        assert phases["generate"] > 0 and phases["train"] > 0
        assert len(result["generated_tokens"][side]) == 1 and 16 <= result["generated_tokens"][side][0] <= 64
    assert set(result["ratio_megapo_over_floor"]) >= {"generate", "old_logp", "train", "step"}
    assert result["sampler"]["floor_tokens_per_s"] > 0 and result["sampler"]["megapo_tokens_per_s"] > 0
    same = result["same_rollouts"]  # both sides trained once on the same round of megapo's rollouts
    assert same["rounds"] == 1 and len(same["per_round"]["floor"]) == len(same["per_round"]["megapo"]) == 1
    assert same["megapo_over_floor_train"] == pytest.approx(same["megapo_train_s"] / same["floor_train_s"])
    assert result["torch_threads"] >= 1 and len(result["load_avg_start"]) == 3 and len(result["git"]["commit"]) == 40


def test_bench_refuses_a_recipe_the_floor_does_not_implement(tmp_path):
    cmd = [sys.executable, "-m", "megapo.cli", "bench", "floor", "--out", str(tmp_path / "x.json"),
           "--work-dir", str(tmp_path / "work"), "algorithm.objective=ppo"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "algorithm.objective" in done.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "x.json").exists()
