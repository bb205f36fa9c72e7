"""The embedded engine: in-process sampling on CPU with a KV cache, on the trainer's machine, no server.

One `generate` call is one batch of prompts x n rows:
- prefill each distinct prompt once (left-padded to the longest) into one KV cache allocated for the whole batch
  (prompts x n rows, prompt + max_new_tokens columns);
- decode one token per running *state* per step, in one batched forward: the running samples of a prompt whose
  tokens so far are equal share a state (one cache row, one forward), which splits when they draw different tokens
  and leaves when its last sample finishes; the states move to the cache's front (no reallocation), so a step
  computes each distinct running prefix once (with router noise every sample is a state of its own);
- every row samples with the same torch.Generator, so a batch is reproducible given `SamplingParams.seed`
  (or, without one, given the engine's seed and the sequence of calls).
- `SamplingParams.abort` (DUET's marker-gated abort, megapo.engines.base.AbortRule): at the step its rows reach
  `abort.at` tokens, a running row that did not draw keep and whose tokens fail the marker check ends there with
  finish_reason "abort" and leaves the batch as a finished row does (its tokens, log-probs and routes those of the
  unstopped row, cut there; the other rows' samples unchanged); it is never continued, unlike a preempted row.
  `tokens_decoded` counts the tokens every batch has sampled, `states_decoded` the rows its decode steps computed.
- `router_noise=σ` (rollout.router_noise; 0: off, nothing drawn) adds N(0, σ²) to every MoE layer's router
  logits before the top-k, in this engine only: a controlled dose of the kernel-level router nondeterminism GPUs
  show in bf16 (engine and learner routing the same token differently). The noise moves the choice of experts
  and their gates alike (megapo.engines.torch_lm `_route`: pre-softmax logits, pre-sigmoid for sigmoid
  routers), and the samples, their log-probs and routes are those of the experts actually used. It comes from a
  generator of its own (`router_noise_generator`: the engine's seed, or SamplingParams.seed when given), so the
  sampler's draws do not depend on σ, and is drawn per fed position of a row, independent of the other rows:
  at prefill one [prompts, longest prompt, MoE layers, experts] block (left-padded like the prompts), then at
  each decode step one [rows of the batch, MoE layers, experts] block of which the running rows take theirs.

Log-probs follow megapo.engines.base: log_softmax(logits / temperature) of the sampled token, before top-p
(temperature 0 = greedy, reported at temperature 1). Pass `logprobs="raw"` to always report temperature-1
log-probs (vLLM's `logprobs_mode="raw_logprobs"`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from megapo import compat
from megapo.engines.base import (Engine, EngineCapabilities, Sample, SamplingParams, check_prompts, joined,
                                 versions_of)
from megapo.replay.routes import route_dtype
from megapo.engines.torch_lm import KVCache, TorchLMSpec, TorchCausalLM
from megapo.weights.safetensors_io import read_folder_into

LOGPROB_MODES = ("scaled", "raw")


def router_noise_generator(seed: int) -> torch.Generator:
    """The router-noise generator of sampling seed `seed`: a stream apart from the sampler's (seeded `seed`)."""
    return torch.Generator().manual_seed((int(seed) * 0x9E3779B97F4A7C15 + 0x5EED0015E) % 2**63)


