"""`megapo bench floor`: megapo's RL step against the floor, a plain single-process PyTorch step doing the same work.

    megapo bench floor --out benchmarks/results/floor.json [--config megapo/configs/tiny_moe_addition.yaml]
                       [--steps 8] [--warmup 1] [--threads N] [--work-dir runs/bench_floor] [section.field=value ...]

The floor is written here, on its own (no megapo engine, learner or algorithm code; it shares only the prompts,
their order and the reward function), for the main job's recipe: a Qwen3-MoE loaded from the same HF
safetensors (the main job's SFT warm start, made under --work-dir on the first run); per step
- generate: the step's prompts x n samples in one batch with a KV cache (rows that stop leave the batch),
  routes recorded, rewards, dynamic sampling as the config asks (same prompts: the floor draws them from its
  own PromptSource with the run's seed);
- old log-probs: none of its own (0 s): one update per rollout, so pi_old is the train forward's log-probs,
  detached (the step-0 check below still compares them with megapo's learner's old log-probs);
- train: forward replaying the same routes (each expert computes only the tokens routed to it: the (token, slot)
  pairs sorted by expert once per layer, one matmul chain per expert over its contiguous slice), lm head and
  log-softmax at the response positions only, GSPO with GRPO advantages and seq-mean-token-mean aggregation,
  backward, grad-norm clip, AdamW (the config's lr, warmup and clip);
- sync: none (the sampler reads the trained parameters).
It is meant to be the fastest plain implementation: nothing a single process does not need (fused SDPA for the
right-padded causal passes, attention by hand for one decode token where CPU SDPA is slower, row gathers by
index_select, no per-token Python work in the sampler), and it runs without megapo.compat's device-literal mode
(a plain program has none; megapo's learner process needs it for Megatron on CPU and pays its per-call cost).
What it leaves to megapo are megapo's two prefix-sharing techniques: its learner holds each group's prompt once
(train.share_prefix), and its engine decodes each distinct running prefix of a prompt's samples once (the embedded
engine's decode states); the floor trains every sample's whole sequence and decodes every running row.
megapo's step is the main job's: EmbeddedEngine (megapo.trainer.engine_setup) and megapo.trainer's
collect_rollouts / update_policy / sync_weights with the config's RunConfig, so changes there show up here.

Before timing, step 0 checks that both do the same work: on megapo's first batch (its engine's samples and
routes) the floor's log-probs must equal megapo's learner's old log-probs (--tolerance); and both samplers
generate the same prompts a few times, interleaved, for generated tokens/s. Then --warmup untimed and --steps
timed steps, alternating which side goes first. Each side trains its own policy there, so a step's
dynamic-sampling rounds differ between the sides; --paired-rounds then times the train phase alone with both sides
on the same rollouts (`same_rollouts`: megapo's engine draws each round's groups, each side trains on them once).
The JSON holds per-phase medians (wall and this process's CPU seconds), the ratios megapo/floor, the machine's load,
torch threads and the git commit; old_logp is 0 on
the floor's side and on megapo's steps that fold it into the train forward (its ratio is then null). Exit 1
when the step-0 log-probs differ, 2 on a config the floor does not implement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megapo import compat

PHASES = ("generate", "old_logp", "train", "sync")
REPO = Path(__file__).resolve().parents[2]
MAIN_CONFIG = REPO / "megapo/configs/tiny_moe_addition.yaml"


# ----------------------------------------------------------------------------------------------- floor model


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)  # weight * x / sqrt(mean(x^2) + eps), one fused kernel


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FloorMoE(torch.nn.Module):
    """Qwen3-MoE in float32 from an HF config dict and its on-disk tensors: every layer MoE (softmax router,
    top-k renormalised when norm_topk_prob), q/k RMSNorm, rotary, GQA, SiLU-gated experts."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self._check(config)
        c = config
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.experts = c.get("num_experts", c.get("num_local_experts"))
        self.topk, self.norm_topk = c["num_experts_per_tok"], c.get("norm_topk_prob", True)
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.n_layers = c["num_hidden_layers"]
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)

        def param(name):
            return torch.nn.Parameter(tensors[name].float().clone())

        self.embed = param("model.embed_tokens.weight")
        self.norm = param("model.norm.weight")
        self.lm_head = self.embed if c.get("tie_word_embeddings") else param("lm_head.weight")
        self.layers = torch.nn.ModuleList()
        for i in range(self.n_layers):
            p, layer = f"model.layers.{i}.", torch.nn.ParameterDict()
            for key, name in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"),
                              ("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                              ("o", "self_attn.o_proj"), ("q_norm", "self_attn.q_norm"),
                              ("k_norm", "self_attn.k_norm"), ("router", "mlp.gate")):
                layer[key] = param(p + name + ".weight")
            for key in ("gate_proj", "up_proj", "down_proj"):
                layer[key] = torch.nn.Parameter(torch.stack(
                    [tensors[f"{p}mlp.experts.{e}.{key}.weight"].float() for e in range(self.experts)]))
            self.layers.append(layer)

    @staticmethod
    def _check(c: dict) -> None:
        if c.get("model_type") != "qwen3_moe":
            raise ValueError(f"the floor implements qwen3_moe; config.json model_type is {c.get('model_type')!r}")
        if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
            raise ValueError("the floor implements all-MoE layers; config.json has mlp_only_layers/decoder_sparse_step")
        if c.get("attention_bias"):
            raise ValueError("the floor implements attention without bias; config.json has attention_bias=true")

    @classmethod
    def from_folder(cls, folder: str | Path) -> "FloorMoE":
        from safetensors import safe_open

        folder = Path(folder)
        tensors = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                tensors.update({name: st.get_tensor(name) for name in st.keys()})
        return cls(json.loads((folder / "config.json").read_text()), tensors)

    def experts_forward(self, x: torch.Tensor, layer, routes: torch.Tensor | None):
        """x [N, H] -> (out [N, H], top [N, k]); `routes` replays the given experts (gate scores gathered there)."""
        probs = torch.softmax(x @ layer["router"].t(), dim=-1)
        if routes is None:
            weight, top = probs.topk(self.topk, dim=-1)
        else:
            top = routes
            weight = probs.gather(1, top)
        if self.norm_topk:
            weight = weight / weight.sum(-1, keepdim=True)
        # routed tokens only: the (token, slot) pairs sorted by expert once, one matmul chain per expert over its
        # contiguous slice, one weighted index_add back. Measured on 6k tokens x top-2 of 8, hidden 64, one thread,
        # forward + backward: 25 ms, against 30 ms for one bmm over [experts, capacity, hidden] blocks
        # zero-padded to the busiest expert (6 % padding) and 36 ms for a per-expert nonzero/index_add loop.
        flat = top.reshape(-1)
        order = flat.argsort(stable=True)
        token, w = order // self.topk, weight.reshape(-1)[order, None]
        gate, up, down = layer["gate_proj"], layer["up_proj"], layer["down_proj"]
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        y = torch.cat([(F.silu(h @ gate[e].t()) * (h @ up[e].t())) @ down[e].t()
                       for e, h in enumerate(x.index_select(0, token).split(counts)) if len(h)])
        return torch.zeros_like(x).index_add(0, token, y * w), top

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, *, cache=None, start: int = 0,
                mask: torch.Tensor | None = None, routes: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, select: torch.Tensor | None = None):
        """ids/positions [B, T]. cache: (k, v) lists of [rows, kv_heads, len, head_dim] whose first B rows take
        columns start..start+T-1. mask: bool [B, 1, T, start+T] or None (causal). routes: int [B, T, L, k] to
        replay. valid: bool [B, T], the tokens the experts compute (others get no MLP). select: bool [B, T], the
        positions whose logits are wanted (then logits [selected, V]). -> (logits [B, T, V], routes used
        [B, T, L, k])."""
        B, T = ids.shape
        x = F.embedding(ids, self.embed)
        angles = positions[..., None].float() * self.inv_freq
        angles = torch.cat((angles, angles), -1)[:, None]  # [B, 1, T, head_dim]
        cos, sin = angles.cos(), angles.sin()
        flat = valid.reshape(-1).nonzero()[:, 0] if valid is not None else None
        used = []
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer["ln1"], self.eps)
            q = rms_norm((h @ layer["q"].t()).view(B, T, self.heads, self.head_dim), layer["q_norm"], self.eps)
            k = rms_norm((h @ layer["k"].t()).view(B, T, self.kv_heads, self.head_dim), layer["k_norm"], self.eps)
            v = (h @ layer["v"].t()).view(B, T, self.kv_heads, self.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            if cache is not None:
                cache[0][i][:B, :, start:start + T], cache[1][i][:B, :, start:start + T] = k, v
                k, v = cache[0][i][:B, :, :start + T], cache[1][i][:B, :, :start + T]
            if T == 1 and cache is not None:  # one decode token: by hand (CPU SDPA's kernel is slower there)
                group = self.heads // self.kv_heads
                scores = (q.view(B, self.kv_heads, group, -1) @ k.transpose(-1, -2)) * self.head_dim ** -0.5
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                att = (torch.softmax(scores, -1) @ v).view(B, self.heads, 1, -1)
            else:
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                     enable_gqa=True)
            x = x + att.transpose(1, 2).reshape(B, T, -1) @ layer["o"].t()
            h = rms_norm(x, layer["ln2"], self.eps).reshape(B * T, -1)
            layer_routes = routes[:, :, i].reshape(B * T, -1) if routes is not None else None
            if flat is None:
                y, top = self.experts_forward(h, layer, layer_routes)
            else:
                y_valid, top_valid = self.experts_forward(h.index_select(0, flat), layer, None if layer_routes is None
                                                          else layer_routes[flat])
                y = torch.zeros_like(h).index_copy(0, flat, y_valid)
                top = torch.zeros(B * T, self.topk, dtype=torch.long).index_copy(0, flat, top_valid)
            used.append(top.view(B, T, -1))
            x = x + y.view(B, T, -1)
        if select is not None:
            x = x[select]
        return rms_norm(x, self.norm, self.eps) @ self.lm_head.t(), torch.stack(used, dim=2)


