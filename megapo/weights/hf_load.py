"""HF safetensors -> a (TP/EP/PP-sharded) Megatron model, through a family's rename table.

`load_hf_weights`: each rank reads from safetensors only the tensors its own parameters need and keeps
only its shard. `locate` and `tp_shard` say where a parameter sits (its rule, global layer/expert,
TP split); the reverse direction, gathering full HF tensors, uses them too: megapo.weights.gather
(behind Learner.hf_state_dict, weight sync and `megapo convert`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megapo.models.family import Family, ModelSpec, Rule, padded_vocab, read_local

LAYERS = "decoder.layers."
EXPERTS = "mlp.experts.local_experts."  # local spec: SequentialMLP, one module per expert
GROUPED = "mlp.experts."  # TE spec: TEGroupedMLP, mlp.experts.linear_fc1.weight{k} for local expert k
# The TE spec fuses these norms into the next linear layer; same HF tensors as the local spec's norms.
TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",  # MLA
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


@dataclass(frozen=True)
class Located:
    rule: Rule
    layer: int | None  # global layer index
    expert: int | None  # global expert index

    def hf_names(self) -> list[str]:
        return [n.format(L=self.layer, E=self.expert) for n in self.rule.hf]


def locate(name: str, model, family: Family, spec: ModelSpec) -> Located:
    """Megatron parameter name (on this rank) -> its rule and global layer/expert indices."""
    from megatron.core import parallel_state

    if not name.startswith(LAYERS):
        rule = family.global_rules[name]
        if name == "output_layer.weight" and spec.tied_embeddings:
            rule = family.global_rules["embedding.word_embeddings.weight"]
        return Located(rule, None, None)
    index, suffix = name[len(LAYERS):].split(".", 1)
    layer = model.decoder.layers[int(index)].layer_number - 1  # layer_number is global and 1-based
    suffix = TE_FUSED_NORMS.get(suffix, suffix)
    if suffix.startswith(EXPERTS):
        local, expert_suffix = suffix[len(EXPERTS):].split(".", 1)
    elif suffix.startswith(GROUPED):
        grouped = suffix[len(GROUPED):]
        expert_suffix = grouped.rstrip("0123456789")
        local = grouped[len(expert_suffix):]
    else:
        return Located(family.layer_rules[suffix], layer, None)
    per_rank = spec.num_experts // parallel_state.get_expert_model_parallel_world_size()
    expert = parallel_state.get_expert_model_parallel_rank() * per_rank + int(local)
    return Located(family.expert_rules[expert_suffix], layer, expert)


def weight_tensors(model, family: Family):
    """(name, tensor) of every parameter, then of the buffers the family names as weights (Family.buffers,
    e.g. the router's expert bias): what is loaded from and exported to HF tensors."""
    yield from model.named_parameters()
    if family.buffers:
        for name, buf in model.named_buffers():
            if name.startswith(LAYERS) and name[len(LAYERS):].split(".", 1)[1] in family.buffers:
                yield name, buf


def is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)  # Megatron marks expert params allreduce=False


def tp_shard(param):
    """(partition dim, group) of a tensor-parallel parameter, (None, None) for a replicated one."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return None, None
    group = (parallel_state.get_expert_tensor_parallel_group() if is_expert(param)
             else parallel_state.get_tensor_model_parallel_group())
    return param.partition_dim, group


class SafetensorsReader:
    """Reads single tensors by name from a model folder (one file or an index of shards)."""

    def __init__(self, model_dir: str | Path):
        from megapo.weights.safetensors_io import open_tensors

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"model: no *.safetensors in {model_dir}")
            weight_map = {}
            for f in files:
                with open_tensors(f) as handle:
                    weight_map.update({k: f.name for k in handle.keys()})
        self.weight_map = weight_map
        self.handles = {f: open_tensors(model_dir / f) for f in set(weight_map.values())}

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in the checkpoint")
        return self.handles[self.weight_map[name]]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor, reading only those bytes' worth."""
        if dim is None:
            return self.get(name).to(torch.float32)
        view = self._handle(name).get_slice(name)
        part = view[start:stop] if dim == 0 else view[:, start:stop]
        return part.to(torch.float32)


def load_hf_weights(model, family: Family, spec: ModelSpec, model_dir: str | Path) -> int:
    """Copy HF weights into this rank's shards of `model` (unwrapped GPTModel); return tensors loaded."""
    reader = SafetensorsReader(model_dir)
    if family.read_view is not None:  # the rules' per-expert names, read out of fused file tensors
        reader = family.read_view(reader)
    tp = _tp_size()
    loaded = 0
    with torch.no_grad():
        for name, param in weight_tensors(model, family):
            where = locate(name, model, family, spec)
            dim, group = tp_shard(param)
            rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
            # only this rank's shard is read from disk (experts: only this EP rank's experts)
            local = read_local(where.rule, spec, where.hf_names(), reader.read, reader.shape, dim=dim, rank=rank,
                               size=size, vocab_rows=padded_vocab(spec.vocab_size, tp))
            if local.shape != param.shape:
                raise ValueError(f"{name}: built {tuple(local.shape)} from {where.hf_names()}, "
                                 f"parameter is {tuple(param.shape)}")
            param.copy_(local.to(param.dtype))
            loaded += 1
    return loaded


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()
