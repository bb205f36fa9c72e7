"""`megapo bench mismatch`: the train-inference mismatch of real precision pairs (no injected noise), on tiny
Qwen3-MoE models with more experts and depth: router disagreement and log-prob gaps, with and without R3.

    megapo bench mismatch --out benchmarks/results/mismatch [--quick] [--models a,b] [--pairs auto|all|key|fp32/bf16,..]
                          [--prompts 64] [--samples 2] [--max-new 48] [--threads 1] [--report-only]

Models: megapo.models.tiny.write_tiny_model, random init, hidden 64 (MODELS; by default FULL_MODELS, 8 experts top-2 x
2 layers up to 128 experts top-8 x 48 layers; all 9 precision pairs, KEY_PAIRS only on the 24- and 48-layer ones;
--quick: the 2-layer model and a few tokens). For each model and each engine precision
(fp32 / bf16 / fp16), the embedded engine (megapo.engines.embedded, KV cache) samples ONE batch: --prompts random
token prompts of --prompt-len tokens x --samples samples x --max-new new tokens, temperature 1, no stop token, the
same sampling seed for every engine precision, with its per-token log-probs and routes (top-k expert ids of every
MoE layer at every fed position). Each learner precision (megapo.learner.Learner with Precision fp32 / bf16 / fp16,
routing_replay=True: Megatron-core, bf16/fp16 through Float16Module with the router in fp32) then scores that same
batch twice (megapo.replay.modes.logprobs_with_routes): free routing (R3 off: its own routes) and replaying the
engine's routes (R3 on). Per (model, learner precision, engine precision), over the batch:

- disagree: fraction of (position, MoE layer) decisions whose top-k expert SETS differ between the engine's routes
  and the learner's own (megapo.replay.modes.route_disagreement, the trainer's router/disagree); all fed positions
  (prompt and response; `response` has the response positions only); per layer in the JSON;
- disagree_any: fraction of positions where at least one MoE layer's set differs (router/disagree_any);
- with R3 on: the same comparison with the routes the learner used (must be 0) and the hook's replay/disagree_pre
  (at each layer, the learner's own top-k given the replayed upstream layers vs the replayed route: the local,
  non-compounded share of near-ties);
- mean, max and RMS |Δlogp| and k3 over the sampled (response) tokens, with d = logp_learner - logp_engine:
  k3 = mean(exp(d) - 1 - d), an estimate of KL(engine || learner) - the direction megapo's own mismatch metrics
  use (megapo.replay.modes.engine_mismatch: ρ = π/μ, k3 = mean(ρ - 1 - log ρ)); each with R3 off and on.

Router peakedness (random-init routers are near uniform; trained ones are not): per model, from the fp32 engine's
routers on its batch: the top-k softmax mass (uniform routing gives k / experts), the gap between the k-th and
(k+1)-th router logit relative to the logit spread over experts. With the `e8k2-l2-sft` model the main job's
SFT warm start (megapo.trainer.sft, the main job's settings) is measured too: a (lightly) trained router.

Published GPU figures (issue 30) go into the same table as reference rows, marked as published, not measured here.
Single process, torch threads --threads (1 by default: on a loaded 2-core machine two threads were 5-40x slower).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PRECISIONS = ("fp32", "bf16", "fp16")
ENGINE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
WIDTH = dict(hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, moe_ffn=128, vocab=512)
# the minimum set of (learner, engine) pairs, run on the deepest models (the others run all 9)
KEY_PAIRS = (("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"))
# name -> tiny Qwen3-MoE shape (WIDTH above); sft: the main job's SFT warm start first (a dict: its sft overrides);
# pairs "key": KEY_PAIRS unless --pairs says otherwise
MODELS = {
    "e8k2-l2": dict(layers=2, experts=8, topk=2, note="the main job's model (tiny_moe_addition.yaml)"),
    "e8k2-l2-sft": dict(layers=2, experts=8, topk=2, sft={},
                        note="the main job's model after its SFT warm start (3-digit addition): a trained router"),
    "e16k2-l4": dict(layers=4, experts=16, topk=2, note="the stability study's model (stability_base.yaml)"),
    "e64k8-l8": dict(layers=8, experts=64, topk=8, note="64 experts top-8, 8 layers"),
    "e128k8-l12": dict(layers=12, experts=128, topk=8, note="128 experts top-8 (Qwen3-30B-A3B's router), 12 layers"),
    "e128k8-l24": dict(layers=24, experts=128, topk=8, pairs="key", note="128 experts top-8, 24 layers"),
    "e128k8-l48": dict(layers=48, experts=128, topk=8, pairs="key",
                       note="128 experts top-8, 48 layers: Qwen3-30B-A3B's router and depth at hidden 64"),
    # not in the default set (cost): a wider expert count, and a lightly trained 128-expert router (SFT ~6 min)
    "e256k8-l24": dict(layers=24, experts=256, topk=8, pairs="key",
                       note="256 experts top-8 (DeepSeek-V3's count, softmax router), 24 layers"),
    "e128k8-l12-sft": dict(layers=12, experts=128, topk=8, sft={"max_steps": 200},
                           note="e128k8-l12 after 200 steps of the main job's SFT warm start"),
}
FULL_MODELS = ("e8k2-l2", "e8k2-l2-sft", "e16k2-l4", "e64k8-l8", "e128k8-l12", "e128k8-l24", "e128k8-l48")
QUICK_MODELS = ("e8k2-l2",)
FULL = dict(prompts=64, samples=2, max_new=48, prompt_len=16)
QUICK = dict(prompts=6, samples=2, max_new=8, prompt_len=8)

# Published GPU figures quoted by issue 30: reference rows, not measured here. Keys are the table's columns.
PUBLISHED = [
    dict(source="Megatron-LM issue 4168", setting="MoE RL on GPU, bf16 (baseline runs: 3 of 3 collapsed, 0 of 3 "
         "with R3)", disagree=0.10, disagree_any=0.94, approx=True),
    dict(source="miles issue 2722", setting="bf16 actor", mean_abs_off=0.369, mean_abs_r3=0.041),
    dict(source="Fast-LLM PR 525", setting="production bf16", rms=0.031, rms_note="RMS log-prob gap"),
    dict(source="Fast-LLM PR 525", setting="fp32", rms=0.0022, rms_note="RMS log-prob gap"),
    dict(source="prime-rl PR 2808", setting="Qwen3-30B-A3B", k3_off=0.0015, k3_r3=0.0005,
         k3_note="their mismatch KL"),
]


# ----------------------------------------------------------------------------- metrics (pure functions)


def logp_gap(engine_logp, learner_logp) -> dict[str, float]:
    """Per-token gap of the learner's log-probs to the engine's, d = learner - engine, over the tokens given
    (flat arrays): mean |d|, max |d|, RMS d, and k3 = mean(exp(d) - 1 - d) (an estimate of KL(engine || learner),
    megapo.replay.modes.engine_mismatch's direction). float64."""
    mu = np.asarray(engine_logp, dtype=np.float64).reshape(-1)
    pi = np.asarray(learner_logp, dtype=np.float64).reshape(-1)
    if mu.shape != pi.shape:
        raise ValueError(f"learner_logp: {pi.size} log-probs for {mu.size} engine log-probs")
    if mu.size == 0:
        raise ValueError("no tokens to compare")
    d = pi - mu
    return {"mean_abs": float(np.abs(d).mean()), "max_abs": float(np.abs(d).max()),
            "rms": float(np.sqrt((d * d).mean())), "k3": float(np.mean(np.expm1(d) - d)),
            "mean_signed": float(d.mean()), "tokens": int(d.size)}


def disagreement(engine_routes: list, learner_routes: list, prompt_lens: list[int] | None = None) -> dict:
    """Route disagreement of the same sequences (int [positions, MoE layers, k] each): megapo's own
    route_disagreement over all fed positions (disagree, disagree_any, per layer), and with `prompt_lens` the same
    over the response positions only (a sequence's fed positions prompt_len - 1 .. end predict its response)."""
    from megapo.replay.modes import route_disagreement

    every = route_disagreement(engine_routes, learner_routes, prefix="")
    out = {"disagree": every["disagree"], "disagree_any": every["disagree_any"],
           "per_layer": [every[f"disagree_l{i}"] for i in range(sum(k.startswith("disagree_l") for k in every))],
           "decisions": int(sum(np.asarray(r).shape[0] * np.asarray(r).shape[1] for r in engine_routes)),
           "positions": int(sum(np.asarray(r).shape[0] for r in engine_routes))}
    if prompt_lens is not None:
        tail = route_disagreement([np.asarray(e)[p - 1:] for e, p in zip(engine_routes, prompt_lens)],
                                  [np.asarray(o)[p - 1:] for o, p in zip(learner_routes, prompt_lens)], prefix="")
        out["response"] = {"disagree": tail["disagree"], "disagree_any": tail["disagree_any"]}
    return out


def router_stats(logits, topk: int) -> dict[str, float]:
    """How peaked a router is, from its logits [N, experts] (float): the mean top-k softmax mass (uniform: k / E),
    the median of (k-th - (k+1)-th largest logit) / the logit std over experts, and the share of decisions whose
    k-th / (k+1)-th gap is under 1 % of that std (near-ties)."""
    x = np.asarray(logits, dtype=np.float64)
    experts = x.shape[-1]
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = -np.sort(-x, axis=-1)
    mass = -np.sort(-p, axis=-1)[:, :topk].sum(-1)
    std = x.std(-1)
    rel = (top[:, topk - 1] - top[:, topk]) / np.maximum(std, 1e-30) if topk < experts else np.full(len(x), np.inf)
    return {"topk_mass": float(mass.mean()), "topk_mass_uniform": topk / experts,
            "logit_std": float(std.mean()), "gap_k_over_std_median": float(np.median(rel)),
            "near_tie_share": float((rel < 0.01).mean()), "decisions": int(len(x))}


# ----------------------------------------------------------------------------- measuring


def write_model(out: Path, shape: dict, seed: int = 0) -> Path:
    from megapo.models.tiny import write_tiny_model

    return write_tiny_model(out, "qwen3_moe", layers=shape["layers"], experts=shape["experts"], topk=shape["topk"],
                            seed=seed, **WIDTH)


def warm_start(model: Path, out: Path, overrides: dict | None = None) -> dict:
    """The main job's SFT warm start (megapo/configs/tiny_moe_addition.yaml's sft section, `overrides` on it) of
    `model` -> `out`."""
    from dataclasses import replace

    from megapo.config import load_config
    from megapo.trainer.config import RunConfig
    from megapo.trainer.sft import train_sft

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(RunConfig, str(root / "megapo" / "configs" / "tiny_moe_addition.yaml"), [])
    from megapo.tasks.registry import get_task

    sft = replace(cfg.sft, **(overrides or {}))
    result = train_sft(model, out, sft, get_task(cfg.data.task, cfg.data.task_options), cfg.data.chat_template,
                       cfg.rollout.max_new_tokens)
    return {"steps": result.steps, "val_accuracy": result.val_accuracy, "reached": result.reached,
            "threshold": sft.threshold, "seconds": result.seconds,
            "overrides": overrides or {}}


def sample_batch(model: Path, precision: str, prompts: list[list[int]], samples: int, max_new: int, seed: int):
    """One batch from the embedded engine in `precision`: list of dicts tokens, prompt_len, rollout_logp (per response
    token), engine_routes ([len(tokens) - 1, L, k]); and the generate wall seconds."""
    import torch

    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model, dtype=getattr(torch, ENGINE_DTYPE[precision]), seed=seed)
    start = time.perf_counter()
    groups = engine.generate(prompts, SamplingParams(n=samples, max_new_tokens=max_new, temperature=1.0,
                                                     return_routes=True, seed=seed))
    seconds = time.perf_counter() - start
    batch = [dict(tokens=s.prompt_ids + s.output_ids, prompt_len=len(s.prompt_ids), rollout_logp=list(s.logprobs),
                  engine_routes=np.asarray(s.routes)) for g in groups for s in g]
    engine.close()
    return batch, seconds


