"""VLLMEngine: the Engine interface over a vLLM (0.32) server's HTTP API.

- generate: token-in/token-out `POST /inference/v1/generate` (server flag `--enable-scale-out`), one request per
  prompt carrying n, with `logprobs=0` (the sampled token's log-prob only), `ignore_eos` and megapo's explicit
  stop ids (see base.py), `detokenize=false`. Requests run concurrently from a thread pool.
- weights: `update_weights_from_disk` pauses (mode=wait: the batch in flight finishes on the old weights),
  calls the worker extension's `megapo_reload_weights` through `/collective_rpc`, clears the prefix cache
  (cached KV blocks were computed by the old weights), sets the version (`/update_weight_version`) and resumes.
  `update_weights` writes the tensors as safetensors into a staging folder and reloads from there.
  Broadcast: `join_weight_groups` once, then `receive_weights(version)` per sync while the learner sends
  (megapo.weights.broadcast; the worker extension streams what it receives into vLLM's reload).
- log-probs: megapo's convention (log_softmax(logits / T), see base.py) needs the server started with
  `--logprobs-mode processed_logprobs` (megapo.engines.server does); with top_p < 1 vLLM's processed log-probs are
  renormalised over the nucleus, so they differ from the embedded engine's by log(nucleus mass).
- access: servers started by megapo (megapo.engines.server) answer only requests that carry their API key
  (`api_key`, sent on every request; megapo.engines.auth); check_access() tells a wrong or missing key apart.
- partial rollouts (`preempt`): `POST /pause?mode=abort` ends the requests in flight; vLLM answers each one's
  non-streamed request with everything sampled so far (finish_reason abort: its final output holds all tokens and
  log-probs, so no streaming is needed). Once `resume()` has run (after the new weights), each cut sample goes on
  as a new request on prompt + its tokens, for the tokens left, with the same sampling params. Each token's
  version comes from the server's weight_versions spans.
- routes: vLLM returns `routed_experts` only when started with `--enable-return-routed-experts`, which needs
  model runner V2 (Triton, so not on CPU); asking for routes from a server that sends none is an error.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from megapo.replay.routes import compact_routes
from megapo.engines.base import (FINISH_REASONS, Engine, EngineCapabilities, Sample, SamplingParams, check_prompts,
                                 joined, stage_and_reload, versions_of)
from megapo.engines.auth import IDENTITY_PATH
from megapo.engines.http import HTTPError, JSONClient
from megapo.weights.broadcast import GroupAddress


def decode_routed_experts(payload: str) -> np.ndarray:
    """vLLM's routed_experts: base64 of `.npy` bytes, shape [num_tokens - 1, layers, topk]."""
    return compact_routes(np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False))


def vllm_sampling_params(params: SamplingParams, seed: int | None) -> dict:
    if params.entropy_temperature is not None:
        raise ValueError("entropy_temperature: a vLLM server samples at one temperature per request")
    sp = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
          "max_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True,
          "logprobs": 0, "detokenize": False, "skip_special_tokens": False}
    if seed is not None:
        sp["seed"] = seed  # vLLM gives the i-th of n samples seed + i
    return sp


def token_versions(spans: list[dict] | None, count: int, default: int) -> list[int]:
    """Each output token's weight version from vLLM's weight_versions spans ({version, start, end}: tokens
    [start, end) were sampled by weights labelled version); tokens no span labels with an int get `default` (the
    client's version when the request was sent: a server never told a version labels none)."""
    versions = [default] * count
    for span in spans or []:
        label = str(span.get("version"))
        if label.lstrip("-").isdigit():
            lo, hi = max(0, int(span["start"])), min(count, int(span["end"]))
            versions[lo:hi] = [int(label)] * max(0, hi - lo)
    return versions