class EmbeddedEngine(Engine):
    capabilities = EngineCapabilities(in_process=True, weight_syncs=("tensor", "disk"), rng_state=True,
                                      partial=True, router_noise=True, adaptive_temperature=True,
                                      abort_rule=True, default_dtype="float32")
    max_versions = 0  # partial rollouts: most weight versions one sample may span (0: no limit)  # fp32: its log-probs and routes match the learner's

    def __init__(self, model_dir: str | Path | None = None, *, config: dict | None = None,
                 named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, dtype: torch.dtype = torch.float32,
                 seed: int = 0, weight_version: int = 0, logprobs: str = "scaled", router_noise: float = 0.0):
        """Build from an HF folder (`model_dir`), or from an HF `config` dict plus `named_tensors`.
        `router_noise`: σ of the Gaussian noise on the router logits (module docstring; 0: none)."""
        if not (isinstance(router_noise, (int, float)) and math.isfinite(router_noise) and router_noise >= 0):
            raise ValueError(f"router_noise must be a finite number >= 0, got {router_noise!r}")
        if logprobs not in LOGPROB_MODES:
            raise ValueError(f"logprobs must be one of {LOGPROB_MODES}, got {logprobs!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be torch.float32, bfloat16 or float16, got {dtype!r}")
        if (model_dir is None) == (config is None):
            raise ValueError("give exactly one of model_dir or config (with named_tensors)")
        if model_dir is not None:
            self.model = TorchCausalLM.from_pretrained(model_dir, dtype)
        else:
            if named_tensors is None:
                raise ValueError("named_tensors is required with config")
            self.model = TorchCausalLM(TorchLMSpec.from_config(config), dtype)
            loaded = self.model.load(named_tensors)
            missing = self.model.missing_names(loaded)
            if missing:
                raise ValueError(f"named_tensors lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        self.spec = self.model.spec
        if router_noise > 0 and self.spec.num_moe_layers == 0:
            raise ValueError(f"router_noise={router_noise} perturbs the routers, but this {self.spec.family} model "
                             "has no MoE layers")
        self.router_noise = float(router_noise)
        self._noise_generator = router_noise_generator(int(seed))
        # routes in the smallest type that holds the expert ids (megapo.replay.routes.route_dtype)
        self._route_dtype = getattr(torch, str(route_dtype(self.spec.experts or 1)))
        self.weight_version = int(weight_version)
        self.logprob_mode = logprobs
        self._generator = torch.Generator().manual_seed(int(seed))
        self._cache: KVCache | None = None  # reused by every batch (_cache_for)
        self._lock = threading.Lock()  # one batch or one weight update at a time
        self._running = threading.Event()  # set = not paused
        self._running.set()
        self._preempted = threading.Event()  # set by preempt(): batches stop; their samples continue after resume()
        self._closed = False
        self.tokens_decoded = 0  # tokens sampled by every batch so far (one per running row and decode step)
        self.states_decoded = 0  # rows the decode steps computed so far (one per running state and step)

    # ------------------------------------------------------------------------------------------ lifecycle
    def pause(self) -> None:
        """New batches wait until resume(); returns once the batch in flight (if any) has finished."""
        self._running.clear()
        with self._lock:
            pass

    def resume(self) -> None:
        self._preempted.clear()
        self._running.set()

    def preempt(self) -> None:
        """Partial rollouts: the batch in flight stops after its current token (every sample keeps its tokens)
        and, once the engine is resumed with new weights, continues on them; call before pause()."""
        self._preempted.set()

    def health(self) -> bool:
        return not self._closed

    def close(self) -> None:
        self._closed = True
        self._running.set()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EmbeddedEngine is closed")

    # ------------------------------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._check_open()
        with self._lock:
            self.model.load(named_tensors)
            self.weight_version = int(version)

    def weight_buffers(self) -> dict[str, torch.Tensor]:
        """HF name -> the view of this engine's weights it loads into, for a weight receiver that writes in
        place (megapo.weights.broadcast). Write only while paused; update_weights([], v) then sets the version."""
        return dict(self.model.weight_views)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"path {path!r} is not a folder")
        # each tensor is read from the files straight into the weight it fills (no tensor in between);
        # only what does not match one (another dtype, say) goes through load's conversion and checks
        self._check_open()
        with self._lock:
            self.model.load(read_folder_into(path, self.model.weight_views))
            self.weight_version = int(version)

    def rng_state(self) -> torch.Tensor:
        """The sampling generator's state (trainer checkpoints save it so a resumed run samples alike), followed
        by the router-noise generator's when router_noise > 0 (two states of equal length)."""
        state = self._generator.get_state()
        return torch.cat((state, self._noise_generator.get_state())) if self.router_noise else state

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore what rng_state() returned: the sampler's state, or it and the router-noise generator's."""
        size = len(self._generator.get_state())
        if len(state) not in (size, 2 * size):
            raise ValueError(f"an engine RNG state has {size} or {2 * size} bytes, got {len(state)}")
        self._generator.set_state(state[:size].clone())
        if len(state) == 2 * size:
            self._noise_generator.set_state(state[size:].clone())

    # ------------------------------------------------------------------------------------------ sampling
    def _sample(self, logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor, state_of: torch.Tensor):
        """logits float32 [S, V] of S states, each sample's state `state_of` [B], one uniform in [0, 1) per
        sample -> (token [B], logprob [B]).

        Inverse-CDF sampling with one uniform per sample and step: a sample's draw does not depend on which other
        samples are still running, so dropping finished ones never changes the others' samples. The distribution
        (and its CDF) is computed once per state; each sample searches its state's CDF with its own uniform."""
        if params.temperature == 0:
            token = logits.argmax(dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            return token[state_of], logp.gather(1, token[:, None])[:, 0][state_of]
        temperature = params.temperature
        if params.entropy_temperature is not None:  # HAPO: each row's own temperature from its entropy
            temperature = params.entropy_temperature.temperatures(logits, params.temperature)[:, None]
        logp = torch.log_softmax(logits / temperature, dim=-1)
        probs = logp.exp()
        order = None
        if params.top_p < 1.0:
            probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
            probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= params.top_p, 0.0)
        cdf = probs.cumsum(dim=-1).index_select(0, state_of)
        pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)[:, 0]
        token = order[state_of, pick] if order is not None else pick
        if self.logprob_mode == "raw":
            logp = torch.log_softmax(logits, dim=-1)
        return token, logp[state_of, token]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_prompts(prompts, self.spec.vocab_size)
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > self.spec.max_positions:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} plus the longest prompt ({longest}) exceeds "
                             f"max_position_embeddings={self.spec.max_positions}")
        if params.return_routes and self.spec.num_moe_layers == 0:
            raise ValueError(f"return_routes=True but this {self.spec.family} model has no MoE layers")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else self._generator
        noise_gen = None
        if self.router_noise:
            noise_gen = router_noise_generator(params.seed) if params.seed is not None else self._noise_generator
        if params.abort is not None and len(params.abort.keep) != len(prompts) * params.n:
            raise ValueError(f"SamplingParams.abort: {len(params.abort.keep)} keep draws for {len(prompts)} prompts x "
                             f"n={params.n} rows")
        groups, cut = self._run_batch([list(map(int, p)) for p in prompts], params, gen, noise_gen)
        while cut:  # preempted: continue on the new weights
            groups, cut = self._continue(groups, cut, params, gen, noise_gen)
        return groups

    def _run_batch(self, prompts: list[list[int]], params: SamplingParams, gen,
                   noise_gen=None) -> tuple[list[list[Sample]], list[tuple[int, int]]]:
        """The batch's samples, and the (prompt, sample) places of those a preemption cut (finish_reason abort)."""
        while True:
            self._running.wait()
            if self._preempted.is_set() and not self._closed:
                time.sleep(0.002)  # preempted: the new weights are on their way (pause, load, resume)
                continue
            with self._lock:
                if (self._running.is_set() and not self._preempted.is_set()) or self._closed:
                    self._check_open()
                    with compat.device_mode_suspended():  # megapo's own loop: no device="cuda" literal to rewrite
                        return self._generate_locked(prompts, params, gen, noise_gen)

    def _continue(self, groups: list[list[Sample]], cut: list[tuple[int, int]], params: SamplingParams, gen,
                  noise_gen=None) -> tuple[list[list[Sample]], list[tuple[int, int]]]:
        """The preempted samples (at the places `cut`), each continued from its tokens on the current weights
        (one row each); a sample that would span more than max_versions versions starts again instead. A
        continuation runs without params.abort (a row cut before its abort check runs to its end; the caller's
        selection still judges it on the same draws, duet's post-hoc rule)."""
        restart = [self.max_versions and len(set(versions_of(groups[g][i]))) >= self.max_versions for g, i in cut]
        contexts = [groups[g][i].prompt_ids + ([] if again else groups[g][i].output_ids)
                    for (g, i), again in zip(cut, restart)]
        budgets = [params.max_new_tokens - (0 if again else len(groups[g][i].output_ids))
                   for (g, i), again in zip(cut, restart)]
        out, recut = [list(group) for group in groups], []
        for budget in sorted(set(budgets)):
            rows = [j for j, b in enumerate(budgets) if b == budget]
            more, more_cut = self._run_batch([contexts[j] for j in rows],
                                             replace(params, n=1, max_new_tokens=budget, abort=None), gen, noise_gen)
            for j, [tail] in zip(rows, more):
                g, i = cut[j]
                out[g][i] = tail if restart[j] else joined(groups[g][i], tail)
            recut += [cut[rows[k]] for k, _ in more_cut]  # preempted again
        return out, recut

    @torch.inference_mode()
    def _generate_locked(self, prompts: list[list[int]], params: SamplingParams, gen,
                         noise_gen=None) -> list[list[Sample]]:
        """One batch. The KV cache holds one row per *state*, not per sample: the running samples of one prompt
        whose tokens so far are the same share a state (a prefix tree over each prompt's samples, cut at the
        current step), so a decode step computes each distinct state once and its samples read its logits. A
        state splits when its samples draw different tokens (its cache row copied to each), and leaves when its
        last sample finishes. With router noise every sample draws its own noise: each is its own state."""
        model, n = self.model, params.n
        moe_noise = (self.spec.num_moe_layers, self.spec.experts)  # router noise per fed position (noise_gen)
        U, P, max_new = len(prompts), max(len(p) for p in prompts), params.max_new_tokens
        pads = torch.tensor([P - len(p) for p in prompts])
        ids = torch.zeros(U, P, dtype=torch.long)
        for u, p in enumerate(prompts):
            ids[u, P - len(p):] = torch.tensor(p)
        cols = torch.arange(P + max_new)
        key_ok = cols[None, :] >= pads[:, None]  # [U, P + max_new]: False on left padding
        padded = bool(pads.any())  # without left padding no key is ever masked: attention runs unmasked
        mask = None
        if padded:  # prefill: causal, no padded keys; a padded query sees itself only (its output is never used)
            causal = cols[:P, None] >= cols[None, :P]
            mask = ((causal & key_ok[:, None, :P]) | torch.eye(P, dtype=torch.bool))[:, None]
        positions = (cols[None, :P] - pads[:, None]).clamp(min=0)
        B = U * n  # sample rows, prompt-major (row = u * n + j)
        # the last sampled token is never fed, so P + max_new - 1 columns hold every key
        cache = self._cache_for(B, P + max_new - 1)
        want_routes = params.return_routes
        prompt_routes: list[torch.Tensor] | None = [] if want_routes else None
        noise = None if noise_gen is None else self.router_noise * torch.randn(U, P, *moe_noise, generator=noise_gen)
        logits = model.step(ids, positions, cache, 0, mask, prompt_routes, router_noise=noise)
        # state_of[i]: the cache row (state) of the i-th running sample; prompt_of[c]: state c's prompt
        if noise_gen is None:
            state_of, prompt_of = torch.arange(U).repeat_interleave(n), torch.arange(U)
        else:  # router noise differs per sample: one state each from the start
            cache.compact(torch.arange(U).repeat_interleave(n), P)
            logits = logits.repeat_interleave(n, 0)
            state_of, prompt_of = torch.arange(B), torch.arange(U).repeat_interleave(n)
        routes = None
        if want_routes:  # per row, every fed position's top-k experts: [B, P + max_new - 1, L, k]
            routes = torch.zeros(B, P + max_new - 1, self.spec.num_moe_layers, self.spec.topk, dtype=self._route_dtype)
            routes[:, :P].view(U, n, P, *routes.shape[2:]).copy_(torch.stack(prompt_routes, dim=2)[:, None])
        out_tokens = torch.zeros(B, max_new, dtype=torch.long)
        out_logps = torch.zeros(B, max_new, dtype=torch.float32)
        lengths = torch.zeros(B, dtype=torch.long)
        stopped = torch.zeros(B, dtype=torch.bool)
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long)
        active = torch.arange(B)  # original row id of each running sample
        ruled = torch.zeros(B, dtype=torch.bool)  # rows params.abort ended
        preempted = False
        vocab = logits.shape[-1]
        for t in range(max_new):
            uniform = torch.rand(B, generator=gen, dtype=torch.float64).float()[active]
            token, logp = self._sample(logits, params, uniform, state_of)
            self.tokens_decoded += int(active.numel())
            out_tokens[active, t], out_logps[active, t] = token, logp
            lengths[active] = t + 1
            done = torch.isin(token, stop)
            if bool(done.any()):
                stopped[active[done]] = True
            if params.abort is not None and t + 1 == params.abort.at:  # the abort check: running rows judged
                cut_here = self._abort_check(params.abort, active, done, out_tokens)
                ruled[active[cut_here]] = True
                done = done | cut_here
            any_done = bool(done.any())
            if t == max_new - 1 or (any_done and bool(done.all())):
                break
            if self._preempted.is_set():  # partial rollouts: the unfinished rows continue on the new weights
                preempted = True
                break
            if any_done:  # finished rows leave the batch
                keep = (~done).nonzero()[:, 0]
                active, token, state_of = active[keep], token[keep], state_of[keep]
            # the next states: one per (state, token) of the running samples, in (state, token) order
            keys, state_of = torch.unique(state_of * vocab + token, return_inverse=True)
            parent, state_token = keys // vocab, keys % vocab
            if len(parent) != len(prompt_of) or bool((parent != torch.arange(len(parent))).any()):
                cache.compact(parent, P + t)  # states split or left: each new state's row from its parent's
                prompt_of = prompt_of[parent]
            col = P + t
            routes_t: list[torch.Tensor] | None = [] if want_routes else None
            step_mask = key_ok[prompt_of][:, None, None, :col + 1] if padded else None
            noise = None
            if noise_gen is not None:  # every row of the batch draws, the running ones use theirs (one state each)
                drawn = torch.randn(B, 1, *moe_noise, generator=noise_gen)[active]
                noise = self.router_noise * torch.empty_like(drawn).index_copy_(0, state_of, drawn)
            logits = model.step(state_token[:, None], (col - pads[prompt_of])[:, None], cache, col, step_mask,
                                routes_t, router_noise=noise)
            self.states_decoded += len(state_token)
            if want_routes:
                routes[active, col] = torch.stack(routes_t, dim=2)[:, 0].to(self._route_dtype).index_select(0, state_of)
        cut = (~stopped) & (~ruled) & (lengths < max_new) if preempted else None
        return self._collect(prompts, n, P, pads, out_tokens, out_logps, lengths, stopped, routes, cut, ruled)

    @staticmethod
    def _abort_check(rule, active: torch.Tensor, done: torch.Tensor, out_tokens: torch.Tensor) -> torch.Tensor:
        """bool [running rows]: the rows `rule` ends now (not at a stop token, did not draw keep, and whose first
        rule.at tokens do not pass its marker check)."""
        rows = active.tolist()
        return torch.tensor([not d and not rule.keep[r] and not rule.passes(out_tokens[r, :rule.at].tolist())
                             for r, d in zip(rows, done.tolist())], dtype=torch.bool)

    def _cache_for(self, batch: int, columns: int) -> KVCache:
        """The engine's KV cache, kept between batches (fresh pages cost more than the copies that fill them);
        regrown when a batch needs more rows or columns."""
        cache = self._cache
        if cache is None or not cache.fits(batch, columns):
            if cache is not None:
                batch, columns = max(batch, cache.batch), max(columns, cache.max_len)
            self._cache = cache = None  # the old buffers go before the new ones are allocated
            self._cache = self.model.new_cache(batch, columns)
        return self._cache

    def _collect(self, prompts, n, P, pads, out_tokens, out_logps, lengths, stopped, routes,
                 cut=None, ruled=None) -> tuple[list[list[Sample]], list[tuple[int, int]]]:
        """The samples (finish_reason abort: cut by a preemption or ended by params.abort), and the places of
        the preempted ones."""
        result: list[list[Sample]] = []
        preempted: list[tuple[int, int]] = []
        tokens_l, logps_l, lengths_l = out_tokens.tolist(), out_logps.tolist(), lengths.tolist()
        stopped_l, pads_l = stopped.tolist(), pads.tolist()
        cut_l = cut.tolist() if cut is not None else [False] * len(lengths_l)
        ruled_l = ruled.tolist() if ruled is not None else [False] * len(lengths_l)
        routes_np = routes.numpy() if routes is not None else None
        for u, prompt in enumerate(prompts):
            group = []
            for r in range(u * n, (u + 1) * n):
                L = lengths_l[r]
                # a sample's fed positions: its prompt (after the left padding) and all its tokens but the last
                sample_routes = routes_np[r, pads_l[u]:P + L - 1] if routes_np is not None else None
                group.append(Sample(prompt_ids=list(prompt), output_ids=tokens_l[r][:L], logprobs=logps_l[r][:L],
                                    finish_reason="stop" if stopped_l[r] else
                                    "abort" if cut_l[r] or ruled_l[r] else "length",
                                    weight_version=self.weight_version, routes=sample_routes))
                if cut_l[r]:
                    preempted.append((u, r - u * n))
            result.append(group)
        return result, preempted