def engine_router_logits(model: Path, batch: list[dict]) -> list[np.ndarray]:
    """Every MoE layer's router logits (fp32 engine) at the batch's fed positions, one [N, experts] array per layer:
    a prefill of the sequences (all of one length: no padding) through the embedded engine, its router wrapped."""
    import torch
    import torch.nn.functional as F

    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model, dtype=torch.float32, seed=0)
    lm = engine.model
    original, captured = lm._route, []

    def route(h, layer, noise=None):
        captured.append(F.linear(h, layer["router"], layer.get("router_bias")).float().detach().clone())
        return original(h, layer, noise)

    lm._route = route
    sequences = [list(s["tokens"][:-1]) for s in batch]
    length = min(len(s) for s in sequences)
    engine.generate([s[:length] for s in sequences], SamplingParams(n=1, max_new_tokens=1, temperature=1.0, seed=0))
    engine.close()
    layers, experts = engine.spec.num_moe_layers, engine.spec.experts
    prefill = captured[:layers]  # the prefill's pass (max_new_tokens=1: no decode step), one per MoE layer
    return [t.reshape(-1, experts).numpy() for t in prefill]


def learner_passes(learner, batch: list[dict]) -> dict:
    """The learner's two passes over the batch: free routing and R3 (the engine's routes replayed)."""
    from megapo.replay import modes

    sequences = [list(s["tokens"]) for s in batch]
    start = time.perf_counter()
    free, own, _ = modes.logprobs_with_routes(learner, sequences, None)
    r3, used, hook = modes.logprobs_with_routes(learner, sequences, [s["engine_routes"] for s in batch])
    seconds = time.perf_counter() - start

    def response(full):
        return np.concatenate([lp[s["prompt_len"] - 1:].double().numpy() for lp, s in zip(full, batch)])

    return {"free": response(free), "own_routes": own, "r3": response(r3), "used_routes": used, "hook": hook,
            "seconds": seconds}


