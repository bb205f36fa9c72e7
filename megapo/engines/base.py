"""The rollout Engine interface (docs/CONTRACTS.md) shared by the embedded engine, vLLM, SGLang and the router.

Conventions every engine keeps:
- Token in, token out: prompts are lists of token ids; nothing is decoded or re-tokenised.
- `stop_token_ids` is the complete set of ids that end a sample; an engine adds none of its own (no implicit
  EOS), so every engine stops at the same tokens. The stop token is the last output token.
- `logprobs[i]` is the log-probability of `output_ids[i]` under the distribution the token was sampled from,
  before top-p truncation: log_softmax(logits / temperature). At temperature 1 this is exactly log pi(token) of
  the policy; at temperature 0 (greedy) it is the temperature-1 log-prob. With `entropy_temperature` the
  temperature is each token's own (EntropyTemperature.temperatures).
- `routes` (when `return_routes`) holds, for every position fed to the model (prompt and every output token but
  the last, which is never fed), the top-k expert ids each MoE layer chose: int [len(prompt)+len(output)-1,
  num_moe_layers, topk], in layer order and the router's top-k order.
- `weight_version` of a Sample is the version of the weights that produced all of its tokens (a partial
  rollout, continued across a weight update: the oldest; `token_versions` holds each token's).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

FINISH_REASONS = ("stop", "length", "abort")
ROUTE_SUPPORT = ("yes", "cuda", "no")


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared by its class (`Engine.capabilities`). Config validation and the trainer
    ask this (megapo.engines.registry), never the engine's name."""

    in_process: bool = False  # runs in the trainer's process on megapo's PyTorch model (megapo.engines.torch_lm)
    weight_syncs: tuple[str, ...] = ("disk",)  # the rollout.weight_sync values `megapo train` drives for it
    routes: str = "yes"  # returns each token's experts (R3): yes | cuda (only where CUDA is available) | no
    routes_note: str = ""  # why not, where `routes` is not yes
    rng_state: bool = False  # rng_state() / set_rng_state(): a resumed run samples as the unstopped one would
    starts_server: bool = False  # megapo starts a server of it itself when rollout.servers is empty
    api_key: bool = False  # its servers answer only requests with their key (rollout.api_key_file)
    sessions: bool = False  # generate(..., sessions=) keeps a multi-turn trajectory on one server; end_sessions()
    partial: bool = False  # preempt(): a batch in flight stops and continues its samples on the new weights
    router_noise: bool = False  # takes a router_noise dose (rollout.router_noise: N(0, σ²) on its router logits)
    adaptive_temperature: bool = False  # samples each token at its own temperature (SamplingParams.entropy_temperature)
    abort_rule: bool = False  # stops a row on a marker rule mid-generation (SamplingParams.abort: duet's abort)
    default_dtype: str = "bfloat16"  # the compute dtype rollout.dtype=auto resolves to

    def __post_init__(self) -> None:
        if self.routes not in ROUTE_SUPPORT:
            raise ValueError(f"routes must be one of {ROUTE_SUPPORT}, got {self.routes!r}")

    def returns_routes(self) -> tuple[bool, str]:
        """Whether this engine returns routes on this machine, and why not."""
        if self.routes == "cuda":
            return (True, "") if torch.cuda.is_available() else (False, self.routes_note)
        return self.routes == "yes", self.routes_note


