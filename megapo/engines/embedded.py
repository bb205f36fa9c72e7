"""The embedded engine: in-process sampling on CPU with a KV cache, on the trainer's machine, no server.

One `generate` call is one batch of prompts x n rows:
- prefill each distinct prompt once (left-padded to the longest), then repeat its cache rows n times;
- decode one token per row per step; rows that finish are dropped from the batch (and their cache rows);
- every row samples with the same torch.Generator, so a batch is reproducible given `SamplingParams.seed`
  (or, without one, given the engine's seed and the sequence of calls).

Log-probs follow megapo.engines.base: log_softmax(logits / temperature) of the sampled token, before top-p
(temperature 0 = greedy, reported at temperature 1). Pass `logprobs="raw"` to always report temperature-1
log-probs (vLLM's `logprobs_mode="raw_logprobs"`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from megapo.engines.base import Engine, Sample, SamplingParams, check_prompts
from megapo.engines.torch_lm import ModelSpec, TorchCausalLM
from megapo.weights.safetensors_io import read_folder_into

LOGPROB_MODES = ("scaled", "raw")


class EmbeddedEngine(Engine):
    def __init__(self, model_dir: str | Path | None = None, *, config: dict | None = None,
                 named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, dtype: torch.dtype = torch.float32,
                 seed: int = 0, weight_version: int = 0, logprobs: str = "scaled"):
        """Build from an HF folder (`model_dir`), or from an HF `config` dict plus `named_tensors`."""
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
            self.model = TorchCausalLM(ModelSpec.from_config(config), dtype)
            loaded = self.model.load(named_tensors)
            missing = self.model.required_names() - loaded
            if missing:
                raise ValueError(f"named_tensors lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        self.spec = self.model.spec
        self.weight_version = int(weight_version)
        self.logprob_mode = logprobs
        self._generator = torch.Generator().manual_seed(int(seed))
        self._lock = threading.Lock()  # one batch or one weight update at a time
        self._running = threading.Event()  # set = not paused
        self._running.set()
        self._closed = False

    # ------------------------------------------------------------------------------------------ lifecycle
    def pause(self) -> None:
        """New batches wait until resume(); returns once the batch in flight (if any) has finished."""
        self._running.clear()
        with self._lock:
            pass

    def resume(self) -> None:
        self._running.set()

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
        """The sampling generator's state (trainer checkpoints save it so a resumed run samples alike)."""
        return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    # ------------------------------------------------------------------------------------------ sampling
    def _sample(self, logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor):
        """logits float32 [B, V], one uniform in [0, 1) per row -> (token [B], logprob [B]).

        Inverse-CDF sampling with one uniform per row and step: a row's draw does not depend on which other
        rows are still running, so dropping finished rows never changes the others' samples."""
        if params.temperature == 0:
            token = logits.argmax(dim=-1)
            logp = torch.log_softmax(logits, dim=-1)
            return token, logp.gather(1, token[:, None])[:, 0]
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = logp.exp()
        order = None
        if params.top_p < 1.0:
            probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
            probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= params.top_p, 0.0)
        cdf = probs.cumsum(dim=-1)
        pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)
        token = (order.gather(1, pick) if order is not None else pick)[:, 0]
        if self.logprob_mode == "raw":
            logp = torch.log_softmax(logits, dim=-1)
        return token, logp.gather(1, token[:, None])[:, 0]

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
        while True:
            self._running.wait()
            with self._lock:
                if self._running.is_set() or self._closed:
                    self._check_open()
                    return self._generate_locked([list(map(int, p)) for p in prompts], params)

    @torch.inference_mode()
    def _generate_locked(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        model, n = self.model, params.n
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else self._generator
        U, P, max_new = len(prompts), max(len(p) for p in prompts), params.max_new_tokens
        total = P + max_new
        pads = torch.tensor([P - len(p) for p in prompts])
        ids = torch.zeros(U, P, dtype=torch.long)
        for u, p in enumerate(prompts):
            ids[u, P - len(p):] = torch.tensor(p)
        cols = torch.arange(total)
        key_ok = cols[None, :] >= pads[:, None]  # [U, total]: False on left padding
        # Prefill: causal, no padded keys; a padded query sees itself only (its output is never used).
        causal = cols[:P, None] >= cols[None, :P]
        mask = (causal & key_ok[:, None, :P]) | torch.eye(P, dtype=torch.bool)
        positions = (cols[None, :P] - pads[:, None]).clamp(min=0)
        cache = model.new_cache(U, total)
        want_routes = params.return_routes
        prompt_routes: list[torch.Tensor] | None = [] if want_routes else None
        logits = model.step(ids, positions, cache, 0, mask[:, None], prompt_routes)
        # Repeat each prompt's state n times: rows are prompt-major (row = u * n + j).
        B = U * n
        rep = torch.arange(U).repeat_interleave(n)
        if n > 1:
            cache.select(rep)
            logits = logits.index_select(0, rep)
        pads_b, key_ok_b = pads[rep], key_ok[rep]
        if want_routes:
            prompt_routes_t = torch.stack(prompt_routes, dim=2)  # [U, P, L, k]
            decode_routes = torch.zeros(B, max(max_new - 1, 1), self.spec.num_moe_layers, self.spec.topk,
                                        dtype=prompt_routes_t.dtype)
        out_tokens = torch.zeros(B, max_new, dtype=torch.long)
        out_logps = torch.zeros(B, max_new, dtype=torch.float32)
        lengths = torch.zeros(B, dtype=torch.long)
        finish = ["length"] * B
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long)
        active = torch.arange(B)  # original row id of each live row
        for t in range(max_new):
            uniform = torch.rand(B, generator=gen, dtype=torch.float64).float()[active]
            token, logp = self._sample(logits, params, uniform)
            out_tokens[active, t], out_logps[active, t] = token, logp
            lengths[active] = t + 1
            done = torch.isin(token, stop) if len(stop) else torch.zeros_like(token, dtype=torch.bool)
            for r in active[done].tolist():
                finish[r] = "stop"
            if t == max_new - 1 or bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).nonzero()[:, 0]
                active, token = active[keep], token[keep]
                cache.select(keep)
                pads_b, key_ok_b = pads_b[keep], key_ok_b[keep]
            col = P + t
            routes_t: list[torch.Tensor] | None = [] if want_routes else None
            logits = model.step(token[:, None], (col - pads_b)[:, None], cache, col,
                                key_ok_b[:, None, None, :col + 1], routes_t)
            if want_routes:
                decode_routes[active, t] = torch.stack(routes_t, dim=2)[:, 0]
        return self._collect(prompts, n, P, pads, out_tokens, out_logps, lengths, finish,
                             prompt_routes_t if want_routes else None, decode_routes if want_routes else None)

    def _collect(self, prompts, n, P, pads, out_tokens, out_logps, lengths, finish, prompt_routes, decode_routes):
        result: list[list[Sample]] = []
        tokens_l, logps_l, lengths_l = out_tokens.tolist(), out_logps.tolist(), lengths.tolist()
        for u, prompt in enumerate(prompts):
            group = []
            for j in range(n):
                r, L = u * n + j, lengths_l[u * n + j]
                routes = None
                if prompt_routes is not None:
                    routes = torch.cat([prompt_routes[u, int(pads[u]):], decode_routes[r, :L - 1]]).numpy()
                    routes = routes.astype(np.int32)
                group.append(Sample(prompt_ids=list(prompt), output_ids=tokens_l[r][:L], logprobs=logps_l[r][:L],
                                    finish_reason=finish[r], weight_version=self.weight_version, routes=routes))
            result.append(group)
        return result