# ----------------------------------------------------------------------------------------------- floor step


@dataclass
class FloorSample:
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    stopped: bool
    routes: torch.Tensor  # [len(prompt) + len(output) - 1, L, k]

    # what megapo's reward function reads
    @property
    def output_ids(self) -> list[int]:
        return self.output

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"


@torch.no_grad()
def floor_generate(model: FloorMoE, prompts: list[list[int]], n: int, max_new: int, stop_id: int,
                   temperature: float, gen: torch.Generator) -> list[list[FloorSample]]:
    """Every prompt x n samples in one batch: prefill the prompts, copy each prompt's cache rows to its n samples,
    decode the running rows one token per step (rows that stop leave the batch, their cache rows with them, once
    they are an eighth of it: a compaction costs more than a few rows' decode)."""
    U, P = len(prompts), max(len(p) for p in prompts)
    B, width = U * n, P + max_new - 1
    pads = torch.tensor([P - len(p) for p in prompts])
    ids = torch.zeros(U, P, dtype=torch.long)
    for u, p in enumerate(prompts):
        ids[u, P - len(p):] = torch.tensor(p)
    cols = torch.arange(width + 1)
    key_ok = cols[None] >= pads[:, None]  # [U, width + 1]: False on left padding
    padded = bool(pads.any())  # without left padding no key is masked: attention runs unmasked
    mask = None
    if padded:
        causal = cols[:P, None] >= cols[None, :P]
        mask = ((causal & key_ok[:, None, :P]) | torch.eye(P, dtype=torch.bool))[:, None]
    positions = (cols[None, :P] - pads[:, None]).clamp(min=0)
    # one [B, kv_heads, width, head_dim] cache per layer for k and v, kept on the model between calls (fresh
    # pages cost more than the copies that fill them); the running rows are its first rows
    shape = (B, model.kv_heads, width, model.head_dim)
    cache = getattr(model, "_kv_cache", None)
    if cache is None or any(have < need for need, have in zip(shape, cache[0][0].shape)):
        cache = ([torch.empty(shape) for _ in model.layers], [torch.empty(shape) for _ in model.layers])
        model._kv_cache = cache
    logits, prompt_routes = model(ids, positions, cache=cache, mask=mask)
    rows = torch.arange(U).repeat_interleave(n)  # sample row -> prompt
    for c in (*cache[0], *cache[1]):  # prompt rows u -> sample rows u * n .. u * n + n - 1, filled columns only
        c[:B, :, :P] = c[:U, :, :P].repeat_interleave(n, 0)
    # (index_select: a row gather 4-6x faster than advanced indexing on CPU)
    logits, key_ok, pads = logits[:, -1].index_select(0, rows), key_ok[rows], pads[rows]
    routes = torch.zeros(B, width, model.n_layers, model.topk, dtype=torch.long)
    routes[:, :P] = prompt_routes.index_select(0, rows)
    tokens = torch.zeros(B, max_new, dtype=torch.long)
    logps = torch.zeros(B, max_new)
    lengths = torch.full((B,), max_new)
    live = torch.arange(B)  # the sample row of each batch row
    done = torch.zeros(B, dtype=torch.bool)  # batch rows that stopped but still ride along
    for t in range(max_new):
        probs = torch.softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
        cdf = probs.cumsum(-1)  # inverse-CDF sampling: one uniform per row (multinomial draws one per token)
        u = torch.rand(len(cdf), 1, generator=gen) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
        # a stopped row's later tokens land past its length and are cut below
        tokens[live, t], logps[live, t] = token, probs.gather(1, token[:, None])[:, 0].log()
        stopped = (token == stop_id) & ~done
        lengths[live[stopped]] = t + 1
        done |= stopped
        if t == max_new - 1 or bool(done.all()):
            break
        if int(done.sum()) * 8 >= len(done):  # stopped rows leave the batch once they are an eighth of it
            keep = (~done).nonzero()[:, 0]
            live, token, key_ok, pads, done = live[keep], token[keep], key_ok[keep], pads[keep], done[keep]
            for c in (*cache[0], *cache[1]):  # the running rows move to the front, filled columns only
                c[:len(keep), :, :P + t] = c[:, :, :P + t].index_select(0, keep)
        col = P + t
        logits, step_routes = model(token[:, None], (col - pads)[:, None], cache=cache, start=col,
                                    mask=key_ok[:, None, None, :col + 1] if padded else None)
        logits = logits[:, -1]
        routes[live, col] = step_routes[:, 0]
    out, tokens_l, logps_l, lengths_l = [], tokens.tolist(), logps.tolist(), lengths.tolist()
    for u, prompt in enumerate(prompts):
        group = []
        for r in range(u * n, (u + 1) * n):
            L = lengths_l[r]
            group.append(FloorSample(prompt, tokens_l[r][:L], logps_l[r][:L], tokens_l[r][L - 1] == stop_id,
                                     routes[r, P - len(prompt):P + L - 1]))
        out.append(group)
    return out


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[groups, n] -> (r - group mean) / (group std (n - 1) + eps)."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              eps_low: float, eps_high: float) -> torch.Tensor:
    """Sequences [S, T] (mask: response tokens). s_i = exp(mean_t log(pi/pi_old)); loss = mean_i max(-A_i s_i,
    -A_i clip(s_i, 1 - eps_low, 1 + eps_high)) (seq-mean-token-mean of GSPO's per-sequence value)."""
    s = torch.exp(((logp - old_logp) * mask).sum(1) / mask.sum(1))
    return torch.maximum(-adv * s, -adv * s.clamp(1 - eps_low, 1 + eps_high)).mean()