@dataclass(frozen=True)
class EntropyTemperature:
    """HAPO's entropy-adaptive sampling temperature (Liu et al. 2025, From Uniform to Heterogeneous: Tailoring Policy
    Optimization to Every Token's Nature, arXiv:2509.16591; its authors' vLLM sampler,
    compute_entropy_based_temperature): each token is drawn at T·(1 + τ·ĥ), ĥ the entropy H of its next-token
    distribution (the raw logits) scored against the last train batch's statistics of π_old's entropy
    (objectives.hapo_entropy_stats): z = (log max(H, 1e-6) − centre) / (scale + 1e-6), ĥ = z / top above the centre
    and z / |bottom| at or below it, clamped to [-1, 1]. [A] The released code scales the low side by 1 / bottom
    (negative), turning it positive; as for the clip, we keep the sign the abstract's asymmetry needs, so
    low-entropy tokens are drawn cooler and high-entropy ones hotter."""

    tau: float  # τ: the relative range of the temperature (the authors' temperature_tau, 0.05)
    centre: float  # the pivot quantile of log H over the batch's policy tokens
    scale: float  # their root-mean-square deviation from it
    top: float  # the batch's largest standardised log-entropy (> 0)
    bottom: float  # its smallest (< 0)

    def __post_init__(self) -> None:
        for name in ("tau", "centre", "scale", "top", "bottom"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise ValueError(f"EntropyTemperature.{name} must be a finite number, got {value!r}")
        if not 0 <= self.tau < 1 or self.scale < 0 or self.top <= 0 or self.bottom >= 0:
            raise ValueError(f"EntropyTemperature: needs 0 <= tau < 1, scale >= 0, top > 0 > bottom; got {self!r}")

    def temperatures(self, logits: torch.Tensor, base: float) -> torch.Tensor:
        """[B] each row's temperature from its logits [B, V] (float32)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        z = (entropy.clamp(min=1e-6).log() - self.centre) / (self.scale + 1e-6)
        h_hat = torch.where(z > 0, z / self.top, z / -self.bottom).clamp(-1.0, 1.0)
        return base * (1.0 + self.tau * h_hat)


@dataclass(frozen=True)
class AbortRule:
    """A marker-gated stop inside the decode loop (DUET's abort rule, megapo/algorithms/duet.py), honoured by the
    engines whose capabilities say abort_rule: a row still running once it holds `at` output tokens (it did not end
    with a stop token at or before them) ends there with finish_reason "abort", its `at` tokens kept, unless
    keep[row] or passes(its `at` output ids) (its answer marker came in time). Rows are the call's, prompt-major
    (row = prompt * n + sample). The aborted row's tokens equal those of the same row generated without the rule,
    cut at `at`."""

    at: int  # output tokens after which a running row is judged (duet: horizon + grace)
    keep: tuple[bool, ...]  # per row: drew "keep" before generation, never aborted here
    passes: Callable[[list[int]], bool]  # a row's first `at` output ids -> True: it continues (marker present)

    def __post_init__(self) -> None:
        if isinstance(self.at, bool) or not isinstance(self.at, int) or self.at < 1:
            raise ValueError(f"AbortRule.at must be an int >= 1, got {self.at!r}")
        object.__setattr__(self, "keep", tuple(bool(k) for k in self.keep))
        if not callable(self.passes):
            raise ValueError(f"AbortRule.passes must be callable, got {self.passes!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    return_routes: bool = False
    seed: int | None = None
    entropy_temperature: EntropyTemperature | None = None  # HAPO's per-token temperature (engines that say so)
    abort: AbortRule | None = None  # duet's in-engine abort (engines whose capabilities say abort_rule)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # one per output token
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    routes: np.ndarray | None = field(default=None, repr=False)  # int [len(prompt)+len(output)-1, layers, topk]
    # partial rollouts: the weight version of each output token (None: all are weight_version); weight_version is
    # then the oldest of them
    token_versions: list[int] | None = None


def versions_of(sample: Sample) -> list[int]:
    """The weight version of each of a sample's output tokens."""
    return list(sample.token_versions) if sample.token_versions is not None else \
        [sample.weight_version] * len(sample.output_ids)


def joined(head: Sample, tail: Sample) -> Sample:
    """A preempted sample `head` and its continuation `tail` (drawn from head's prompt + output) as one sample:
    tokens and log-probs end to end, each token's version, the oldest as weight_version, and the routes of every
    fed position as the weights that fed it chose (head's up to its last fed token, then tail's)."""
    routes = None
    if head.routes is not None and tail.routes is not None:
        fed = len(head.prompt_ids) + len(head.output_ids) - 1  # head's positions fed before the preemption
        routes = np.concatenate([np.asarray(head.routes)[:fed], np.asarray(tail.routes)[fed:]])
    versions = versions_of(head) + versions_of(tail)
    return Sample(prompt_ids=list(head.prompt_ids), output_ids=head.output_ids + tail.output_ids,
                  logprobs=head.logprobs + tail.logprobs, finish_reason=tail.finish_reason,
                  weight_version=min(versions), routes=routes, token_versions=versions)


def check_prompts(prompts: list[list[int]], vocab_size: int | None = None) -> None:
    """Clear errors for malformed prompts, before any work starts."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
        if vocab_size is not None:
            bad = [t for t in p if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")


class Engine(abc.ABC):
    """Generates samples and takes new weights. All methods are blocking."""

    weight_version: int = 0
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        """n samples per prompt, in prompt order."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors (any subset of the model) and set weight_version = version."""

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load an HF folder of safetensors and set weight_version = version."""

    @abc.abstractmethod
    def pause(self) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def health(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stage_and_reload(engine: Engine, config_dir, staging_root, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
    """`update_weights` for servers that only reload from disk: write the tensors as one safetensors file
    beside copies of the model's config and tokenizer files, reload the server from there, then remove it."""
    import shutil
    import tempfile
    from pathlib import Path

    from megapo.weights.safetensors_io import save_tensors

    if config_dir is None:
        raise ValueError("update_weights needs config_dir (the HF folder of the served model) to stage weights")
    stage = Path(tempfile.mkdtemp(prefix="megapo-weights-", dir=staging_root))
    try:
        for f in Path(config_dir).iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, stage / f.name)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        if not tensors:
            raise ValueError("named_tensors is empty")
        save_tensors(stage / "model.safetensors", tensors)
        engine.update_weights_from_disk(str(stage), version)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