class VLLMEngine(Engine):
    capabilities = EngineCapabilities(
        weight_syncs=("disk", "broadcast"), starts_server=True, api_key=True, routes="cuda", partial=True,
        routes_note="vLLM returns routed experts only with model runner V2, which needs Triton (a GPU)")
    max_versions = 0  # partial rollouts: most weight versions one sample may span (0: no bound)

    def __init__(self, url: str, *, timeout: float = 600.0, max_concurrency: int = 64, weight_version: int = 0,
                 staging_dir: str | None = None, config_dir: str | None = None, server=None,
                 api_key: str | None = None):
        """url: http://HOST:PORT of a running server. config_dir: HF folder whose config/tokenizer files go
        next to staged weights (update_weights). server: a megapo.engines.server.VLLMServer to stop on close().
        api_key: the server's key (default: the key of `server`, if given)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if api_key is None and server is not None:
            api_key = server.api_key
        self.client = JSONClient(url, timeout, api_key=api_key)
        self.url = self.client.base_url
        self.weight_version = int(weight_version)
        self.config_dir = config_dir
        self._staging_root = staging_dir
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="megapo-vllm")
        self._server = server
        self._open = threading.Event()  # cleared by preempt(), set by resume(): requests wait while it is clear
        self._open.set()
        self._preempts = 0  # preempt() calls so far: an abort after one is a preemption, and continues

    # ------------------------------------------------------------------------------------------ sampling
    def generate_one(self, prompt: list[int], params: SamplingParams, seed: int | None) -> list[Sample]:
        """One prompt, n samples: a single HTTP request (and one more per sample a preemption cut)."""
        before = self._preempts
        samples = self._request(prompt, params, seed)
        if self._preempts == before:
            return samples
        return [self._continued(s, params, None if seed is None else seed + j) for j, s in enumerate(samples)]

    def _request(self, prompt: list[int], params: SamplingParams, seed: int | None) -> list[Sample]:
        self._open.wait()  # preempted: new requests go once the new weights are loaded and the server resumed
        version = self.weight_version
        body = {"token_ids": list(map(int, prompt)), "sampling_params": vllm_sampling_params(params, seed),
                "output_mode": "tokens"}
        out = self.client.post("/inference/v1/generate", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != params.n:
            raise RuntimeError(f"{self.url}: asked for n={params.n} samples, got {len(choices)}")
        return [self._sample(prompt, c, params, version) for c in choices]

    def _continued(self, sample: Sample, params: SamplingParams, seed: int | None) -> Sample:
        """A sample cut by preempt(), continued from its tokens on the current weights until it ends; one that
        would span more than max_versions versions starts again from its prompt."""
        while sample.finish_reason == "abort":
            restart = bool(self.max_versions) and len(set(versions_of(sample))) >= self.max_versions
            context = sample.prompt_ids + ([] if restart else sample.output_ids)
            left = params.max_new_tokens - (0 if restart else len(sample.output_ids))
            before = self._preempts
            [tail] = self._request(context, replace(params, n=1, max_new_tokens=left), seed)
            sample = tail if restart else joined(sample, tail)
            if self._preempts == before:  # an abort no preemption caused: kept as it is
                break
        return sample

    def _sample(self, prompt: list[int], choice: dict, params: SamplingParams, version: int) -> Sample:
        tokens = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        if [c["token_id"] for c in content] != tokens:
            raise RuntimeError(f"{self.url}: log-probs do not line up with the output tokens")
        routes = None
        if params.return_routes:
            if choice.get("routed_experts") is None:
                raise RuntimeError(f"{self.url} returned no routed_experts: start vLLM with "
                                   "--enable-return-routed-experts (needs model runner V2, i.e. a GPU)")
            routes = decode_routed_experts(choice["routed_experts"])
        reason = choice.get("finish_reason") or "abort"
        versions = token_versions(choice.get("weight_versions"), len(tokens), version)
        return Sample(prompt_ids=list(prompt), output_ids=tokens, logprobs=[float(c["logprob"]) for c in content],
                      finish_reason=reason if reason in FINISH_REASONS else "abort",
                      weight_version=min(versions, default=version), routes=routes,
                      token_versions=versions if len(set(versions)) > 1 else None)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        check_prompts(prompts)
        seeds = [None if params.seed is None else params.seed + i * params.n for i in range(len(prompts))]
        if len(prompts) == 1:  # one request (the Router sends these from its own threads): no hop through the pool
            return [self.generate_one(prompts[0], params, seeds[0])]
        futures = [self._pool.submit(self.generate_one, p, params, s) for p, s in zip(prompts, seeds)]
        return [f.result() for f in futures]

    # ------------------------------------------------------------------------------------------ weights
    def update_weights_from_disk(self, path: str, version: int) -> None:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"path {path!r} is not a folder")
        self._load_weights({"method": "megapo_reload_weights",
                            "kwargs": {"weights_path": str(Path(path).resolve())}}, version)

    def _load_weights(self, rpc: dict, version: int) -> None:
        """Paused: the worker extension's `rpc` loads new weights, the prefix cache (KV blocks of the old
        weights) is cleared and the server's weight version set."""
        self.pause()
        try:
            self.client.post("/collective_rpc", rpc)
            self._reset_prefix_cache(version)
            self.client.post("/update_weight_version", {"new_version": str(int(version))})
            self.weight_version = int(version)
        finally:
            self.resume()

    def _reset_prefix_cache(self, version: int, tries: int = 20) -> None:
        """Drop the KV blocks of the old weights. vLLM answers {"success": false} while some request still holds
        blocks; a prefix cache left in place would serve KV of the old weights to the new version's requests
        (prefix hashes are by token ids), so a reset that never succeeds stops the sync."""
        for _ in range(tries):
            answer = self.client.post("/reset_prefix_cache")
            if not (isinstance(answer, dict) and answer.get("success") is False):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.url}: the prefix cache could not be reset after loading weight version {version} "
                           f"({tries} tries): requests still hold KV blocks of the old weights")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stage the tensors as one safetensors file (plus config files) and reload from there."""
        stage_and_reload(self, self.config_dir, self._staging_root, named_tensors, version)

    # broadcast (megapo.weights.broadcast): the server's worker is a receiving rank of the learner's groups
    workers = 1  # receiving ranks per server: its tensor-parallel workers (megapo starts TP=1 servers)

    def join_weight_groups(self, address: GroupAddress, rank_offset: int, stages: int) -> None:
        """Make the server's workers join the weight-sync group of every learner stage as ranks rank_offset..;
        blocks until the whole group has joined, so the learner's stage roots join at the same time."""
        self.client.post("/collective_rpc", {"method": "megapo_join_weight_groups", "kwargs": {
            "host": address.host, "base_port": address.base_port, "workers": address.workers,
            "rank_offset": rank_offset, "stages": stages, "timeout_s": address.timeout_s,
            "threads": address.threads, "backend": address.backend, "generation": address.generation}},
            timeout=address.timeout_s + 30)

    def receive_weights(self, version: int) -> None:
        """The server's side of one broadcast sync: returns once the workers have loaded and acknowledged it
        (the learner sends at the same time, from another thread or process)."""
        self._load_weights({"method": "megapo_receive_weights"}, version)

    # ------------------------------------------------------------------------------------------ lifecycle
    def pause(self) -> None:
        self.client.post("/pause?mode=wait")

    def resume(self) -> None:
        self.client.post("/resume")
        self._open.set()

    def preempt(self) -> None:
        """Partial rollouts: the requests in flight end now (`/pause?mode=abort`), keeping their tokens, and new
        ones wait; once the new weights are loaded and resume() has run, each cut sample continues on them.
        Call before the weight update (whose pause and resume follow)."""
        self._open.clear()
        self._preempts += 1
        self.client.post("/pause?mode=abort")

    def health(self) -> bool:
        return self.client.alive("/health")

    def check_access(self, key_source: str = "api_key") -> None:
        """PermissionError naming `key_source` when the server refuses this client's key (or its lack of one)."""
        try:
            self.client.get(IDENTITY_PATH, timeout=30)
        except HTTPError as err:
            if err.status == 401:
                raise PermissionError(f"{self.url} refuses this client's API key: give the key file that server "
                                      f"was started with ({key_source})") from None
            raise

    def server_weight_version(self) -> str | None:
        return self.client.get("/weight_info").get("weight_version")

    def close(self) -> None:
        self._open.set()  # requests waiting for a resume go on (and fail on the closed server)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.stop()
            self._server = None