def pair_result(batch: list[dict], passes: dict) -> dict:
    """The metrics of one (model, learner precision, engine precision) pair."""
    from megapo.replay.modes import engine_mismatch

    engine_logp = np.concatenate([np.asarray(s["rollout_logp"], dtype=np.float64) for s in batch])
    engine_routes = [s["engine_routes"] for s in batch]
    prompt_lens = [s["prompt_len"] for s in batch]
    free = disagreement(engine_routes, passes["own_routes"], prompt_lens)
    after = disagreement(engine_routes, passes["used_routes"])
    hook = passes["hook"]
    layers = len(free["per_layer"])
    off, r3 = logp_gap(engine_logp, passes["free"]), logp_gap(engine_logp, passes["r3"])
    # megapo's own k3 (modes.engine_mismatch) on the same arrays: a cross-check of logp_gap's direction
    split = np.cumsum([len(s["rollout_logp"]) for s in batch])[:-1]
    megapo_k3 = engine_mismatch(batch, np.split(passes["free"], split))["k3"]
    return {
        "disagree": free["disagree"], "disagree_any": free["disagree_any"], "disagree_per_layer": free["per_layer"],
        "disagree_response": free["response"], "decisions": free["decisions"], "positions": free["positions"],
        "r3_disagree_after_replay": after["disagree"], "r3_disagree_any_after_replay": after["disagree_any"],
        "r3_hook_disagree_post": hook.get("replay/disagree_post"),
        "r3_own_choice_disagree": hook.get("replay/disagree_pre"),
        "r3_own_choice_disagree_per_layer": [hook.get(f"replay/disagree_pre/layer{i}") for i in range(layers)],
        "off": off, "r3": r3, "k3_off_megapo_engine_mismatch": megapo_k3, "learner_passes_s": passes["seconds"],
    }


