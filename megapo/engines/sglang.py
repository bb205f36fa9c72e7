"""SGLangEngine: the Engine interface over an SGLang server's HTTP API (GPU clusters; SGLang cannot run on CPU).

- generate: `POST /generate` with `input_ids`, `sampling_params` (n, temperature, top_p, max_new_tokens,
  stop_token_ids, ignore_eos, sampling_seed), `return_logprob` and, when routes are asked for,
  `return_routed_experts` (server flag `--enable-return-routed-experts`). Output tokens and log-probs come from
  `meta_info.output_token_logprobs` ([logprob, token_id, text] per token), the finish reason from
  `meta_info.finish_reason.type`, the weight version from `meta_info.weight_version`, and routes from
  `meta_info.routed_experts`: base64 of a flat array (dtype `meta_info.routed_experts_dtype`, int32 when absent)
  covering positions [0, len(prompt)+len(output)-1), reshaped to [positions, num_moe_layers, topk].
- weights: `/update_weights_from_disk` (model_path, weight_version, flush_cache), and the NCCL path
  `/init_weights_update_group` + `/update_weights_from_distributed` (names/dtypes/shapes over HTTP, tensors
  broadcast by the caller). `update_weights` stages safetensors and loads them from disk. SGLang's
  `/update_weights_from_tensor` is not used: its payload is a pickle (MultiprocessingSerializer).
- pause/resume: `/pause_generation` (mode "retract" by default: running requests go back to the queue and are
  recomputed on the new weights) and `/continue_generation`; `/flush_cache`; `/health`.
- log-probs: SGLang returns log-probs of softmax(logits / temperature) before top-p/top-k, megapo's convention,
  unless the server sets SGLANG_RETURN_ORIGINAL_LOGPROB.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from megapo.replay.routes import compact_routes
from megapo.engines.base import FINISH_REASONS, Engine, EngineCapabilities, Sample, SamplingParams, check_prompts, stage_and_reload
from megapo.engines.http import JSONClient

PAUSE_MODES = ("abort", "retract", "in_place")
_WIRE_DTYPES = {"int32": np.int32, "int16": np.int16, "uint8": np.uint8, "uint16": np.uint16, "int64": np.int64}


def decode_routed_experts(meta_info: dict, num_moe_layers: int, topk: int) -> np.ndarray:
    dtype_name = meta_info.get("routed_experts_dtype") or "int32"
    if dtype_name not in _WIRE_DTYPES:
        raise ValueError(f"unknown routed_experts_dtype {dtype_name!r}")
    flat = np.frombuffer(base64.b64decode(meta_info["routed_experts"]), dtype=_WIRE_DTYPES[dtype_name])
    if flat.size % (num_moe_layers * topk):
        raise ValueError(f"routed_experts has {flat.size} ids, not a multiple of layers*topk={num_moe_layers * topk}")
    return compact_routes(flat).reshape(-1, num_moe_layers, topk)


def moe_shape_from_config(config_dir: str) -> tuple[int, int]:
    from megapo.engines.torch_lm import TorchLMSpec

    spec = TorchLMSpec.from_config(json.loads((Path(config_dir) / "config.json").read_text()))
    return spec.num_moe_layers, spec.topk


class SGLangEngine(Engine):
    # SGLang's own broadcast API (update_weights_from_distributed) is not driven by the train loop yet
    capabilities = EngineCapabilities(weight_syncs=("tensor", "disk"))

    def __init__(self, url: str, *, timeout: float = 600.0, max_concurrency: int = 64, weight_version: int = 0,
                 config_dir: str | None = None, moe_shape: tuple[int, int] | None = None,
                 pause_mode: str = "retract", staging_dir: str | None = None):
        """config_dir: HF folder of the served model (routes' layer/top-k shape; config files for staged weights).
        moe_shape: (num_moe_layers, topk), instead of reading it from config_dir."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.client = JSONClient(url, timeout)
        self.url = self.client.base_url
        self.weight_version = int(weight_version)
        self.config_dir, self.pause_mode, self._staging_root = config_dir, pause_mode, staging_dir
        self._moe_shape = moe_shape
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="megapo-sglang")

    @property
    def moe_shape(self) -> tuple[int, int]:
        if self._moe_shape is None:
            if self.config_dir is None:
                raise ValueError("routes need moe_shape=(num_moe_layers, topk) or config_dir")
            self._moe_shape = moe_shape_from_config(self.config_dir)
        return self._moe_shape

    # ------------------------------------------------------------------------------------------ sampling
    def request_body(self, prompt: list[int], params: SamplingParams, seed: int | None) -> dict:
        if params.entropy_temperature is not None:
            raise ValueError("entropy_temperature: an SGLang server samples at one temperature per request")
        sp = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
              "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
              "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True}
        if seed is not None:
            sp["sampling_seed"] = seed
        body = {"input_ids": list(map(int, prompt)), "sampling_params": sp, "return_logprob": True,
                "logprob_start_len": -1, "top_logprobs_num": 0}
        if params.return_routes:
            body.update(return_routed_experts=True, routed_experts_start_len=0)
        return body

    def generate_one(self, prompt: list[int], params: SamplingParams, seed: int | None) -> list[Sample]:
        out = self.client.post("/generate", self.request_body(prompt, params, seed))
        outs = out if isinstance(out, list) else [out]
        if len(outs) != params.n:
            raise RuntimeError(f"{self.url}: asked for n={params.n} samples, got {len(outs)}")
        return [self._sample(prompt, o, params) for o in outs]

    def _sample(self, prompt: list[int], out: dict, params: SamplingParams) -> Sample:
        meta = out.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        tokens = [int(p[1]) for p in pairs]
        if "output_ids" in out and out["output_ids"] is not None and list(out["output_ids"]) != tokens:
            raise RuntimeError(f"{self.url}: output_ids and output_token_logprobs disagree")
        reason = (meta.get("finish_reason") or {}).get("type") or "abort"
        version = meta.get("weight_version")
        routes = None
        if params.return_routes:
            if meta.get("routed_experts") is None:
                raise RuntimeError(f"{self.url} returned no routed_experts: start SGLang with "
                                   "--enable-return-routed-experts")
            routes = decode_routed_experts(meta, *self.moe_shape)
            if routes.shape[0] != len(prompt) + len(tokens) - 1:
                raise RuntimeError(f"{self.url}: routed_experts cover {routes.shape[0]} positions, expected "
                                   f"{len(prompt) + len(tokens) - 1}")
        return Sample(prompt_ids=list(prompt), output_ids=tokens, logprobs=[float(p[0]) for p in pairs],
                      finish_reason=reason if reason in FINISH_REASONS else "abort",
                      weight_version=int(version) if str(version).lstrip("-").isdigit() else self.weight_version,
                      routes=routes)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        check_prompts(prompts)
        seeds = [None if params.seed is None else params.seed + i * params.n for i in range(len(prompts))]
        futures = [self._pool.submit(self.generate_one, p, params, s) for p, s in zip(prompts, seeds)]
        return [f.result() for f in futures]

    # ------------------------------------------------------------------------------------------ weights
    def _check(self, answer, what: str) -> None:
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RuntimeError(f"{self.url} {what} failed: {answer.get('message')}")

    def update_weights_from_disk(self, path: str, version: int) -> None:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"path {path!r} is not a folder")
        answer = self.client.post("/update_weights_from_disk", {
            "model_path": str(Path(path).resolve()), "weight_version": str(int(version)), "flush_cache": True})
        self._check(answer, "update_weights_from_disk")
        self.weight_version = int(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        stage_and_reload(self, self.config_dir, self._staging_root, named_tensors, version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """The server's ranks join a process group with the trainer (trainer = rank 0, servers from rank_offset)."""
        answer = self.client.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})
        self._check(answer, "init_weights_update_group")

    def update_weights_from_distributed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                                        broadcast: Callable[[torch.Tensor], None],
                                        group_name: str = "weight_update_group") -> None:
        """Announce names/dtypes/shapes over HTTP while `broadcast(tensor)` sends each tensor over the group
        (e.g. `lambda t: torch.distributed.broadcast(t, src=0, group=g)`); the HTTP call returns once the
        server has received and loaded them all."""
        tensors = list(named_tensors)
        body = {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "group_name": group_name, "flush_cache": True,
                "weight_version": str(int(version))}
        answer: dict = {}

        def call() -> None:
            try:
                answer["value"] = self.client.post("/update_weights_from_distributed", body)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                answer["error"] = err

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        for _, t in tensors:
            broadcast(t)
        thread.join()
        if "error" in answer:
            raise answer["error"]
        self._check(answer.get("value"), "update_weights_from_distributed")
        self.weight_version = int(version)

    # ------------------------------------------------------------------------------------------ lifecycle
    def pause(self) -> None:
        self.client.post("/pause_generation", {"mode": self.pause_mode})

    def resume(self) -> None:
        self.client.post("/continue_generation", {})

    def flush_cache(self) -> None:
        self.client.post("/flush_cache")

    def health(self) -> bool:
        return self.client.alive("/health")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
