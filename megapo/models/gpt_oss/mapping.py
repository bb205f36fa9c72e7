"""gpt-oss <-> Megatron (transformers' GptOssForCausalLM).

- Attention: q/k/v/o with biases (Megatron's add_bias_linear + add_qkv_bias), one learnable sink logit per
  head (transformers' `sinks`, Megatron's `core_attention.softmax_offset` with softmax_type='learnable':
  both append it to every softmax row and drop its probability), rotate-half RoPE, scale 1/sqrt(head_dim).
- Sliding window on the layers `layer_types` marks sliding_attention: transformers keeps key j for query i
  when i - sliding_window < j <= i, i.e. Megatron's window_size (sliding_window - 1, 0).
- Router: a Linear with bias; top-k of the logits, then softmax over those k (Megatron: pre_softmax off).
- Experts: biases; transformers' fused `gate_up_proj` [E, H, 2F] holds gate and up interleaved in its last
  dim (gate = [..., ::2], up = [..., 1::2]) and is stored transposed, like `down_proj` [E, F, H]. Megatron's
  linear_fc1 is [gate; up] (quick_gelu = x * sigmoid(1.702 x) on the gate, clamped at swiglu_limit, up
  clamped to +-swiglu_limit plus glu_linear_offset 1). The rules below use per-expert names
  (`model.layers.L.mlp.experts.E.gate_proj.weight`, ...); `FusedExperts` reads them out of the fused file
  tensors and `pack` fuses an exported stream back, so a file written here is one transformers loads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from megapo.config import ConfigError
from megapo.models.config_keys import read
from megapo.layout import num_experts
from megapo.models.family import (GLOBAL_RULES, HF_LAYER, Family, ModelSpec, Rule, YarnSpec, attention_rules,
                                  transformer_fields)

QUICK_GELU_ALPHA = 1.702  # Megatron's quick_gelu: x * sigmoid(1.702 x)
LAYER_TYPES = ("sliding_attention", "full_attention")


YARN_KEYS = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate"}


def _rope_params(hf: dict) -> dict:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope(hf: dict) -> None:
    params = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn", None):
        raise ConfigError("model", f"gpt_oss rope_parameters.rope_type={rope_type!r} is not supported: only plain "
                                   "RoPE ('default') and YaRN ('yarn')")
    if rope_type == "yarn":
        extra = sorted(set(params) - YARN_KEYS)  # attention_factor, mscale, mscale_all_dim, partial_rotary_factor
        if extra:
            raise ConfigError("model", f"gpt_oss YaRN rope_parameters {extra} are not supported (megapo builds YaRN "
                                       f"from {sorted(YARN_KEYS - {'rope_type', 'rope_theta'})} only)")
        if not params.get("factor") or not params.get("original_max_position_embeddings"):
            raise ConfigError("model", "gpt_oss YaRN needs rope_parameters.factor and "
                                       "rope_parameters.original_max_position_embeddings")


def _yarn(hf: dict) -> YarnSpec | None:
    params = _rope_params(hf)
    if params.get("rope_type", params.get("type")) != "yarn":
        return None
    # (transformers: `beta_fast or 32`, `beta_slow or 1`, truncate defaults to true)
    return YarnSpec(factor=float(params["factor"]), original_max_positions=int(params["original_max_position_embeddings"]),
                    beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                    truncate=bool(params.get("truncate", True)))


def _check(hf: dict) -> None:
    """Refuse what the Megatron model would compute differently, naming the config.json key."""
    _rope(hf)
    if not hf.get("attention_bias", True):
        raise ConfigError("model", "gpt_oss attention_bias=false is not supported (Megatron's add_bias_linear "
                                   "gives q/k/v/o, router and experts their biases together)")
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise ConfigError("model", f"gpt_oss swiglu_alpha={alpha!r} is not supported: Megatron's quick_gelu has "
                                   f"the gain {QUICK_GELU_ALPHA}")
    limit = hf.get("swiglu_limit", 7.0)
    if not isinstance(limit, (int, float)) or limit <= 0:
        raise ConfigError("model", f"gpt_oss swiglu_limit={limit!r} must be a positive number")
    if hf.get("experts_per_token", hf["num_experts_per_tok"]) != hf["num_experts_per_tok"]:
        raise ConfigError("model", f"gpt_oss experts_per_token={hf['experts_per_token']} and num_experts_per_tok="
                                   f"{hf['num_experts_per_tok']} disagree")
    types = _layer_types(hf)
    if any(t == "sliding_attention" for t in types):
        window = hf.get("sliding_window")
        if not isinstance(window, int) or window < 1:
            raise ConfigError("model", f"gpt_oss sliding_window={window!r} must be a positive integer "
                                       "(layer_types has sliding_attention layers)")


def _layer_types(hf: dict) -> list[str]:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ConfigError("model", f"gpt_oss layer_types has {len(types)} entries, num_hidden_layers={layers}")
    for t in types:
        if t not in LAYER_TYPES:
            raise ConfigError("model", f"gpt_oss layer_types entry {t!r}: only {', '.join(LAYER_TYPES)}")
    return types


def spec(hf: dict) -> ModelSpec:
    _check(hf)
    sliding = tuple(t == "sliding_attention" for t in _layer_types(hf))
    fields = transformer_fields({**hf, "rope_parameters": None, "rope_scaling": None})  # (rope read here)
    fields["rope_theta"] = float(_rope_params(hf).get("rope_theta", hf.get("rope_theta", 150000.0)))
    return ModelSpec(
        family="gpt_oss",
        **fields,
        ffn_hidden_size=hf["intermediate_size"],
        qkv_bias=True,
        num_experts=num_experts(hf),
        moe_ffn_hidden_size=hf["intermediate_size"],
        topk=hf["num_experts_per_tok"],
        router_pre_softmax=False,  # top-k of the logits, softmax over the k
        linear_bias=True,
        attention_sinks=True,
        sliding_window=int(hf["sliding_window"]) if any(sliding) else 0,
        window_layers=sliding if any(sliding) else (),
        activation="quick_gelu",
        glu_clamp=float(hf.get("swiglu_limit", 7.0)),
        glu_linear_offset=1.0,
        yarn=_yarn(hf),
        hf_fused_experts=True,  # transformers' fused gate_up_proj / down_proj (see the module docstring)
    )


def _copy(hf_name: str) -> Rule:
    return Rule("copy", (HF_LAYER + hf_name,))


LAYER_RULES = {
    **attention_rules(qk_norm=False, qkv_bias=True),
    "self_attention.linear_proj.bias": _copy("self_attn.o_proj.bias"),
    "self_attention.core_attention.softmax_offset": _copy("self_attn.sinks"),
    "mlp.router.weight": _copy("mlp.router.weight"),
    "mlp.router.bias": _copy("mlp.router.bias"),
}

HF_EXPERT = HF_LAYER + "mlp.experts.{E}."  # per-expert names, views of the fused file tensors
EXPERT_RULES = {
    "linear_fc1.weight": Rule("gate_up", (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight")),
    "linear_fc1.bias": Rule("gate_up", (HF_EXPERT + "gate_proj.bias", HF_EXPERT + "up_proj.bias")),
    "linear_fc2.weight": Rule("copy", (HF_EXPERT + "down_proj.weight",)),
    "linear_fc2.bias": Rule("copy", (HF_EXPERT + "down_proj.bias",)),
}

# per-expert suffix -> (fused file tensor, which of its last-dim columns: 0 even, 1 odd, None all, transposed)
PIECES = {
    "gate_proj.weight": ("gate_up_proj", 0, True),
    "up_proj.weight": ("gate_up_proj", 1, True),
    "gate_proj.bias": ("gate_up_proj_bias", 0, False),
    "up_proj.bias": ("gate_up_proj_bias", 1, False),
    "down_proj.weight": ("down_proj", None, True),
    "down_proj.bias": ("down_proj_bias", None, False),
}
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(\w+\.(?:weight|bias))$")


def _piece(name: str):
    """(fused file name, expert, columns, transposed) of a per-expert name, or None for any other name."""
    m = PER_EXPERT.match(name)
    if m is None or m.group(3) not in PIECES:
        return None
    fused, cols, transposed = PIECES[m.group(3)]
    return m.group(1) + fused, int(m.group(2)), cols, transposed


class FusedExperts:
    """A SafetensorsReader view serving per-expert names from the fused tensors (reads one expert's rows)."""

    def __init__(self, reader):
        self.reader = reader

    def _expert(self, name: str) -> torch.Tensor | None:
        piece = _piece(name)
        if piece is None:
            return None
        fused, expert, cols, transposed = piece
        t = self.reader.read(fused, 0, expert, expert + 1)[0]
        if cols is not None:
            t = t[..., cols::2]
        return (t.t() if transposed else t).contiguous()

    def get(self, name: str) -> torch.Tensor:
        t = self._expert(name)
        return self.reader.get(name) if t is None else t

    def shape(self, name: str) -> list[int]:
        piece = _piece(name)
        if piece is None:
            return self.reader.shape(name)
        fused, _, cols, transposed = piece
        shape = self.reader.shape(fused)[1:]
        if cols is not None:
            shape[-1] //= 2
        return shape[::-1] if transposed else shape

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        t = self._expert(name)
        if t is None:
            return self.reader.read(name, dim, start, stop)
        t = t.to(torch.float32)
        return t if dim is None else t.narrow(dim, start, stop - start)


def pack(spec: ModelSpec, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors -> the fused file tensors, each yielded once all its experts' pieces came by
    (other tensors pass through in order). Works on meta tensors too (manifests)."""
    fused: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for name, t in named:
        piece = _piece(name)
        if piece is None:
            yield name, t
            continue
        target, expert, cols, transposed = piece
        t = t.t() if transposed else t
        if target not in fused:
            shape = list(t.shape)
            if cols is not None:
                shape[-1] *= 2
            fused[target] = torch.empty(spec.num_experts, *shape, dtype=t.dtype, device=t.device)
            filled[target] = 0
        slot = fused[target][expert]
        (slot if cols is None else slot[..., cols::2]).copy_(t)
        filled[target] += 1
        if filled[target] == spec.num_experts * (1 if cols is None else 2):
            yield target, fused.pop(target)
            del filled[target]
    if fused:
        raise RuntimeError(f"gpt_oss export: experts missing from {sorted(fused)}")


# (spec refuses the values its Megatron model would compute differently)
CONFIG_KEYS = read("intermediate_size", "num_local_experts", "num_experts_per_tok", "attention_bias", "sliding_window",
                   "layer_types", "swiglu_alpha", "swiglu_limit",
                   "experts_per_token",  # openai's own name for num_experts_per_tok (spec checks they agree)
                   "initial_context_length")  # openai's copy of YaRN's original_max_position_embeddings

FAMILY = Family("gpt_oss", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES, read_view=FusedExperts, pack=pack,
                config_keys=CONFIG_KEYS, rope_keys=frozenset(YARN_KEYS - {"rope_type", "rope_theta"}), tiny="megapo.models.gpt_oss.tiny")
