"""A small pure-PyTorch decoder forward with a KV cache, for the embedded engine.

Built from the learner's `megapo.models.family.ModelSpec` (the family's own reading of config.json; this module
reads no config field of its own but hidden_act and sliding windows) and HF-named tensors; no transformers and
no Megatron at run time. Families:
- qwen3_moe: q/k RMSNorm, top-k softmax router (top-k renormalised when norm_topk_prob);
- qwen3: dense with q/k RMSNorm;
- qwen2: dense with q/k/v bias, no q/k norm;
- mixtral: softmax-then-top-k renormalised router (equal to a softmax over the selected logits), experts w1/w3/w2;
- deepseek_v3: multi-latent attention (q through the q_lora_rank bottleneck or not, one kv latent and one shared
  rotary key per token, interleaved rotary dims), a sigmoid router whose expert bias only chooses the experts,
  group-limited (a token's best topk_group of n_group groups, a group scored by the sum of its top-2 biased
  scores), gates = sigmoid scores at the chosen experts renormalised times routed_scaling_factor, shared experts
  added to every MoE layer, the first first_k_dense_replace layers dense.
- glm4_moe: GQA with q/k/v bias and optional q/k RMSNorm, partial rotary (rotate-half within the first
  head_dim * rotary_percent dims of each head), and deepseek_v3's router, shared experts and dense first layers.
- gpt_oss: GQA with q/k/v/o biases and a learnable sink logit per head (in every softmax row, then dropped),
  sliding-window layers (a query sees itself and the sliding_window - 1 keys before it), a router with bias
  (top-k of the logits, softmax over the k), experts with biases kept in transformers' fused layout
  (gate_up_proj [E, H, 2F] with gate/up interleaved, down_proj [E, F, H]) and its clamped GLU:
  min(gate, limit) * sigmoid(1.702 min(gate, limit)) * (clamp(up, -limit, limit) + 1).
Every family: RMSNorm pre-norm, rotary embedding, SiLU-gated MLP; GQA attention except deepseek_v3's MLA.

Weights live in fused tensors (qkv, gate_up, stacked experts) so a forward is few large ops; every HF name maps to
a view of one of them, so a weight update copies in place and never reallocates. A layer's expert (or dense MLP)
weights share one buffer in HF order (gate, up, down per expert).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megapo.models.family import MLASpec, ModelSpec, YarnSpec


@dataclass(frozen=True)
class TorchLMSpec:
    """The engine's view of a ModelSpec (`from_model_spec`): the same architecture, in this module's names."""

    family: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # GQA: per head; MLA: the query/key head (qk_nope + qk_rope)
    rms_eps: float
    rope_theta: float
    max_positions: int
    qk_norm: bool
    qkv_bias: bool
    ffn: int  # dense-layer MLP width
    moe_ffn: int  # expert MLP width
    experts: int
    topk: int
    norm_topk: bool  # the k gates renormalised to sum 1
    moe_layers: tuple[bool, ...]  # per layer: MoE or dense MLP
    tie_embeddings: bool
    router_score: str = "softmax"  # "softmax" | "sigmoid"
    expert_bias: bool = False  # a per-expert bias added to the scores to choose the experts (not to the gates)
    router_groups: int = 0  # group-limited routing: this many equal expert groups (0: off) ...
    router_group_topk: int = 0  # ... of which a token may use this many
    router_scaling: float = 1.0  # the k gates are multiplied by it
    shared_ffn: int = 0  # width of the shared experts' MLP on every MoE layer (0: none)
    mla: MLASpec | None = None  # multi-latent attention (deepseek_v3); None: GQA
    rotary_percent: float = 1.0  # GQA: the rotary turns the first head_dim * rotary_percent dims (glm4_moe: 0.5)
    # gpt_oss (see ModelSpec): biases on o_proj, router and experts; attention sinks; sliding-window layers;
    # experts in transformers' fused interleaved layout with the clamped quick-GELU GLU
    linear_bias: bool = False
    sinks: bool = False
    sliding_window: int = 0
    window_layers: tuple[bool, ...] = ()
    glu_clamp: float = 0.0
    glu_linear_offset: float = 0.0
    yarn: YarnSpec | None = None  # YaRN rope scaling (gpt_oss); None: plain RoPE
    # The HF names of a MoE layer (ModelSpec.hf_moe_module, hf_expert_names): its module and each expert's
    # gate / up / down; or fused_experts: kept as transformers' gpt-oss holds them (gate_up [E, H, 2F] interleaved,
    # down [E, F, H], with biases; ModelSpec.hf_fused_experts), with the clamped quick-GELU GLU
    moe_module: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_experts: bool = False

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def rope_dim(self) -> int:
        """Dimensions the rotary embedding turns: every head dim (GQA) or MLA's rotary part."""
        return self.mla.qk_rope_head_dim if self.mla else int(self.head_dim * self.rotary_percent)

    @property
    def cache_heads(self) -> int:
        """Heads of the KV cache: the KV groups (GQA), every head (MLA: keys and values kept expanded)."""
        return self.heads if self.mla else self.kv_heads

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @classmethod
    def from_model_spec(cls, spec: ModelSpec) -> "TorchLMSpec":
        if spec.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"{spec.family}: router score function {spec.router_score!r} is not supported")
        if spec.activation != ("quick_gelu" if spec.hf_fused_experts else "silu"):  # what _fused_expert / _moe compute
            raise ValueError(f"{spec.family}: expert activation {spec.activation!r} is not supported")
        sigmoid = spec.router_score == "sigmoid"
        return cls(
            family=spec.family, vocab_size=spec.vocab_size, hidden=spec.hidden_size, layers=spec.num_layers,
            heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, rms_eps=spec.norm_eps,
            rope_theta=spec.rope_theta, max_positions=spec.max_positions, qk_norm=spec.qk_norm and spec.mla is None,
            qkv_bias=spec.qkv_bias, ffn=spec.ffn_hidden_size, moe_ffn=spec.moe_ffn_hidden_size,
            experts=spec.num_experts, topk=spec.topk,
            # softmax: Megatron's top-k-then-softmax (not pre-softmax) is a renormalised softmax over all experts;
            # sigmoid: the family spec admits renormalised gates only (Megatron renormalises when k > 1)
            norm_topk=spec.topk > 1 if sigmoid else not spec.router_pre_softmax,
            moe_layers=tuple(spec.is_moe_layer(i) for i in range(spec.num_layers)),
            tie_embeddings=spec.tied_embeddings, router_score=spec.router_score,
            expert_bias=spec.router_expert_bias, router_groups=spec.router_groups,
            router_group_topk=spec.router_group_topk, router_scaling=spec.router_scaling,
            shared_ffn=spec.shared_expert_ffn, mla=spec.mla, rotary_percent=spec.rotary_percent,
            linear_bias=spec.linear_bias, sinks=spec.attention_sinks, sliding_window=spec.sliding_window,
            window_layers=spec.window_layers, glu_clamp=spec.glu_clamp, glu_linear_offset=spec.glu_linear_offset,
            yarn=spec.yarn, moe_module=spec.hf_moe_module, expert_names=spec.hf_expert_names,
            fused_experts=spec.hf_fused_experts)

    @classmethod
    def from_config(cls, cfg: dict) -> "TorchLMSpec":
        """From an HF config.json through its family's ModelSpec (ValueError / KeyError: the reason it cannot run)."""
        from megapo.models.family import FAMILIES, families_where, family_for

        supported = families_where(lambda f: f.engine)
        if cfg.get("model_type") not in FAMILIES or not family_for(cfg).engine:
            raise ValueError(f"config.json model_type must be one of {supported}, got {cfg.get('model_type')!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
        if cfg.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not supported by the embedded engine")
        return cls.from_model_spec(family_for(cfg).spec(cfg))


class KVCache:
    """Per-layer K [batch, cache_heads, max_len, head_dim] and V [..., v_head_dim]: a forward of B rows uses rows
    0..B-1. Row moves (a prompt's state split among its samples as they draw different tokens, finished ones
    dropping out) copy into a second buffer of the same shape, which then becomes the cache: no allocation per step,
    and one cache can serve many batches (`fits`). MLA's keys and values are kept expanded per head, not as the kv
    latent: a decode step then costs what a GQA one does, at more memory per token, which the small models this
    engine runs can afford."""

    def __init__(self, spec: TorchLMSpec, batch: int, max_len: int, dtype: torch.dtype):
        self.batch, self.max_len = batch, max_len
        k_shape = (batch, spec.cache_heads, max_len, spec.head_dim)
        v_shape = (batch, spec.cache_heads, max_len, spec.v_head_dim)
        self.k = [torch.empty(k_shape, dtype=dtype) for _ in range(spec.layers)]
        self.v = [torch.empty(v_shape, dtype=dtype) for _ in range(spec.layers)]
        self._spare: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # made at the first row move

    def fits(self, batch: int, max_len: int) -> bool:
        return batch <= self.batch and max_len <= self.max_len

    def _swap(self, moved: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        self._spare, (self.k, self.v) = (self.k, self.v), moved

    def _spare_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._spare is None:
            self._spare = ([torch.empty_like(t) for t in self.k], [torch.empty_like(t) for t in self.v])
        return self._spare

    def compact(self, keep: torch.Tensor, columns: int) -> None:
        """Rows `keep` become rows 0..len(keep)-1, columns 0..columns-1 (a row may be taken more than once)."""
        spare = self._spare_buffers()
        for src, dst in zip(self.k + self.v, spare[0] + spare[1]):
            torch.index_select(src[:, :, :columns], 0, keep, out=dst[:len(keep), :, :columns])
        self._swap(spare)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF (float32 variance, then weight * normed in the input dtype).
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding; cos/sin are cat(freqs, freqs). interleaved (DeepSeek): the rotary dims are pairs
    (x0, x1), (x2, x3), ..., rotated pair by pair and written out as [even dims, odd dims], as transformers does."""
    if not interleaved:
        return x * cos + _rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def _rotate_first(x: torch.Tensor, rope, dims: int) -> torch.Tensor:
    """Partial rotary (glm4_moe): the first `dims` dims of each head turned (rotate-half), the others passed."""
    return torch.cat((_rotate(x[..., :dims], *rope, False), x[..., dims:]), dim=-1)


def _yarn_inv_freq(inv_freq: torch.Tensor, yarn: YarnSpec, dim: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dims that turn more than beta_fast times over original_max_positions keep their
    frequency, those turning fewer than beta_slow times are divided by factor, linear in between (bounds rounded
    outward when truncate); cos/sin scaled by 0.1 ln(factor) + 1."""
    def dim_of(rotations: float) -> float:
        return dim * math.log(yarn.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    scale = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0
    return inv_freq / yarn.factor * (1 - keep) + inv_freq * keep, scale


def _mlp_weights(experts: int, ffn: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2*ffn, hidden] and down [E, hidden, ffn] as views of one buffer holding, per expert, its
    gate, up and down weights back to back: the order of an HF checkpoint and of a Megatron learner's
    parameters, so a weight sync can write a layer's experts in one piece (megapo.weights.broadcast)."""
    block = torch.zeros(experts, 3 * ffn * hidden, dtype=dtype)
    gate_up = block[:, :2 * ffn * hidden].unflatten(1, (2 * ffn, hidden))
    down = block[:, 2 * ffn * hidden:].unflatten(1, (hidden, ffn))
    return gate_up, down


def _mlp(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = F.linear(h, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


class TorchCausalLM:
    """Weights + forward. `step` runs T new tokens per row against a KV cache; `logits` is a plain full forward."""

    def __init__(self, spec: TorchLMSpec, dtype: torch.dtype = torch.float32):
        self.spec, self.dtype = spec, dtype
        s = spec
        z = lambda *shape: torch.zeros(shape, dtype=dtype)  # noqa: E731
        self.embed = z(s.vocab_size, s.hidden)
        self.lm_head = self.embed if s.tie_embeddings else z(s.vocab_size, s.hidden)
        self.final_norm = z(s.hidden)
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for moe in s.moe_layers:
            layer = dict(ln1=z(s.hidden), ln2=z(s.hidden), **(self._mla_weights() if s.mla else self._gqa_weights()))
            if moe and s.fused_experts:
                layer.update(router=z(s.experts, s.hidden), router_bias=z(s.experts),
                             gate_up=z(s.experts, s.hidden, 2 * s.moe_ffn), gate_up_bias=z(s.experts, 2 * s.moe_ffn),
                             down=z(s.experts, s.moe_ffn, s.hidden), down_bias=z(s.experts, s.hidden))
            elif moe:
                gate_up, down = _mlp_weights(s.experts, s.moe_ffn, s.hidden, dtype)
                layer.update(router=z(s.experts, s.hidden), gate_up=gate_up, down=down,
                             expert_bias=torch.zeros(s.experts, dtype=torch.float32) if s.expert_bias else None)
                if s.shared_ffn:
                    shared_gate_up, shared_down = _mlp_weights(1, s.shared_ffn, s.hidden, dtype)
                    layer.update(shared_gate_up=shared_gate_up[0], shared_down=shared_down[0])
            else:
                gate_up, down = _mlp_weights(1, s.ffn, s.hidden, dtype)
                layer.update(gate_up=gate_up[0], down=down[0])
            self.layers.append(layer)
        self.weight_views = self._hf_names()  # HF name -> the view of our tensors it loads into
        d = s.rope_dim
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        scale = 1.0
        if s.yarn is not None:
            inv_freq, scale = _yarn_inv_freq(inv_freq, s.yarn, d, s.rope_theta)
        freqs = torch.outer(torch.arange(s.max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _gqa_weights(self) -> dict[str, torch.Tensor | None]:
        s, dtype = self.spec, self.dtype
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        z = lambda *shape: torch.zeros(shape, dtype=dtype)  # noqa: E731
        return dict(qkv=z(q + 2 * kv, s.hidden), o=z(s.hidden, q), qkv_bias=z(q + 2 * kv) if s.qkv_bias else None,
                    q_norm=z(s.head_dim) if s.qk_norm else None, k_norm=z(s.head_dim) if s.qk_norm else None,
                    o_bias=z(s.hidden) if s.linear_bias else None, sinks=z(s.heads) if s.sinks else None)

    def _mla_weights(self) -> dict[str, torch.Tensor | None]:
        """MLA: `qkv_a` = [q_a_proj (or q_proj without a q bottleneck); kv_a_proj_with_mqa] fused (both read the
        hidden state), q_b_proj, kv_b_proj, the two latents' RMSNorms and o_proj."""
        s, m, dtype = self.spec, self.spec.mla, self.dtype
        z = lambda *shape: torch.zeros(shape, dtype=dtype)  # noqa: E731
        q_rows = m.q_lora_rank or s.heads * s.head_dim
        return dict(qkv_a=z(q_rows + m.kv_lora_rank + m.qk_rope_head_dim, s.hidden),
                    q_norm=z(m.q_lora_rank) if m.q_lora_rank else None,
                    q_up=z(s.heads * s.head_dim, m.q_lora_rank) if m.q_lora_rank else None,
                    kv_norm=z(m.kv_lora_rank), kv_up=z(s.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                    o=z(s.hidden, s.heads * m.v_head_dim))

    # ----------------------------------------------------------------------------------------------- weights
    def _hf_names(self) -> dict[str, torch.Tensor]:
        """Every accepted HF name -> the view of our fused tensors it fills (on-disk per-expert names and
        transformers-5 in-memory fused expert names both work)."""
        s = self.spec
        names = {"model.embed_tokens.weight": self.embed, "lm_head.weight": self.lm_head,
                 "model.norm.weight": self.final_norm}
        for i, (layer, moe) in enumerate(zip(self.layers, s.moe_layers)):
            p = f"model.layers.{i}."
            names[p + "input_layernorm.weight"] = layer["ln1"]
            names[p + "post_attention_layernorm.weight"] = layer["ln2"]
            names.update(self._mla_names(p + "self_attn.", layer) if s.mla else self._gqa_names(p + "self_attn.", layer))
            gu, down = layer["gate_up"], layer["down"]
            if moe and s.fused_experts:  # transformers' own (fused) names, tensors in its layout
                names.update({p + "mlp.router.weight": layer["router"], p + "mlp.router.bias": layer["router_bias"],
                              p + "mlp.experts.gate_up_proj": gu, p + "mlp.experts.gate_up_proj_bias": layer["gate_up_bias"],
                              p + "mlp.experts.down_proj": down, p + "mlp.experts.down_proj_bias": layer["down_bias"]})
            elif moe:
                f = s.moe_ffn
                disk = p + s.moe_module + "."
                gate_n, up_n, down_n = s.expert_names
                names[disk + "gate.weight"] = layer["router"]
                names[p + "mlp.gate.weight"] = layer["router"]
                if s.expert_bias:
                    names[p + "mlp.gate.e_score_correction_bias"] = layer["expert_bias"]
                for e in range(s.experts):
                    names[f"{disk}experts.{e}.{gate_n}.weight"] = gu[e, :f]
                    names[f"{disk}experts.{e}.{up_n}.weight"] = gu[e, f:]
                    names[f"{disk}experts.{e}.{down_n}.weight"] = down[e]
                names[p + "mlp.experts.gate_up_proj"] = gu
                names[p + "mlp.experts.down_proj"] = down
                if s.shared_ffn:
                    names.update(self._dense_names(p + "mlp.shared_experts.", layer["shared_gate_up"],
                                                   layer["shared_down"], s.shared_ffn))
            else:
                names.update(self._dense_names(p + "mlp.", gu, down, s.ffn))
        return names

    def _gqa_names(self, a: str, layer: dict) -> dict[str, torch.Tensor]:
        s = self.spec
        q, kv, names = s.heads * s.head_dim, s.kv_heads * s.head_dim, {}
        for name, lo, hi in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
            names[a + name + ".weight"] = layer["qkv"][lo:hi]
            if s.qkv_bias:
                names[a + name + ".bias"] = layer["qkv_bias"][lo:hi]
        names[a + "o_proj.weight"] = layer["o"]
        if s.linear_bias:
            names[a + "o_proj.bias"] = layer["o_bias"]
        if s.sinks:
            names[a + "sinks"] = layer["sinks"]
        if s.qk_norm:
            names[a + "q_norm.weight"] = layer["q_norm"]
            names[a + "k_norm.weight"] = layer["k_norm"]
        return names

    def _mla_names(self, a: str, layer: dict) -> dict[str, torch.Tensor]:
        m, qkv_a = self.spec.mla, layer["qkv_a"]
        q_rows = len(qkv_a) - m.kv_lora_rank - m.qk_rope_head_dim
        names = {a + "kv_a_proj_with_mqa.weight": qkv_a[q_rows:], a + "kv_a_layernorm.weight": layer["kv_norm"],
                 a + "kv_b_proj.weight": layer["kv_up"], a + "o_proj.weight": layer["o"]}
        if m.q_lora_rank:
            names.update({a + "q_a_proj.weight": qkv_a[:q_rows], a + "q_a_layernorm.weight": layer["q_norm"],
                          a + "q_b_proj.weight": layer["q_up"]})
        else:
            names[a + "q_proj.weight"] = qkv_a[:q_rows]
        return names

    @staticmethod
    def _dense_names(p: str, gate_up: torch.Tensor, down: torch.Tensor, ffn: int) -> dict[str, torch.Tensor]:
        return {p + "gate_proj.weight": gate_up[:ffn], p + "up_proj.weight": gate_up[ffn:], p + "down_proj.weight": down}

    def num_parameters(self) -> int:
        """Weights, the router's expert bias (a buffer in transformers and Megatron) included."""
        tensors = [self.embed, self.final_norm] + ([] if self.spec.tie_embeddings else [self.lm_head])
        tensors += [t for layer in self.layers for t in layer.values() if t is not None]
        return sum(t.numel() for t in tensors)

    def missing_names(self, loaded: set[str]) -> set[str]:
        """required_names not in `loaded`; a layer's fused expert tensors (transformers 5's in-memory
        gate_up_proj / down_proj) stand for its per-expert ones."""
        fused = {n.removesuffix("gate_up_proj") for n in loaded if n.endswith(".mlp.experts.gate_up_proj")}
        fused &= {n.removesuffix("down_proj") for n in loaded if n.endswith(".mlp.experts.down_proj")}
        return {n for n in self.required_names() - loaded if not any(n.startswith(p) for p in fused)}

    def required_names(self) -> set[str]:
        """The on-disk HF names a complete checkpoint has (one name per tensor element)."""
        skip = {"lm_head.weight"} if self.spec.tie_embeddings else set()
        # (gpt_oss: the fused names are the on-disk ones)
        fused = () if self.spec.fused_experts else (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
        if self.spec.moe_module != "mlp":  # the router's name under mlp. is an alias, not the on-disk one
            fused += (".mlp.gate.weight",)
        return {n for n in self.weight_views if n not in skip and not n.endswith(fused)}

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into place; returns the names loaded. Unknown names and wrong shapes raise."""
        loaded = set()
        for name, tensor in named_tensors:
            target = self.weight_views.get(name)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise KeyError(f"weight {name!r} is not a {self.spec.family} weight of this model")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor.detach().to(device="cpu", dtype=target.dtype))
            loaded.add(name)
        return loaded

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> "TorchCausalLM":
        from megapo.weights.safetensors_io import iter_folder

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"model_dir {str(model_dir)!r} has no config.json")
        model = cls(TorchLMSpec.from_config(json.loads((model_dir / "config.json").read_text())), dtype)
        loaded = model.load(iter_folder(model_dir))
        missing = model.required_names() - loaded
        if missing:
            raise ValueError(f"model_dir {str(model_dir)!r} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        return model

    # ----------------------------------------------------------------------------------------------- forward
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.spec, batch, max_len, self.dtype)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int, mask: torch.Tensor,
             routes: list[torch.Tensor] | None = None, last_only: bool = True,
             router_noise: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ids [B, T] at cache columns start..start+T-1 (rotary positions `positions` [B, T]).

        The rows use the cache's rows 0..B-1. mask: bool [B, 1, T, start+T], True where a query may attend a
        key, or None when no key is padded (causal from column 0, or one new token that sees every key). When
        `routes` is a list, the top-k expert ids of every MoE layer are appended to it ([B, T, topk] each).
        `router_noise` (float32 [B, T, num_moe_layers, experts], or None): added to each MoE layer's router
        logits before the experts are chosen (see `_route`; the embedded engine's rollout.router_noise).
        Returns float32 logits [B, V] of the last column (last_only) or [B, T, V]."""
        s = self.spec
        B, T = ids.shape
        if router_noise is not None and tuple(router_noise.shape) != (B, T, s.num_moe_layers, s.experts):
            raise ValueError(f"router_noise has shape {list(router_noise.shape)}, expected "
                             f"{[B, T, s.num_moe_layers, s.experts]}")
        moe_index = 0
        if mask is None and T > 1 and start > 0:
            raise ValueError("step: mask=None is causal from column 0; give a mask for T > 1 new tokens at start > 0")
        x = self.embed[ids]
        rope = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)  # [B, 1, T, rope_dim]
        attention = self._mla if s.mla else self._gqa
        for i, layer in enumerate(self.layers):
            q, k, v = attention(_rms_norm(x, layer["ln1"], s.rms_eps), layer, rope)
            end = start + T
            keys, values = cache.k[i][:B, :, :end], cache.v[i][:B, :, :end]
            keys[:, :, start:], values[:, :, start:] = k, v
            window = s.sliding_window if s.window_layers and s.window_layers[i] else 0
            if layer.get("sinks") is not None or window:
                att = self._attend(q, keys, values, mask, start, window, layer.get("sinks"))
            else:
                att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and T > 1,
                                                     enable_gqa=s.cache_heads != s.heads)
            x = x + F.linear(att.transpose(1, 2).reshape(B, T, -1), layer["o"], layer.get("o_bias"))
            h = _rms_norm(x, layer["ln2"], s.rms_eps).view(B * T, s.hidden)
            if s.moe_layers[i]:
                noise = None if router_noise is None else router_noise[:, :, moe_index].reshape(B * T, s.experts)
                moe_index += 1
                y, top = self._moe(h, layer, noise)
                if routes is not None:
                    routes.append(top.view(B, T, s.topk))
            else:
                y = _mlp(h, layer["gate_up"], layer["down"])
            x = x + y.view(B, T, s.hidden)
        if last_only:
            x = x[:, -1]
        return F.linear(_rms_norm(x, self.final_norm, s.rms_eps), self.lm_head).float()

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                start: int, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention with a sliding window and/or a sink logit per head (gpt_oss), which SDPA has not: query
        column start + t sees key column j <= start + t (and `mask`), within start + t - j < window when
        window; the sink joins every softmax row (float32) and its probability is dropped. Left padding
        keeps column distances equal to position distances."""
        s = self.spec
        T, end = q.shape[2], keys.shape[2]
        cols = torch.arange(end)
        query_cols = torch.arange(start, start + T)[:, None]
        allowed = cols[None, :] <= query_cols
        if window:
            allowed = allowed & (query_cols - cols[None, :] < window)
        if mask is not None:
            allowed = allowed & mask
        if s.cache_heads != s.heads:
            keys = keys.repeat_interleave(s.heads // s.cache_heads, dim=1)
            values = values.repeat_interleave(s.heads // s.cache_heads, dim=1)
        scores = (q @ keys.transpose(-1, -2)).float() * s.head_dim ** -0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return probs.to(values.dtype) @ values

    def _gqa(self, h: torch.Tensor, layer: dict, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grouped-query attention's q [B, heads, T, D], k and v [B, kv_heads, T, D] of normed hidden states h."""
        s = self.spec
        B, T, _ = h.shape
        qn, kvn = s.heads * s.head_dim, s.kv_heads * s.head_dim
        qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
        q = qkv[..., :qn].view(B, T, s.heads, s.head_dim)
        k = qkv[..., qn:qn + kvn].view(B, T, s.kv_heads, s.head_dim)
        v = qkv[..., qn + kvn:].view(B, T, s.kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = _rms_norm(q, layer["q_norm"], s.rms_eps), _rms_norm(k, layer["k_norm"], s.rms_eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if s.rope_dim < s.head_dim:  # partial rotary: rotate-half within the first rope_dim dims, the rest as is
            return _rotate_first(q, rope, s.rope_dim), _rotate_first(k, rope, s.rope_dim), v
        return _rotate(q, *rope, False), _rotate(k, *rope, False), v

    def _mla(self, h: torch.Tensor, layer: dict, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-latent attention's q and k [B, heads, T, qk_nope + qk_rope], v [B, heads, T, v_head_dim]: the
        kv latent (normed) expanded per head by kv_b_proj, the one rotary key per token shared by every head."""
        s, m = self.spec, self.spec.mla
        B, T, _ = h.shape
        qkv_a = F.linear(h, layer["qkv_a"])
        q_rows = qkv_a.shape[-1] - m.kv_lora_rank - m.qk_rope_head_dim
        q = qkv_a[..., :q_rows]
        if m.q_lora_rank:
            q = F.linear(_rms_norm(q, layer["q_norm"], s.rms_eps), layer["q_up"])
        q = q.view(B, T, s.heads, s.head_dim).transpose(1, 2)
        latent, k_rot = qkv_a[..., q_rows:].split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = F.linear(_rms_norm(latent, layer["kv_norm"], s.rms_eps), layer["kv_up"])
        k_nope, v = kv.view(B, T, s.heads, -1).transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        k_rot = _rotate(k_rot[:, None], *rope, True).expand(B, s.heads, T, m.qk_rope_head_dim)
        q = torch.cat((q_nope, _rotate(q_rot, *rope, True)), dim=-1)
        return q, torch.cat((k_nope, k_rot), dim=-1), v

    def _route(self, h: torch.Tensor, layer: dict,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [N, k] (by score, highest first) and their gates [N, k] float32.

        `noise` (float32 [N, E], or None) is added to the router logits (the router's linear output, bias
        included) before everything else, for every family alike: softmax routers take the softmax of the noisy
        logits, sigmoid routers the sigmoid (then expert bias and group limit as usual); so the noise moves both
        the choice of experts and their gates, as a perturbed router computation would."""
        s = self.spec
        if s.router_score == "softmax":
            logits = F.linear(h, layer["router"], layer.get("router_bias")).float()
            probs = torch.softmax(logits if noise is None else logits + noise, dim=-1)
            weights, top = torch.topk(probs, s.topk, dim=-1)
        else:  # sigmoid, in float32 as transformers and Megatron (moe_router_dtype fp32) compute it
            logits = F.linear(h.float(), layer["router"].float())
            scores = torch.sigmoid(logits if noise is None else logits + noise)
            choice = scores + layer["expert_bias"] if s.expert_bias else scores
            if s.router_groups:
                choice = self._best_groups(choice)
            top = torch.topk(choice, s.topk, dim=-1).indices
            weights = scores.gather(1, top)
        if s.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if s.router_score == "sigmoid" else 0.0))
        return top, weights * s.router_scaling if s.router_scaling != 1.0 else weights

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: `choice` [N, E] with -inf outside each token's best router_group_topk groups,
        a group scored by the sum of its top (topk // router_group_topk) scores (Megatron's rule; the
        deepseek_v3 spec admits only configs where that is transformers' top 2)."""
        s = self.spec
        grouped = choice.view(len(choice), s.router_groups, -1)
        group_scores = grouped.topk(s.topk // s.router_group_topk, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(s.router_group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def _moe(self, h: torch.Tensor, layer: dict,
             noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routed experts, computing each expert only on the tokens routed to it: the routed copies are
        gathered once in expert order, each expert runs on its contiguous slice, one index_add combines; plus
        the shared experts on every token. `noise`: added to the router logits (`_route`)."""
        s = self.spec
        top, weights = self._route(h, layer, noise)
        flat = top.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=s.experts).tolist()
        token = order // s.topk
        routed = h.index_select(0, token)
        out = torch.empty_like(routed)
        gate_up, down, f, lo = layer["gate_up"], layer["down"], s.moe_ffn, 0
        for e, c in enumerate(counts):
            if c and s.fused_experts:
                out[lo:lo + c] = self._fused_expert(routed[lo:lo + c], layer, e)
                lo += c
            elif c:
                g = F.linear(routed[lo:lo + c], gate_up[e])
                torch.mm(F.silu(g[:, :f]) * g[:, f:], down[e].t(), out=out[lo:lo + c])
                lo += c
        out *= weights.reshape(-1)[order].to(h.dtype).unsqueeze(-1)
        y = torch.zeros_like(h).index_add_(0, token, out)
        if s.shared_ffn:
            y = y + _mlp(h, layer["shared_gate_up"], layer["shared_down"])
        return y, top

    def _fused_expert(self, x: torch.Tensor, layer: dict, e: int) -> torch.Tensor:
        """gpt_oss expert e on tokens x: gate/up interleaved in gate_up's last dim, both clamped, quick-GELU
        gate times (up + offset), then down with its bias (the gate is applied by the caller)."""
        s = self.spec
        gate_up = x @ layer["gate_up"][e] + layer["gate_up_bias"][e]
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        if s.glu_clamp:
            gate, up = gate.clamp(max=s.glu_clamp), up.clamp(-s.glu_clamp, s.glu_clamp)
        glu = gate * torch.sigmoid(1.702 * gate)
        return ((up + s.glu_linear_offset) * glu) @ layer["down"][e] + layer["down_bias"][e]

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, with_routes: bool = False):
        """Full causal forward of unpadded rows [B, T] -> float32 logits [B, T, V] (and routes [B, T, L, k])."""
        B, T = input_ids.shape
        if T > self.spec.max_positions:
            raise ValueError(f"input_ids length {T} exceeds max_position_embeddings {self.spec.max_positions}")
        cache = self.new_cache(B, T)
        positions = torch.arange(T).expand(B, T)
        routes = [] if with_routes else None
        out = self.step(input_ids, positions, cache, 0, None, routes, last_only=False)
        if with_routes:
            return out, torch.stack(routes, dim=2)
        return out