def measure_model(name: str, shape: dict, work: Path, pairs: list[tuple[str, str]], settings: dict, seed: int,
                  log=print) -> dict:
    """Every pair of `pairs` (learner precision, engine precision) on model `name`: one engine batch per engine
    precision, one learner per learner precision scoring every batch."""
    from megapo.config import ParallelConfig
    from megapo.learner.learner import Learner
    from megapo.learner.precision import Precision

    start = time.perf_counter()
    model = write_model(work / name, shape, seed=0)
    out = {"shape": {k: v for k, v in shape.items() if k not in ("note", "sft", "pairs")},
           "note": shape.get("note", ""), "width": WIDTH}
    if shape.get("sft") is not None:
        out["sft"] = warm_start(model, work / f"{name}-warm", shape["sft"])
        model = work / f"{name}-warm"
    from megapo.layout import read_hf_config

    params = None
    try:
        from safetensors import safe_open

        params = 0
        for f in model.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                params += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())
    except Exception:  # noqa: BLE001 (a description only)
        pass
    out["params"] = params
    out["hf_config"] = {k: read_hf_config(model).get(k) for k in ("num_hidden_layers", "num_local_experts",
                                                                  "num_experts_per_tok", "hidden_size",
                                                                  "moe_intermediate_size", "vocab_size")}
    rng = random.Random(seed)
    vocab = int(read_hf_config(model)["vocab_size"])
    prompts = [[rng.randrange(3, vocab) for _ in range(settings["prompt_len"])] for _ in range(settings["prompts"])]
    engines = sorted({e for _, e in pairs}, key=PRECISIONS.index)
    batches, gen_s = {}, {}
    for e in engines:
        batches[e], gen_s[e] = sample_batch(model, e, prompts, settings["samples"], settings["max_new"], seed)
        log(f"  {name}: engine {e} sampled {len(batches[e])} x {settings['max_new']} tokens in {gen_s[e]:.1f} s")
    out["generate_s"] = gen_s
    # how flat the policy is: a random-init model samples near the uniform log-prob -ln(vocab)
    out["mean_sampled_logp"] = {e: float(np.mean([x for s in b for x in s["rollout_logp"]]))
                                for e, b in batches.items()}
    out["uniform_logp"] = -float(np.log(vocab))
    # how much the engines' batches share: fraction of response tokens equal at the same place as the fp32 one's
    ref = batches.get("fp32")
    if ref is not None:
        out["same_tokens_as_fp32_engine"] = {
            e: float(np.mean([a == b for x, y in zip(ref, b_) for a, b in
                              zip(x["tokens"][x["prompt_len"]:], y["tokens"][y["prompt_len"]:])]))
            for e, b_ in batches.items()}
    try:
        logits = engine_router_logits(model, batches.get("fp32") or next(iter(batches.values())))
        per_layer = [router_stats(x, shape["topk"]) for x in logits]
        out["router"] = {k: float(np.mean([p[k] for p in per_layer])) for k in per_layer[0]}
        out["router"]["per_layer"] = per_layer
    except Exception as err:  # noqa: BLE001 (a description only: the engine's internals may change)
        out["router"] = {"error": repr(err)}
    out["pairs"] = {}
    for lp in sorted({l for l, _ in pairs}, key=PRECISIONS.index):
        t0 = time.perf_counter()
        learner = Learner(model, ParallelConfig(), precision=Precision(lp), routing_replay=True,
                          micro_batch_tokens=8192)
        build_s = time.perf_counter() - t0
        for l_, e in pairs:
            if l_ != lp:
                continue
            r = pair_result(batches[e], learner_passes(learner, batches[e]))
            r["learner_build_s"] = build_s
            out["pairs"][f"{lp}/{e}"] = r
            log(f"  {name} learner {lp} engine {e}: disagree {r['disagree']:.4f} any {r['disagree_any']:.3f} "
                f"mean|dlogp| {r['off']['mean_abs']:.2e}/{r['r3']['mean_abs']:.2e} k3 {r['off']['k3']:.2e}/"
                f"{r['r3']['k3']:.2e} after R3 {r['r3_disagree_after_replay']:.4f}")
        del learner
        gc.collect()
    out["wall_s"] = time.perf_counter() - start
    return out