def sequence_batch(samples: list[FloorSample]):
    """Right-padded inputs [S, W], positions, targets, routes [S, W, L, k], valid (fed) and response masks."""
    from torch.nn.utils.rnn import pad_sequence

    seqs = [torch.tensor(s.prompt + s.output) for s in samples]
    lengths = torch.tensor([len(q) - 1 for q in seqs])
    prompts = torch.tensor([len(s.prompt) for s in samples])
    padded = pad_sequence(seqs, batch_first=True)
    ids, targets = padded[:, :-1], padded[:, 1:]
    S, W = ids.shape
    routes = pad_sequence([torch.as_tensor(s.routes, dtype=torch.long) for s in samples], batch_first=True)
    routes = F.pad(routes, (0, 0, 0, 0, 0, W - routes.shape[1]))
    cols = torch.arange(W)
    valid = cols[None] < lengths[:, None]
    response = valid & (cols[None] >= prompts[:, None] - 1)
    return ids, cols.expand(S, W), targets, routes, valid, response


def sequence_logprobs(model: FloorMoE, batch, response_only: bool = False) -> torch.Tensor:
    """Log-probs of the targets: [S, W], or with response_only the response tokens' only, flat in row order
    (the lm head and softmax then run on those positions only)."""
    ids, positions, targets, routes, valid, response = batch
    if response_only:
        logits, _ = model(ids, positions, routes=routes, valid=valid, select=response)
        return torch.log_softmax(logits, -1).gather(1, targets[response][:, None])[:, 0]
    logits, _ = model(ids, positions, routes=routes, valid=valid)
    return torch.log_softmax(logits, -1).gather(2, targets[..., None])[..., 0]


