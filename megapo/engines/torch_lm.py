"""A small pure-PyTorch decoder forward with a KV cache, for the embedded engine.

Built from an HF config.json and HF-named tensors; no transformers and no Megatron at run time. Families:
- qwen3_moe: q/k RMSNorm, top-k softmax router (top-k renormalised when norm_topk_prob), optional dense layers
  (mlp_only_layers / decoder_sparse_step);
- qwen3: dense with q/k RMSNorm;
- qwen2: dense with q/k/v bias, no q/k norm;
- mixtral: softmax-then-top-k renormalised router (equal to a softmax over the selected logits), experts w1/w3/w2.
Every family: RMSNorm pre-norm, rotary embedding (rotate-half), GQA, SiLU-gated MLP.

Weights live in fused tensors (qkv, gate_up, stacked experts) so a forward is few large ops; every HF name maps to
a view of one of them, so a weight update copies in place and never reallocates. A layer's expert (or dense MLP)
weights share one buffer in HF order (gate, up, down per expert).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen3", "qwen2", "mixtral")


@dataclass(frozen=True)
class TorchLMSpec:
    family: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_linear_factor: float  # positions are divided by it (rope_type "linear"); 1.0 otherwise
    max_positions: int
    qk_norm: bool
    qkv_bias: bool
    ffn: int  # dense-layer MLP width
    moe_ffn: int  # expert MLP width
    experts: int
    topk: int
    norm_topk: bool
    moe_layers: tuple[bool, ...]  # per layer: MoE or dense MLP
    tie_embeddings: bool

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @classmethod
    def from_config(cls, cfg: dict) -> "TorchLMSpec":
        family = cfg.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"config.json model_type must be one of {SUPPORTED_FAMILIES}, got {family!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
        if cfg.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not supported by the embedded engine")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise ValueError(f"config.json rope_type must be 'default' or 'linear', got {rope_type!r}")
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        if family == "qwen3_moe":
            # transformers 5 writes num_local_experts; 4.x wrote num_experts.
            experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
            topk = int(cfg["num_experts_per_tok"])
            step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
            moe = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
            moe_ffn, norm_topk = int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", True))
        elif family == "mixtral":
            experts, topk = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
            moe, moe_ffn, norm_topk = (True,) * layers, int(cfg["intermediate_size"]), True
        else:
            experts, topk, moe, moe_ffn, norm_topk = 0, 0, (False,) * layers, 0, False
        return cls(
            family=family, vocab_size=int(cfg["vocab_size"]), hidden=int(cfg["hidden_size"]), layers=layers,
            heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_linear_factor=float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0,
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            qk_norm=family in ("qwen3_moe", "qwen3"),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            ffn=int(cfg.get("intermediate_size", 0)), moe_ffn=moe_ffn, experts=experts, topk=topk,
            norm_topk=norm_topk, moe_layers=moe, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


class KVCache:
    """Per-layer K/V [batch, kv_heads, max_len, head_dim]: a forward of B rows uses rows 0..B-1. Row moves
    (n samples per prefilled prompt, finished samples dropping out) copy into a second buffer of the same shape,
    which then becomes the cache: no allocation per step, and one cache can serve many batches (`fits`)."""

    def __init__(self, spec: TorchLMSpec, batch: int, max_len: int, dtype: torch.dtype):
        self.batch, self.max_len = batch, max_len
        shape = (batch, spec.kv_heads, max_len, spec.head_dim)
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(spec.layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(spec.layers)]
        self._spare: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # made at the first row move

    def fits(self, batch: int, max_len: int) -> bool:
        return batch <= self.batch and max_len <= self.max_len

    def _swap(self, moved: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        self._spare, (self.k, self.v) = (self.k, self.v), moved

    def _spare_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._spare is None:
            self._spare = ([torch.empty_like(t) for t in self.k], [torch.empty_like(t) for t in self.v])
        return self._spare

    def repeat_rows(self, rows: int, n: int, columns: int) -> None:
        """Rows u * n + j (u < rows, j < n) <- row u, columns 0..columns-1."""
        spare = self._spare_buffers()
        for src, dst in zip(self.k + self.v, spare[0] + spare[1]):
            dst[:rows * n].view(rows, n, *dst.shape[1:])[:, :, :, :columns].copy_(src[:rows, None, :, :columns])
        self._swap(spare)

    def compact(self, keep: torch.Tensor, columns: int) -> None:
        """Rows `keep` become rows 0..len(keep)-1, columns 0..columns-1."""
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


def _mlp_weights(experts: int, ffn: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2*ffn, hidden] and down [E, hidden, ffn] as views of one buffer holding, per expert, its
    gate, up and down weights back to back: the order of an HF checkpoint and of a Megatron learner's
    parameters, so a weight sync can write a layer's experts in one piece (megapo.weights.broadcast)."""
    block = torch.zeros(experts, 3 * ffn * hidden, dtype=dtype)
    gate_up = block[:, :2 * ffn * hidden].unflatten(1, (2 * ffn, hidden))
    down = block[:, 2 * ffn * hidden:].unflatten(1, (hidden, ffn))
    return gate_up, down