# ----------------------------------------------------------------------------- report


def target(models: dict) -> dict:
    """Issue 30's target: >= 10 % decision disagreement and >= 50 % of tokens with a differing layer in one real
    setting. The best pair by disagree (and whether any pair reaches both)."""
    rows = [(m, p, r) for m, v in models.items() for p, r in v["pairs"].items()]
    if not rows:
        return {}
    m, p, r = max(rows, key=lambda t: t[2]["disagree"])
    both = [(m_, p_) for m_, p_, r_ in rows if r_["disagree"] >= 0.10 and r_["disagree_any"] >= 0.50]
    any_half = [(m_, p_) for m_, p_, r_ in rows if r_["disagree_any"] >= 0.50]
    return {"reached": bool(both), "settings_reaching_both": [f"{a} {b}" for a, b in both],
            "settings_with_any_ge_50pct": [f"{a} {b}" for a, b in any_half],
            "max_disagree": {"model": m, "pair": p, "disagree": r["disagree"], "disagree_any": r["disagree_any"]}}


def fmt(x, digits=3) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    if abs(x) < 10 ** -digits or abs(x) >= 1000:
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.2f} %" if x < 0.1 else f"{100 * x:.1f} %"


def table(report: dict) -> str:
    head = ("| model | learner | engine | disagree | disagree_any | mean\\|Δlogp\\| off / R3 | "
            "max\\|Δlogp\\| off / R3 | RMS Δlogp off / R3 | k3 off / R3 |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, m in report["models"].items():
        for pair, r in m["pairs"].items():
            lp, ep = pair.split("/")
            o, q = r["off"], r["r3"]
            cells = [f"{fmt(o[k], d)} / {fmt(q[k], d)}" for k, d in (("mean_abs", 4), ("max_abs", 3), ("rms", 4),
                                                                     ("k3", 4))]
            lines.append(f"| {name} | {lp} | {ep} | {pct(r['disagree'])} | {pct(r['disagree_any'])} | "
                         + " | ".join(cells) + " |")
    for p in PUBLISHED:
        approx = "≈" if p.get("approx") else ""
        mean = (f"{p['mean_abs_off']} / {p['mean_abs_r3']}" if "mean_abs_off" in p else "—")
        rms = f"{p['rms']} ({p['rms_note']}, replay not stated)" if "rms" in p else "—"
        k3 = f"{p['k3_off']} / {p['k3_r3']} ({p['k3_note']})" if "k3_off" in p else "—"
        dis = [approx + pct(p[k]) if k in p else "—" for k in ("disagree", "disagree_any")]
        lines.append(f"| **published, not measured here**: {p['source']} | {p['setting']} | GPU | "
                     f"{dis[0]} | {dis[1]} | {mean} | — | {rms} | {k3} |")
    return head + "\n".join(lines) + "\n"


def router_table(report: dict) -> str:
    rows = ["| model | top-k softmax mass (uniform) | median gap k/k+1 ÷ logit std | near-ties (< 1 % of std) |",
            "|---|---|---|---|"]
    for name, m in report["models"].items():
        r = m.get("router", {})
        if "topk_mass" in r:
            rows.append(f"| {name} | {r['topk_mass']:.3f} ({r['topk_mass_uniform']:.3f}) | "
                        f"{r['gap_k_over_std_median']:.3f} | {pct(r['near_tie_share'])} |")
    return "\n".join(rows) + "\n"


def ratio(a, b) -> str:
    return "—" if not b else f"{a / b:.1f}×"


def notes(report: dict) -> str:
    """The findings, written from the numbers of this run."""
    models, out = report["models"], []
    t = report.get("target") or {}
    if t:
        best = t["max_disagree"]
        out.append(f"- Target (≥ 10 % of decisions and ≥ 50 % of tokens in one real setting): "
                   f"{'reached' if t['reached'] else 'not reached'}"
                   + (f" by {', '.join(t['settings_reaching_both'])}" if t["reached"] else "")
                   + f". Highest decision disagreement: {pct(best['disagree'])} ({pct(best['disagree_any'])} of "
                   f"tokens), {best['model']} learner/engine {best['pair']}. ≥ 50 % of tokens with a differing "
                   f"layer: "
                   f"{', '.join(t['settings_with_any_ge_50pct']) or 'none'}.")
    for name, m in models.items():
        p = m["pairs"]
        bits = [f"{k} {pct(p[k]['disagree'])} / {pct(p[k]['disagree_any'])}"
                for k in ("fp32/bf16", "bf16/fp32", "bf16/bf16", "fp16/fp16", "fp32/fp32") if k in p]
        if not bits:
            continue
        key = "fp32/bf16" if "fp32/bf16" in p else next(iter(p))
        layers, own = p[key]["disagree_per_layer"], p[key].get("r3_own_choice_disagree")
        line = (f"- {name}, {m['note']}: decisions / tokens differing, " + "; ".join(bits)
                + f". Per layer ({key}): first {pct(layers[0])}, last {pct(layers[-1])}")
        if own is not None:
            line += (f"; with the upstream layers replayed (R3) the learner's own top-k still differs from the "
                     f"engine's in {pct(own)} of decisions (no upstream flip to compound; the rounding of the hidden "
                     f"states still accumulates with depth)")
        r = m.get("router", {})
        if "topk_mass" in r:
            line += (f". Router: top-{m['shape']['topk']} mass {r['topk_mass']:.3f} (uniform "
                     f"{r['topk_mass_uniform']:.3f}), {pct(r['near_tie_share'])} of decisions with a k / k+1 gap under "
                     f"1 % of the logit spread")
        out.append(line + ".")
    half = [(n, m["pairs"]["bf16/bf16"], m["pairs"]["fp16/fp16"]) for n, m in models.items()
            if "bf16/bf16" in m["pairs"] and "fp16/fp16" in m["pairs"]]
    if half:
        fewer = [n for n, b, f in half
                 if f["disagree"] <= b["disagree"] and f["off"]["mean_abs"] <= b["off"]["mean_abs"]]
        out.append("- fp16/fp16 against bf16/bf16 (arXiv 2510.26788's claim): decision disagreement "
                   + "; ".join(f"{n} {pct(f['disagree'])} vs {pct(b['disagree'])}" for n, b, f in half)
                   + "; mean |Δlogp| (off) " + "; ".join(f"{n} {fmt(f['off']['mean_abs'], 4)} vs "
                                                          f"{fmt(b['off']['mean_abs'], 4)}" for n, b, f in half)
                   + f". fp16 has at most bf16's disagreement and gap in {len(fewer)} of {len(half)} models"
                   + (f" (not in {', '.join(n for n, _, _ in half if n not in fewer)})" if len(fewer) < len(half)
                      else "") + ".")
    r3 = [(n, m["pairs"]["fp32/bf16"]) for n, m in models.items() if "fp32/bf16" in m["pairs"]]
    if r3:
        out.append("- R3 on the log-prob gap (fp32 learner, bf16 engine), off ÷ R3: k3 "
                   + "; ".join(f"{n} {ratio(r['off']['k3'], r['r3']['k3'])}" for n, r in r3)
                   + "; mean |Δlogp| " + "; ".join(f"{n} {ratio(r['off']['mean_abs'], r['r3']['mean_abs'])}"
                                                  for n, r in r3)
                   + ". With R3 the gap left is that of the same experts computed in two precisions.")
    flat = [(n, m["mean_sampled_logp"].get("bf16", next(iter(m["mean_sampled_logp"].values()))), m["uniform_logp"],
             m["pairs"].get("fp32/bf16")) for n, m in models.items() if "mean_sampled_logp" in m]
    if flat:
        out.append("- The log-prob gap against the published ones: mean sampled log-prob (bf16 engine) and mean "
                   "|Δlogp| off (fp32 learner, bf16 engine): "
                   + "; ".join(f"{n} {lp:.2f}, {fmt(r['off']['mean_abs'], 4) if r else '—'}" for n, lp, _, r in flat)
                   + f"; uniform sampling would give ln(1/vocab) = {flat[0][2]:.2f}. A random-init model's "
                   "next-token distribution is nearly uniform and its experts' outputs are small next to the residual "
                   "stream, so a flipped expert choice barely moves its logits: its router disagreement can reach the "
                   "GPU figures (it depends on near-ties between router scores) while its |Δlogp| cannot (it depends "
                   "on how much the experts and logits differ).")
    if "e8k2-l2" in models and "e8k2-l2-sft" in models:
        a, b = models["e8k2-l2"], models["e8k2-l2-sft"]
        key = "fp32/bf16"
        if key in a["pairs"] and key in b["pairs"] and "topk_mass" in a.get("router", {}) and \
                "topk_mass" in b.get("router", {}):
            x, y = a["pairs"][key], b["pairs"][key]
            out.append(f"- A trained router (e8k2-l2-sft, the main job's SFT warm start, {b['sft']['steps']} steps) "
                       f"against its random init (fp32 learner, bf16 engine): top-2 mass {a['router']['topk_mass']:.3f}"
                       f" → {b['router']['topk_mass']:.3f}, decisions differing {pct(x['disagree'])} → "
                       f"{pct(y['disagree'])}, mean |Δlogp| off {fmt(x['off']['mean_abs'], 4)} → "
                       f"{fmt(y['off']['mean_abs'], 4)}, k3 off {fmt(x['off']['k3'], 4)} → {fmt(y['off']['k3'], 4)}. "
                       f"The trained model's gaps, off / R3: mean |Δlogp| {fmt(y['off']['mean_abs'], 4)} / "
                       f"{fmt(y['r3']['mean_abs'], 4)}, RMS {fmt(y['off']['rms'], 4)} / {fmt(y['r3']['rms'], 4)}, k3 "
                       f"{fmt(y['off']['k3'], 4)} / {fmt(y['r3']['k3'], 4)}, max |Δlogp| {fmt(y['off']['max_abs'])} / "
                       f"{fmt(y['r3']['max_abs'])} (published on GPU: mean 0.369 / 0.041, RMS 0.031 in bf16, KL "
                       f"0.0015 / 0.0005): with {pct(y['disagree'])} of its decisions flipped, routing carries most "
                       f"of its k3 (R3 lowers it {ratio(y['off']['k3'], y['r3']['k3'])}).")
    after = [r["r3_disagree_after_replay"] for m in models.values() for r in m["pairs"].values()]
    if after:
        out.append(f"- With R3 on, the learner's routes equal the engine's in every pair (largest disagreement after "
                   f"replay: {max(after)}; the replay hook's replay/disagree_post agrees).")
    out.append("- Both sides route every token themselves: the embedded engine computes the router's linear layer in "
               "its own dtype (bf16 logits keep 8 significant bits, fp16 11), the Megatron learner in fp32 "
               "(moe_router_dtype=fp32) from weights stored in its precision. Sampled batches differ between "
               "engine precisions (same prompts and seed; same_tokens_as_fp32_engine in summary.json); each learner "
               "precision scores the same batch.")
    return "\n".join(out) + "\n"


def write_table(report: dict, path: Path) -> None:
    s = report["settings"]
    text = [
        "# Train-inference mismatch: learner × engine precision, tiny Qwen3-MoE models",
        "",
        f"`{report['command']}` ({report['wall_s']:.0f} s, {report['threads']} torch thread(s), load average "
        f"{report['load_avg_start'][0]:.1f} → {report['load_avg_end'][0]:.1f} on {report['machine']['cpu_count']} "
        f"CPU(s); tools/bench/mismatch.py). One engine batch per (model, engine precision): {s['prompts']} random "
        f"{s['prompt_len']}-token prompts × {s['samples']} samples × {s['max_new']} new tokens at temperature 1, "
        f"scored by each learner precision twice: free routing (off) and replaying the engine's routes (R3). Random "
        f"init (write_tiny_model, hidden {WIDTH['hidden']}) except `-sft` (the main job's SFT warm start).",
        "",
        "disagree: (position, MoE layer) decisions whose top-k expert set differs, engine vs the learner's own "
        "routing (all fed positions); disagree_any: positions with at least one MoE layer differing. Δlogp = "
        "logp_learner − logp_engine of each sampled token; k3 = mean(exp(Δ) − 1 − Δ), an estimate of "
        "KL(engine ‖ learner), the direction of megapo's mismatch/k3. With R3 on, disagreement is 0 by "
        "construction (checked: see the last note).",
        "",
        table(report),
        "Reference rows are published GPU figures quoted in issue 30, at production scale (not measured here, and "
        "not the same models); their columns are mapped as stated in the row.",
        "",
        "## Router peakedness (fp32 engine, on its batch)",
        "",
        router_table(report),
        "## Notes",
        "",
        notes(report),
    ]
    if report.get("notes_extra"):
        text += [report["notes_extra"], ""]
    path.write_text("\n".join(text))


# ----------------------------------------------------------------------------- command


def parse_pairs(value: str) -> list[tuple[str, str]] | None:
    """--pairs: None for auto (each model's own set), else the (learner, engine) pairs."""
    from megapo.config import ConfigError

    if value == "auto":
        return None
    if value == "key":
        return list(KEY_PAIRS)
    if value == "all":
        return [(lp, ep) for lp in PRECISIONS for ep in PRECISIONS]
    pairs = []
    for item in value.split(","):
        parts = item.strip().split("/")
        if len(parts) != 2 or any(p not in PRECISIONS for p in parts):
            raise ConfigError("--pairs", f"each pair is LEARNER/ENGINE of {', '.join(PRECISIONS)}, got {item!r}")
        pairs.append((parts[0], parts[1]))
    return pairs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder: summary.json and table.md are written there")
    p.add_argument("--quick", action="store_true", help="a small version (one 2-layer model, a few tokens): tests")
    p.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: "
                                                  f"{','.join(FULL_MODELS)}; --quick: {','.join(QUICK_MODELS)})")
    p.add_argument("--pairs", default="auto", help="LEARNER/ENGINE precisions, comma-separated (e.g. "
                                                  "fp32/bf16,bf16/bf16); all (the 9 pairs); key (" +
                   ",".join(f"{a}/{b}" for a, b in KEY_PAIRS) + "); auto (default): all, key on the deepest models")
    p.add_argument("--prompts", type=int, default=None, help=f"random prompts (default {FULL['prompts']}; "
                                                            f"--quick {QUICK['prompts']})")
    p.add_argument("--samples", type=int, default=None, help=f"samples per prompt (default {FULL['samples']})")
    p.add_argument("--max-new", type=int, default=None, help=f"new tokens per sample (default {FULL['max_new']})")
    p.add_argument("--prompt-len", type=int, default=None, help=f"tokens per prompt (default {FULL['prompt_len']})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own)")
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling seed")
    p.add_argument("--work-dir", default=None, help="where the tiny models go (default: a temporary folder)")
    p.add_argument("--report-only", action="store_true", help="rewrite DIR/table.md from DIR/summary.json, "
                                                              "measuring nothing")