class Floor:
    """The floor's RL loop state: model, optimizer, prompt order, sampling generator."""

    def __init__(self, model_dir: Path, cfg, pool, reward_fn, stop_id: int):
        from megapo.trainer.data import PromptSource

        self.model = FloorMoE.from_folder(model_dir)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                           eps=o.adam_eps, weight_decay=o.weight_decay)
        # the config's schedule (constant after a linear warmup from 0, as Megatron's scheduler does): the policy
        # then moves as fast as megapo's, which sets how many dynamic-sampling rounds later steps need
        warmup = o.warmup_steps
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                          lambda k: min(1.0, k / warmup) if warmup else 1.0)
        self.cfg, self.pool, self.reward_fn, self.stop_id = cfg, pool, reward_fn, stop_id
        self.source = PromptSource(len(pool), seed=cfg.train.seed)  # the same prompts as megapo's run
        self.gen = torch.Generator().manual_seed(cfg.train.seed)
        opts = cfg.algorithm.objective_options
        self.eps_low, self.eps_high = opts.get("eps_low", 3e-4), opts.get("eps_high", 4e-4)  # GSPO paper's
        self.adv_eps = cfg.algorithm.advantage_options.get("eps", 1e-6)
        self.generated = 0  # tokens sampled in the current step

    def rollout_round(self):
        d, r = self.cfg.data, self.cfg.rollout
        items = [self.pool[i] for i in self.source.next_batch(d.prompts_per_step)]
        out = floor_generate(self.model, [ids for _, ids in items], r.n_samples, r.max_new_tokens, self.stop_id,
                             r.temperature, self.gen)
        self.generated += sum(len(s.output) for group in out for s in group)
        return [(group, self.reward_fn([(ex, s) for s in group])) for (ex, _), group in zip(items, out)]

    def collect(self):
        """Groups with their rewards; dynamic sampling keeps groups whose rewards differ, refilled up to
        max_sampling_rounds rounds."""
        d = self.cfg.data
        if not d.dynamic_sampling:
            return self.rollout_round()
        kept = []
        for _ in range(d.max_sampling_rounds):
            kept += [g for g in self.rollout_round() if max(g[1]) - min(g[1]) > 1e-8]
            if len(kept) >= d.prompts_per_step:
                break
        return kept[:d.prompts_per_step]

    def step(self, timer: dict) -> int:
        """One RL step; phase wall/CPU seconds added to `timer`; returns the tokens generated (kept or not)."""
        self.generated = 0
        with phase(timer, "generate"):
            groups = self.collect()
        if not groups:
            return self.generated
        samples = [s for g, _ in groups for s in g]
        timer.setdefault("old_logp", [0.0, 0.0])  # one update per rollout: pi_old is the train forward's, detached
        with phase(timer, "train"):
            self.train(samples, [rw for _, rw in groups])
        timer.setdefault("sync", [0.0, 0.0])  # the sampler reads the trained parameters: nothing to hand over
        return self.generated

    def train(self, samples: list[FloorSample], rewards: list[list[float]]) -> None:
        """One update on `samples` (whole groups, in order) with their groups' `rewards` [groups, n]."""
        batch = sequence_batch(samples)
        response = batch[-1]
        adv = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), self.adv_eps).reshape(-1)
        flat = sequence_logprobs(self.model, batch, response_only=True)
        logp = torch.zeros(response.shape).masked_scatter(response, flat)
        loss = gspo_loss(logp, logp.detach(), adv, response.float(), self.eps_low, self.eps_high)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.schedule.step()


