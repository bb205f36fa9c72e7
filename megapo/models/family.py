"""Model families: how an HF config.json becomes a Megatron model, and how tensors are renamed.

A family is chosen by config.json's `model_type` through the explicit `FAMILIES` registry (never by
matching substrings of a model name). Each family module (megapo/models/<family>/mapping.py) gives:
- `spec(hf) -> ModelSpec`: the architecture numbers Megatron needs;
- `GLOBAL_RULES` / `LAYER_RULES` / `EXPERT_RULES`: Megatron parameter suffix -> `Rule` (how to build
  it from HF tensors: a plain copy, a QKV interleave per KV group, or gate/up concatenation).

The shard arithmetic shared by every family (which rows of a full tensor a TP rank holds, and how
gathered shards go back to full HF tensors) lives here too, so the family modules stay tables.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from megapo.config import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """The architecture, in Megatron's terms, read from an HF config.json."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # Partial rotary: the rotary embedding turns the first rotary_percent of each head's dims (not
    # interleaved: rotate-half within them) and leaves the rest (Megatron's rotary_percent, HF's
    # partial_rotary_factor).
    rotary_percent: float = 1.0
    num_experts: int = 0  # 0: dense
    moe_ffn_hidden_size: int = 0
    topk: int = 0
    # Router: softmax over all experts then top-k (True), or top-k logits then softmax over the k (False).
    # HF Qwen3-MoE/Mixtral with normalised top-k probabilities equal the latter.
    router_pre_softmax: bool = False
    router_score: str = "softmax"  # "softmax" | "sigmoid" (sigmoid gates renormalised over the top k)
    # A per-expert bias added to the scores only to choose the experts (not to the gates); a buffer in
    # Megatron (router.expert_bias), loaded and exported like a parameter (Family.buffers).
    router_expert_bias: bool = False
    router_groups: int = 0  # group-limited routing: experts in this many equal groups (0: off) ...
    router_group_topk: int = 0  # ... of which each token may use this many
    router_scaling: float = 1.0  # the k gates are multiplied by it
    shared_expert_ffn: int = 0  # width of the shared experts' MLP, always applied (0: none)
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP; (): every layer MoE if num_experts
    mla: "MLASpec | None" = None  # multi-latent attention (DeepSeek); None: grouped-query attention
    # gpt-oss: a bias on every linear layer (q/k/v/o, router, experts: Megatron's add_bias_linear), a
    # learnable per-head attention sink (a logit added to each softmax row, then dropped), sliding-window
    # layers (a token sees itself and the sliding_window - 1 tokens before it), and the experts' clamped
    # GLU: activation(min(gate, glu_clamp)) * (clamp(up, -glu_clamp, glu_clamp) + glu_linear_offset).
    linear_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = 0  # 0: none
    window_layers: tuple[bool, ...] = ()  # per layer: sliding window (True) or full attention
    activation: str = "silu"  # "silu" | "quick_gelu" (x * sigmoid(1.702 x))
    glu_clamp: float = 0.0  # 0: no clamp
    glu_linear_offset: float = 0.0
    yarn: "YarnSpec | None" = None  # YaRN rope scaling (gpt-oss); None: plain RoPE
    # How the HF checkpoint names and lays out a MoE layer (the embedded engine loads HF names as they are): the
    # layer's MoE module ("mlp"; Mixtral: "block_sparse_moe", its router then at <module>.gate), each expert's
    # gate / up / down projections (Mixtral: w1 / w3 / w2), or hf_fused_experts: every expert in transformers'
    # fused gpt-oss tensors (mlp.experts.gate_up_proj [E, H, 2F], gate and up interleaved in the last dim, and
    # down_proj [E, F, H], each with a bias; the router at mlp.router, with a bias).
    hf_moe_module: str = "mlp"
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    hf_fused_experts: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and (not self.moe_layers or self.moe_layers[layer])

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention: q (optionally through a low-rank q_lora_rank bottleneck) and a shared
    kv latent of kv_lora_rank plus one rotary key of qk_rope_head_dim per token."""

    q_lora_rank: int  # 0: q projected directly from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class YarnSpec:
    """YaRN rope scaling as transformers computes it with no attention_factor / mscale keys: inverse frequencies
    ramped between 1/factor-interpolated and the original ones over the dims whose rotations at
    original_max_positions fall between beta_slow and beta_fast (bounds rounded outward when truncate), and cos/sin
    times 0.1 ln(factor) + 1 (Megatron: YarnRotaryEmbedding, correction_range_round_to_int = truncate)."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class Rule:
    """How one Megatron parameter is built from HF tensors.

    kind: "copy" (one tensor), "vocab" (one tensor, rows padded to the padded vocabulary),
          "qkv" (q, k, v interleaved per KV group; weight or bias), "gate_up" (gate, up concatenated
          into linear_fc1, each half split over TP separately).
    hf: HF names, with {L} for the layer and {E} for the expert.
    """

    kind: str
    hf: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    name: str
    spec: Callable[[dict], ModelSpec]
    global_rules: dict[str, Rule]
    layer_rules: dict[str, Rule]  # suffix after "decoder.layers.{i}."
    expert_rules: dict[str, Rule]  # suffix after "decoder.layers.{i}.mlp.experts.local_experts.{k}."
    # Megatron buffers (suffixes after "decoder.layers.{i}.") that hold weights: loaded and exported with
    # the parameters (e.g. the router's expert bias); every other buffer is Megatron's own state.
    buffers: tuple[str, ...] = ()
    # Checkpoints that store tensors fused across experts (gpt-oss): `read_view(reader)` serves the rules'
    # per-expert names from the files' fused tensors, `pack(spec, named)` turns an exported stream of
    # per-expert tensors back into the files' fused ones. None: the rules' names are the files' names.
    read_view: Callable | None = None
    pack: Callable | None = None
    # config.json keys beyond the ones every family reads (megapo.convert.support.COMMON_KEYS), each with the
    # values the Megatron model reproduces (megapo.models.config_keys); any other key is refused by name
    config_keys: dict = field(default_factory=dict)
    rope_keys: frozenset = frozenset()  # rope parameters besides rope_theta / rope_type that spec reads
    engine: bool = True  # the embedded engine (megapo.engines.torch_lm) runs it
    # module with the tiny config `megapo tiny-model --family NAME` writes: config(common, **sizes) and,
    # optionally, finish(model, generator) for weights transformers initialises to 0 or 1; None: no tiny model
    tiny: str | None = None
    # The head of an HF *ForSequenceClassification checkpoint (a reward model: one label, scored at the last token)
    # as a rename rule for the Megatron parameter it takes (megapo.learner.score puts it in place of the LM head,
    # output_layer); transformers names it `score` in every family here. None: no score head for this family.
    score_rules: dict[str, Rule] | None = field(default_factory=lambda: dict(SCORE_RULES))


# model_type in config.json -> module holding the family's mapping (its FAMILY, or the attribute after ':'):
# the one list of families; every command asks it (family_for, families_where)
FAMILIES: dict[str, str] = {
    "qwen3_moe": "megapo.models.qwen3_moe.mapping",
    "qwen2": "megapo.models.qwen2.mapping",
    "qwen3": "megapo.models.qwen3.mapping",  # dense Qwen3: qwen2 without biases, with q/k norm
    "llama": "megapo.models.qwen2.mapping:LLAMA",  # qwen2's layout without QKV bias
    "mixtral": "megapo.models.mixtral.mapping",
    "deepseek_v3": "megapo.models.deepseek_v3.mapping",  # also Kimi-K2 / Moonlight configs
    "glm4_moe": "megapo.models.glm4_moe.mapping",  # GLM-4.5 / 4.6
    "gpt_oss": "megapo.models.gpt_oss.mapping",  # gpt-oss-20b / 120b
}


def family_for(hf: dict) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError("model", f"model_type {model_type!r} is not supported; known: {', '.join(FAMILIES)}")
    return family_named(model_type)


def family_named(model_type: str) -> Family:
    module, _, attribute = FAMILIES[model_type].partition(":")
    return getattr(importlib.import_module(module), attribute or "FAMILY")


def families_where(predicate: Callable[[Family], bool]) -> tuple[str, ...]:
    """The model_types whose Family satisfies `predicate`, in registry order (e.g. lambda f: f.engine)."""
    return tuple(name for name in FAMILIES if predicate(family_named(name)))


def rope_theta(hf: dict) -> float:
    """transformers 5.x moved rope_theta into rope_parameters."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ConfigError("model", f"rope_type {params.get('rope_type')!r} is not supported yet")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def transformer_fields(hf: dict) -> dict:
    """The ModelSpec fields every family reads from config.json the same way."""
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        norm_eps=hf["rms_norm_eps"],
        rope_theta=rope_theta(hf),
        max_positions=hf.get("max_position_embeddings", 4096),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


# ----------------------------------------------------------------------------- rename rules shared by families

HF_LAYER = "model.layers.{L}."

GLOBAL_RULES = {
    "embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule("copy", ("model.norm.weight",)),
    "output_layer.weight": Rule("vocab", ("lm_head.weight",)),
}


SCORE_RULES = {"output_layer.weight": Rule("copy", ("score.weight",))}


def attention_rules(*, qk_norm: bool, qkv_bias: bool) -> dict[str, Rule]:
    """Norms and attention of one decoder layer, in the HF Llama/Qwen naming every family here shares."""
    rules = {
        "input_layernorm.weight": Rule("copy", (HF_LAYER + "input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": Rule("qkv", tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")),
    }
    if qkv_bias:
        rules["self_attention.linear_qkv.bias"] = Rule("qkv", tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"))
    if qk_norm:
        rules["self_attention.q_layernorm.weight"] = Rule("copy", (HF_LAYER + "self_attn.q_norm.weight",))
        rules["self_attention.k_layernorm.weight"] = Rule("copy", (HF_LAYER + "self_attn.k_norm.weight",))
    rules["self_attention.linear_proj.weight"] = Rule("copy", (HF_LAYER + "self_attn.o_proj.weight",))
    rules["pre_mlp_layernorm.weight"] = Rule("copy", (HF_LAYER + "post_attention_layernorm.weight",))
    return rules


# ----------------------------------------------------------------------------- tensor transforms


def qkv_full(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (weights [out, H] or biases [out]) -> Megatron linear_qkv, grouped per KV head:
    [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def qkv_split(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's per-KV-group rows [g0: q heads, k, v | g1: ...] -> HF q, k, v. They are views of one new
    buffer holding q, k, v back to back (with one group: views of `qkv` itself), so a weight sync can send
    them as one piece into an engine that keeps them fused the same way."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // groups
    rest = qkv.shape[1:]
    sizes = [per * d, d, d]
    if groups > 1:
        grouped = qkv.reshape(groups, (per + 2) * d, *rest)
        out = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        for dst, src in zip(torch.split(out, [groups * n for n in sizes]), torch.split(grouped, sizes, dim=1)):
            dst.view(src.shape).copy_(src)
        qkv = out
    return tuple(torch.split(qkv, [groups * n for n in sizes]))


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Megatron splits the vocabulary evenly over TP ranks: pad it to a multiple of tp. Padded
    logits are masked out of every softmax (see learner/logprobs.py) and stripped on export."""
    return -(-vocab_size // tp) * tp


def to_local(rule: Rule, spec: ModelSpec, hf_tensors: list[torch.Tensor], *, dim: int | None, rank: int,
             size: int, vocab_rows: int = 0) -> torch.Tensor:
    """Build this rank's shard of a Megatron parameter from its full HF tensors.
    dim=None: not tensor-parallel (replicated)."""
    if rule.kind == "gate_up":
        gate, up = hf_tensors
        if dim is None or size == 1:
            return torch.cat([gate, up], dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    if rule.kind == "qkv":
        full = qkv_full(spec, *hf_tensors)
    elif rule.kind == "vocab":
        (full,) = hf_tensors
        if vocab_rows > full.shape[0]:
            full = torch.cat([full, full.new_zeros(vocab_rows - full.shape[0], *full.shape[1:])], dim=0)
    else:
        (full,) = hf_tensors
    if dim is None or size == 1:
        return full
    return full.chunk(size, dim=dim)[rank]


def from_shards(rule: Rule, spec: ModelSpec, shards: list[torch.Tensor], *, dim: int | None) -> list[torch.Tensor]:
    """Inverse of `to_local`: TP shards (in rank order) -> the full HF tensors named by rule.hf."""
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)
    if rule.kind == "qkv":
        return list(qkv_split(spec, full))
    if rule.kind == "vocab":
        return [full[: spec.vocab_size]]
    return [full]


def read_local(rule: Rule, spec: ModelSpec, names: list[str], read, shape, *, dim: int | None, rank: int,
               size: int, vocab_rows: int = 0) -> torch.Tensor:
    """Like `to_local`, but reads only this rank's rows/columns from the checkpoint.
    read(name, dim, start, stop) -> the slice [start:stop) of tensor `name` along `dim` (dim None: whole);
    shape(name) -> its full shape. Equal to to_local(rule, spec, [full tensors], ...)."""
    if dim is None or size == 1:
        return to_local(rule, spec, [read(n, None, 0, 0) for n in names], dim=None, rank=0, size=1,
                        vocab_rows=vocab_rows)
    if rule.kind == "copy":
        (name,) = names
        part = shape(name)[dim] // size
        return read(name, dim, rank * part, (rank + 1) * part)
    if rule.kind == "vocab":
        (name,) = names
        part = vocab_rows // size
        start, stop = rank * part, (rank + 1) * part
        rows = read(name, 0, start, min(stop, spec.vocab_size)) if start < spec.vocab_size else None
        have = 0 if rows is None else rows.shape[0]
        if have == part:
            return rows
        pad = torch.zeros(part - have, *shape(name)[1:])
        return pad if rows is None else torch.cat([rows, pad.to(rows.dtype)], dim=0)
    if rule.kind == "gate_up":
        gate, up = names
        part = shape(gate)[0] // size
        return torch.cat([read(gate, 0, rank * part, (rank + 1) * part),
                          read(up, 0, rank * part, (rank + 1) * part)], dim=0)
    if rule.kind == "qkv":  # whole KV groups per rank: its q heads, k and v heads are contiguous rows
        import dataclasses

        q, k, v = names
        groups = spec.num_kv_heads // size
        per = spec.num_heads // spec.num_kv_heads
        d = spec.head_dim
        g0 = rank * groups
        local_spec = dataclasses.replace(spec, num_kv_heads=groups, num_heads=groups * per)
        return qkv_full(local_spec, read(q, 0, g0 * per * d, (g0 + groups) * per * d),
                        read(k, 0, g0 * d, (g0 + groups) * d), read(v, 0, g0 * d, (g0 + groups) * d))
    raise ValueError(f"unknown rule kind {rule.kind!r}")