def run(args: argparse.Namespace) -> int:
    from megapo.config import ConfigError

    if args.report_only:
        summary = Path(args.out) / "summary.json"
        if not summary.is_file():
            raise ConfigError("--out", f"{summary} does not exist (--report-only rewrites table.md from it)")
        report = json.loads(summary.read_text())
        write_table(report, Path(args.out) / "table.md")
        print(f"-> {Path(args.out) / 'table.md'}")
        return 0
    import torch

    base = QUICK if args.quick else FULL
    settings = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    for flag, key in (("--prompts", "prompts"), ("--samples", "samples"), ("--max-new", "max_new"),
                      ("--prompt-len", "prompt_len")):
        if settings[key] < 1:
            raise ConfigError(flag, f"must be >= 1, got {settings[key]}")
    if args.threads < 0:
        raise ConfigError("--threads", f"must be >= 0, got {args.threads}")
    names = [n.strip() for n in args.models.split(",") if n.strip()] if args.models else \
        list(QUICK_MODELS if args.quick else FULL_MODELS)
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        raise ConfigError("--models", f"choose from {', '.join(MODELS)}, got {args.models!r}")
    pairs = parse_pairs(args.pairs)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tools.bench.memory import git_commit, machine

    load_start, start = os.getloadavg(), time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = {}
    with tempfile.TemporaryDirectory(prefix="mismatch_") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            print(f"mismatch: {name} ({MODELS[name]['note']})", flush=True)
            own = pairs or (list(KEY_PAIRS) if MODELS[name].get("pairs") == "key" else parse_pairs("all"))
            models[name] = measure_model(name, MODELS[name], work, own, settings, args.seed)
    report = {
        "benchmark": "mismatch", "argv": sys.argv,
        "command": "megapo " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
        "git": git_commit(), "machine": machine(), "threads": args.threads or torch.get_num_threads(),
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "wall_s": time.perf_counter() - start,
        "quick": bool(args.quick), "settings": dict(settings, seed=args.seed, temperature=1.0,
                                                    prompts_kind="uniform random token ids in [3, vocab)",
                                                    stop_tokens="none (every sample has max_new tokens)"),
        "pairs": {name: list(m["pairs"]) for name, m in models.items()},
        "definitions": {
            "disagree": "fraction of (fed position, MoE layer) decisions whose top-k expert sets differ, engine vs "
                        "the learner's own routing (megapo.replay.modes.route_disagreement; all fed positions, "
                        "prompt included; disagree_response: response positions only)",
            "disagree_any": "fraction of fed positions with at least one MoE layer differing",
            "dlogp": "d = logp_learner - logp_engine per sampled token (response tokens)",
            "k3": "mean(exp(d) - 1 - d): estimates KL(engine || learner); megapo.replay.modes.engine_mismatch "
                  "(rho = pi/mu, mean(rho - 1 - log rho)) is the same quantity (k3_off_megapo_engine_mismatch)",
            "off": "learner routes freely", "r3": "learner replays the engine's routes (R3)",
            "r3_own_choice_disagree": "under R3, the hook's replay/disagree_pre: the learner's own top-k at each "
                                      "layer (given the replayed upstream) vs the engine's route",
        },
        "published": PUBLISHED,
        "models": models,
    }
    report["target"] = target(models)
    (out_dir / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    write_table(report, out_dir / "table.md")
    print(table(report))
    print(f"-> {out_dir / 'summary.json'}, {out_dir / 'table.md'} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    from megapo.cli import report_errors

    parser = argparse.ArgumentParser(prog="python -m tools.bench.mismatch")
    add_arguments(parser)
    raise SystemExit(report_errors(parser.prog, run, parser.parse_args()))