class phase:
    """Adds a block's wall and process-CPU seconds to timer[name] = [wall, cpu]."""

    def __init__(self, timer: dict, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        acc = self.timer.setdefault(self.name, [0.0, 0.0])
        acc[0] += time.perf_counter() - self.t0
        acc[1] += time.process_time() - self.c0


# ----------------------------------------------------------------------------------------------- megapo side


class Megapo:
    """The main job's step: megapo's engine and the trainer's phases (megapo.trainer.rollout, .update, .run) on
    the run's config."""

    def __init__(self, cfg, model_dir: Path, out_dir: Path, tokenizer, pool, reward_fn):
        from megapo.trainer.data import PromptSource
        from megapo.trainer.rollout import sampling_params
        from megapo.trainer.run import build_engine, build_learner, make_transport

        self.cfg, self.pool, self.reward_fn = cfg, pool, reward_fn
        self.learner = build_learner(cfg, model_dir)
        self.engine = build_engine(cfg, model_dir)
        self.transport = make_transport(cfg, out_dir, model_dir, self.learner, self.engine)
        self.source = PromptSource(len(pool), seed=cfg.train.seed)
        # as megapo.trainer.run.Run builds them
        self.params = sampling_params(cfg, tokenizer.eos_token_id, routes=cfg.algorithm.routing_replay == "r3")
        self.loss = cfg.loss_spec()
        self.version = 0

    def collect(self):
        from megapo.trainer.rollout import collect_rollouts

        return collect_rollouts(self.engine, self.params, self.pool, self.source, self.reward_fn, self.cfg)

    def step(self, timer: dict) -> int:
        from megapo.trainer.metrics import StepTimer
        from megapo.trainer.run import sync_weights
        from megapo.trainer.update import update_policy

        with phase(timer, "generate"):
            groups, _, tokens = self.collect()
        if not groups:
            return tokens
        inner = StepTimer()  # update_policy times old_logp and train itself
        c0 = time.process_time()
        update_policy(self.learner, groups, self.cfg, None, self.loss, inner)
        cpu = time.process_time() - c0
        wall = sum(inner.times.values()) or 1.0
        for name, seconds in inner.times.items():  # CPU split in proportion to the phases' wall time
            acc = timer.setdefault(name if name in PHASES else "train", [0.0, 0.0])
            acc[0] += seconds
            acc[1] += cpu * seconds / wall
        timer.setdefault("old_logp", [0.0, 0.0])  # an on-policy step may fold it into train
        with phase(timer, "sync"):
            self.version += 1
            sync_weights(self.learner, self.engine, self.version, self.cfg, self.transport)
        return tokens

    def close(self):
        self.engine.close()
        self.learner.close()


# ----------------------------------------------------------------------------------------------- checks


def step0_logprob_check(floor: Floor, megapo: Megapo) -> dict:
    """On megapo's first batch (its engine's samples and routes), megapo's learner's old log-probs (the loop's
    train_samples + old_logprob_pass) against the floor's, before either trains."""
    from megapo.trainer.update import old_logprob_pass, train_samples

    groups, _, _ = megapo.collect()
    batch = train_samples(groups, megapo.cfg)
    old_logprob_pass(megapo.learner, batch, megapo.cfg)
    fb = sequence_batch(floor_samples(batch))
    with torch.no_grad():  # the train step's path: logits at the response positions only
        ours = sequence_logprobs(floor.model, fb, response_only=True).split(fb[-1].sum(1).tolist())
    diff = 0.0
    for got, s in zip(ours, batch):
        diff = max(diff, (got.double() - torch.tensor(s["old_logp"], dtype=torch.float64)).abs().max().item())
    return {"sequences": len(batch), "response_tokens": int(fb[-1].sum()), "max_abs_diff": diff}


def floor_samples(batch: list) -> list[FloorSample]:
    """megapo's train samples (engine tokens and routes) as the floor's."""
    return [FloorSample(s["tokens"][:s["prompt_len"]], s["tokens"][s["prompt_len"]:], [], False,
                        torch.as_tensor(s["routes"])) for s in batch]


def same_rollout_train(floor: Floor, megapo: Megapo, rounds: int) -> dict:
    """Both sides' train phase on the same rollouts: each round megapo's engine draws a step's groups, then each
    side trains on them once (alternating which goes first; megapo's update_policy, the floor's train), so the
    ratio holds neither side's own dynamic-sampling rounds nor its policy's drift. Wall and process-CPU seconds."""
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.run import sync_weights
    from megapo.trainer.update import train_samples, update_policy

    times: dict[str, list[tuple[float, float]]] = {"floor": [], "megapo": []}
    for k in range(rounds):
        groups, _, _ = megapo.collect()
        if not groups:
            continue
        samples, rewards = floor_samples(train_samples(groups, megapo.cfg)), [g.rewards for g in groups]
        for side in (("floor", "megapo") if k % 2 else ("megapo", "floor")):
            t0, c0 = time.perf_counter(), time.process_time()
            if side == "floor":
                with compat.device_mode_suspended():
                    floor.train(samples, rewards)
            else:
                update_policy(megapo.learner, groups, megapo.cfg, None, megapo.loss, StepTimer())
            times[side].append((time.perf_counter() - t0, time.process_time() - c0))
        megapo.version += 1  # untimed: the engine samples the next round from the trained weights
        sync_weights(megapo.learner, megapo.engine, megapo.version, megapo.cfg, megapo.transport)
    if not times["floor"]:
        return {"rounds": 0}
    med = {side: [statistics.median(t[i] for t in times[side]) for i in (0, 1)] for side in times}
    return {"rounds": len(times["floor"]), "floor_train_s": med["floor"][0], "megapo_train_s": med["megapo"][0],
            "floor_train_cpu_s": med["floor"][1], "megapo_train_cpu_s": med["megapo"][1],
            "megapo_over_floor_train": med["megapo"][0] / med["floor"][0],
            "megapo_over_floor_train_cpu": med["megapo"][1] / med["floor"][1], "per_round": times}


def sampler_rates(floor: Floor, megapo: Megapo, rounds: int) -> dict:
    """Both samplers on the same prompts (one round of the step's prompts x n), interleaved: tokens/s."""
    r = megapo.cfg.rollout
    prompts = [ids for _, ids in (floor.pool[i] for i in range(megapo.cfg.data.prompts_per_step))]
    rates = {"floor": [], "megapo": []}
    for k in range(rounds):
        for side in (("floor", "megapo") if k % 2 else ("megapo", "floor")):
            t0 = time.perf_counter()
            if side == "floor":
                with compat.device_mode_suspended():
                    out = floor_generate(floor.model, prompts, r.n_samples, r.max_new_tokens, floor.stop_id,
                                         r.temperature, floor.gen)
            else:
                out = megapo.engine.generate(prompts, megapo.params)
            rates[side].append(sum(len(s.output_ids) for g in out for s in g) / (time.perf_counter() - t0))
    floor_rate, megapo_rate = statistics.median(rates["floor"]), statistics.median(rates["megapo"])
    return {"prompts": len(prompts), "samples_per_prompt": r.n_samples, "rounds": rounds,
            "floor_tokens_per_s": floor_rate, "megapo_tokens_per_s": megapo_rate,
            "megapo_over_floor_tokens_per_s": megapo_rate / floor_rate, "floor_rounds": rates["floor"],
            "megapo_rounds": rates["megapo"]}


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty_files": len(git("status", "--porcelain").splitlines())}


# ----------------------------------------------------------------------------------------------- main


def check_recipe(cfg) -> None:
    """The floor implements the main job's recipe; anything else is refused before any work."""
    from megapo.config import ConfigError

    a = cfg.algorithm
    for name, got, want in (("algorithm.objective", a.objective, "gspo"), ("algorithm.advantage", a.advantage, "grpo"),
                            ("algorithm.loss_agg", a.loss_agg, "seq-mean-token-mean"),
                            ("algorithm.routing_replay", a.routing_replay, "r3"),
                            ("rollout.engine", cfg.rollout.engine, "embedded"), ("train.mode", cfg.train.mode, "sync")):
        if got != want:
            raise ConfigError(name, f"the floor bench implements {want!r}, got {got!r}")
    for name, value in (("algorithm.kl_coef", a.kl_coef), ("algorithm.entropy_coef", a.entropy_coef)):
        if value:
            raise ConfigError(name, f"the floor bench implements 0, got {value!r}")
    if a.mismatch != "none":
        raise ConfigError("algorithm.mismatch", f"the floor bench implements none, got {a.mismatch!r}")
    if cfg.optim.lr_schedule != "constant":
        raise ConfigError("optim.lr_schedule", f"the floor bench implements constant, got {cfg.optim.lr_schedule!r}")
    if cfg.rollout.top_p != 1.0:
        raise ConfigError("rollout.top_p", f"the floor bench implements 1.0, got {cfg.rollout.top_p!r}")
    if cfg.train.updates_per_rollout != 1 or cfg.train.mini_batches != 1:
        raise ConfigError("train.mini_batches", "the floor bench implements one update per rollout (mini_batches 1, "
                          "updates_per_rollout 1)")
    if not cfg.data.task:
        raise ConfigError("data.task", "the floor bench runs a built-in task")
    if cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.ep * cfg.parallel.dp != 1:
        raise ConfigError("parallel", "the floor bench is single-process: tp = pp = ep = dp = 1")


def medians(per_step: list[dict]) -> dict:
    out = {}
    for name in PHASES:
        out[name] = statistics.median(s[name][0] for s in per_step)
        out[name + "_cpu"] = statistics.median(s[name][1] for s in per_step)
    out["step"] = statistics.median(sum(s[n][0] for n in PHASES) for s in per_step)
    out["step_cpu"] = statistics.median(sum(s[n][1] for n in PHASES) for s in per_step)
    return out


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def bench_config(args):
    """The run config the bench runs (models and run files under --work-dir); ConfigError when it cannot."""
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    work = Path(args.work_dir)
    cfg = load_config(RunConfig, args.config, [f"model.path={work / 'base'}", f"train.output_dir={work}",
                                               *args.overrides])
    check_recipe(cfg)
    return cfg


def plain_reward_fn(cfg, tokenizer):
    """The floor's rewards: the configured reward called directly on each decoded response (stop token
    removed), without megapo's guard (timeout, type checks), as a hand-written loop would; a response cut at
    the length limit gets data.truncated_reward (unless null)."""
    from megapo.tasks.registry import reward_spec
    from megapo.trainer.rewards import get_reward

    fn = get_reward(reward_spec(cfg.data))
    cut_reward = cfg.data.truncated_reward

    def one(ex, s) -> float:
        if s.finish_reason != "stop" and cut_reward is not None:
            return float(cut_reward)
        return float(fn(tokenizer.decode(s.output_ids[:-1] if s.finish_reason == "stop" else s.output_ids,
                                         skip_special_tokens=True), ex.answer))

    def reward(pairs: list) -> list[float]:
        return [one(ex, s) for ex, s in pairs]

    return reward


def run_bench(args, cfg) -> dict:
    from transformers import AutoTokenizer

    from megapo.trainer.data import PromptPool, PromptSource
    from megapo.trainer.rollout import make_reward_fn
    from megapo.trainer.run import prepare_model

    work = Path(args.work_dir)
    load_start = os.getloadavg()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(cfg, work)  # the main job's starting weights (SFT warm start, cached)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool = PromptPool(tokenizer, cfg.data.chat_template, cfg.data.max_prompt_tokens, task=cfg.data.task)
    floor = Floor(model_dir, cfg, pool, plain_reward_fn(cfg, tokenizer), tokenizer.eos_token_id)
    megapo = Megapo(cfg, model_dir, work, tokenizer, pool, make_reward_fn(cfg, tokenizer))
    try:
        check = step0_logprob_check(floor, megapo)
        check.update(tolerance=args.tolerance, ok=check["max_abs_diff"] <= args.tolerance)
        megapo.source = PromptSource(len(pool), seed=cfg.train.seed)  # the timed steps start at the same prompts
        sampler = sampler_rates(floor, megapo, args.sampler_rounds)
        per_step = {"floor": [], "megapo": []}
        tokens = {"floor": [], "megapo": []}
        sides = {"floor": floor, "megapo": megapo}
        for k in range(args.warmup + args.steps):
            for name in (("floor", "megapo") if k % 2 == 0 else ("megapo", "floor")):
                timer: dict = {}
                # megapo's learner process rewrites device="cuda" literals for Megatron on CPU (megapo.compat); a
                # plain program has no such mode, so the floor runs without it
                with compat.device_mode_suspended() if name == "floor" else contextlib.nullcontext():
                    generated = sides[name].step(timer)
                if k >= args.warmup and all(p in timer for p in PHASES):
                    per_step[name].append(timer)
                    tokens[name].append(generated)
        same = same_rollout_train(floor, megapo, args.paired_rounds) if args.paired_rounds else {"rounds": 0}
    finally:
        megapo.close()
    if not per_step["floor"] or not per_step["megapo"]:
        raise RuntimeError("no timed step trained (every group was uninformative); use more --steps or prompts")
    phases = {name: medians(steps) for name, steps in per_step.items()}
    f, m = phases["floor"], phases["megapo"]
    return {
        "benchmark": "floor",
        "argv": sys.argv,
        "config": args.config, "overrides": list(args.overrides),
        "git": git_commit(), "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "warmup_steps": args.warmup, "timed_steps": args.steps,
        "step0_logprobs": check,
        "sampler": sampler,
        "same_rollouts": same,
        "phases_median_s": phases,
        "ratio_megapo_over_floor": {name: ratio(m[name], f[name]) for name in
                                    ("generate", "old_logp", "train", "sync", "step", "step_cpu")},
        "generate_tokens_per_s": {side: statistics.median(t / s["generate"][0] for t, s in zip(tokens[side],
                                                                                            per_step[side]))
                                  for side in ("floor", "megapo")},
        "target_step_ratio": 2.0,
        "per_step": per_step, "generated_tokens": tokens,
        "notes": "floor sync is 0 by construction (its sampler reads the trained parameters); megapo's CPU seconds "
                 "of old_logp/train are its update_policy's CPU split in proportion to their wall time",
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides of the run config, e.g. data.prompts_per_step=32")
    parser.add_argument("--out", required=True, help="JSON file written")
    parser.add_argument("--config", default=str(MAIN_CONFIG), help="run config (default: the main job's, "
                        f"{MAIN_CONFIG.relative_to(REPO)})")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    parser.add_argument("--sampler-rounds", type=int, default=6, help="interleaved generate rounds per sampler")
    parser.add_argument("--paired-rounds", type=int, default=6,
                        help="after the timed steps, rounds in which both sides train on the same rollouts (0: none)")
    parser.add_argument("--work-dir", default="runs/bench_floor",
                        help="model folders (base, SFT warm start: reused when present) and megapo's run files")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default 0: torch's own, as megapo train runs; 1 is steadier on a busy "
                             "machine, where a 2-thread team waits for a core at every op)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest step-0 |floor - megapo| log-prob difference accepted")


def run(args: argparse.Namespace) -> int:
    from megapo.config import ConfigError

    for flag, value, least in (("--steps", args.steps, 1), ("--sampler-rounds", args.sampler_rounds, 1),
                               ("--warmup", args.warmup, 0), ("--threads", args.threads, 0),
                               ("--paired-rounds", args.paired_rounds, 0)):
        if value < least:
            raise ConfigError(flag, f"must be >= {least}, got {value}")
    cfg = bench_config(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_bench(args, cfg)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    summary = {"step0_max_abs_diff": result["step0_logprobs"]["max_abs_diff"],
               "sampler_megapo_over_floor_tokens_per_s": result["sampler"]["megapo_over_floor_tokens_per_s"],
               **{f"ratio_{k}": v for k, v in result["ratio_megapo_over_floor"].items()}}
    print(json.dumps(summary, indent=1))
    if not result["step0_logprobs"]["ok"]:
        print(f"megapo bench floor: step-0 log-probs differ by {result['step0_logprobs']['max_abs_diff']:.3g} "
              f"> --tolerance {args.tolerance}: the floor and megapo do not compute the same thing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from megapo.cli import report_errors

    p = argparse.ArgumentParser(prog="python -m tools.bench.floor")
    add_arguments(p)
    raise SystemExit(report_errors(p.prog, run, p.parse_args()))