class TorchCausalLM:
    """Weights + forward. `step` runs T new tokens per row against a KV cache; `logits` is a plain full forward."""

    def __init__(self, spec: TorchLMSpec, dtype: torch.dtype = torch.float32):
        self.spec, self.dtype = spec, dtype
        s = spec
        z = lambda *shape: torch.zeros(shape, dtype=dtype)  # noqa: E731
        self.embed = z(s.vocab_size, s.hidden)
        self.lm_head = self.embed if s.tie_embeddings else z(s.vocab_size, s.hidden)
        self.final_norm = z(s.hidden)
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for moe in s.moe_layers:
            layer = dict(ln1=z(s.hidden), ln2=z(s.hidden), qkv=z(q + 2 * kv, s.hidden), o=z(s.hidden, q),
                         qkv_bias=z(q + 2 * kv) if s.qkv_bias else None,
                         q_norm=z(s.head_dim) if s.qk_norm else None, k_norm=z(s.head_dim) if s.qk_norm else None)
            if moe:
                gate_up, down = _mlp_weights(s.experts, s.moe_ffn, s.hidden, dtype)
                layer.update(router=z(s.experts, s.hidden), gate_up=gate_up, down=down)
            else:
                gate_up, down = _mlp_weights(1, s.ffn, s.hidden, dtype)
                layer.update(gate_up=gate_up[0], down=down[0])
            self.layers.append(layer)
        self.weight_views = self._hf_names()  # HF name -> the view of our tensors it loads into
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64).float() / s.head_dim))
        pos = torch.arange(s.max_positions, dtype=torch.float32) / s.rope_linear_factor
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)

    # ----------------------------------------------------------------------------------------------- weights
    def _hf_names(self) -> dict[str, torch.Tensor]:
        """Every accepted HF name -> the view of our fused tensors it fills (on-disk per-expert names and
        transformers-5 in-memory fused expert names both work)."""
        s = self.spec
        q, kv, names = s.heads * s.head_dim, s.kv_heads * s.head_dim, {}
        names["model.embed_tokens.weight"] = self.embed
        names["lm_head.weight"] = self.lm_head
        names["model.norm.weight"] = self.final_norm
        for i, (layer, moe) in enumerate(zip(self.layers, s.moe_layers)):
            p = f"model.layers.{i}."
            names[p + "input_layernorm.weight"] = layer["ln1"]
            names[p + "post_attention_layernorm.weight"] = layer["ln2"]
            a = p + "self_attn."
            for name, lo, hi in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
                names[a + name + ".weight"] = layer["qkv"][lo:hi]
                if s.qkv_bias:
                    names[a + name + ".bias"] = layer["qkv_bias"][lo:hi]
            names[a + "o_proj.weight"] = layer["o"]
            if s.qk_norm:
                names[a + "q_norm.weight"] = layer["q_norm"]
                names[a + "k_norm.weight"] = layer["k_norm"]
            gu, down = layer["gate_up"], layer["down"]
            if moe:
                f = s.moe_ffn
                disk = p + ("block_sparse_moe." if s.family == "mixtral" else "mlp.")
                gate_n, up_n, down_n = ("w1", "w3", "w2") if s.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
                names[disk + "gate.weight"] = layer["router"]
                names[p + "mlp.gate.weight"] = layer["router"]
                for e in range(s.experts):
                    names[f"{disk}experts.{e}.{gate_n}.weight"] = gu[e, :f]
                    names[f"{disk}experts.{e}.{up_n}.weight"] = gu[e, f:]
                    names[f"{disk}experts.{e}.{down_n}.weight"] = down[e]
                names[p + "mlp.experts.gate_up_proj"] = gu
                names[p + "mlp.experts.down_proj"] = down
            else:
                f = s.ffn
                names[p + "mlp.gate_proj.weight"] = gu[:f]
                names[p + "mlp.up_proj.weight"] = gu[f:]
                names[p + "mlp.down_proj.weight"] = down
        return names

    def num_parameters(self) -> int:
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
        fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
        if self.spec.family == "mixtral":
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
            target.copy_(tensor.detach().to(device="cpu", dtype=self.dtype))
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
             routes: list[torch.Tensor] | None = None, last_only: bool = True) -> torch.Tensor:
        """Feed ids [B, T] at cache columns start..start+T-1 (rotary positions `positions` [B, T]).

        The rows use the cache's rows 0..B-1. mask: bool [B, 1, T, start+T], True where a query may attend a
        key, or None when no key is padded (causal from column 0, or one new token that sees every key). When
        `routes` is a list, the top-k expert ids of every MoE layer are appended to it ([B, T, topk] each).
        Returns float32 logits [B, V] of the last column (last_only) or [B, T, V]."""
        s = self.spec
        B, T = ids.shape
        if mask is None and T > 1 and start > 0:
            raise ValueError("step: mask=None is causal from column 0; give a mask for T > 1 new tokens at start > 0")
        x = self.embed[ids]
        cos, sin = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)  # [B, 1, T, D]
        qn, kvn = s.heads * s.head_dim, s.kv_heads * s.head_dim
        end = start + T
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer["ln1"], s.rms_eps)
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
            q = qkv[..., :qn].view(B, T, s.heads, s.head_dim)
            k = qkv[..., qn:qn + kvn].view(B, T, s.kv_heads, s.head_dim)
            v = qkv[..., qn + kvn:].view(B, T, s.kv_heads, s.head_dim)
            if s.qk_norm:
                q, k = _rms_norm(q, layer["q_norm"], s.rms_eps), _rms_norm(k, layer["k_norm"], s.rms_eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.k[i][:B, :, :end], cache.v[i][:B, :, :end]
            keys[:, :, start:], values[:, :, start:] = k, v
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and T > 1,
                                                 enable_gqa=s.heads != s.kv_heads)
            x = x + F.linear(att.transpose(1, 2).reshape(B, T, qn), layer["o"])
            h = _rms_norm(x, layer["ln2"], s.rms_eps).view(B * T, s.hidden)
            if s.moe_layers[i]:
                y, top = self._moe(h, layer)
                if routes is not None:
                    routes.append(top.view(B, T, s.topk))
            else:
                g, u = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, layer["down"])
            x = x + y.view(B, T, s.hidden)
        if last_only:
            x = x[:, -1]
        return F.linear(_rms_norm(x, self.final_norm, s.rms_eps), self.lm_head).float()

    def _moe(self, h: torch.Tensor, layer: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routed experts, computing each expert only on the tokens routed to it: the routed copies are
        gathered once in expert order, each expert runs on its contiguous slice, one index_add combines."""
        s = self.spec
        probs = torch.softmax(F.linear(h, layer["router"]).float(), dim=-1)
        weights, top = torch.topk(probs, s.topk, dim=-1)
        if s.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = top.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=s.experts).tolist()
        token = order // s.topk
        routed = h.index_select(0, token)
        out = torch.empty_like(routed)
        gate_up, down, f, lo = layer["gate_up"], layer["down"], s.moe_ffn, 0
        for e, c in enumerate(counts):
            if c:
                g = F.linear(routed[lo:lo + c], gate_up[e])
                torch.mm(F.silu(g[:, :f]) * g[:, f:], down[e].t(), out=out[lo:lo + c])
                lo += c
        out *= weights.reshape(-1)[order].to(h.dtype).unsqueeze(-1)
        return torch.zeros_like(h).index_add_(0, token, out), top

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
