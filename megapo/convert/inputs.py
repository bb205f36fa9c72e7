"""Checks of the converter's inputs, before any process starts: the HF folder (config understood,
safetensors names and shapes match the config), the Megatron checkpoint (a torch_dist folder whose
stored global shapes match the config and the layout it is loaded with), the output path.

Every failure is a ConfigError naming the command-line argument.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megapo.config import ConfigError, ParallelConfig
from megapo.convert.support import check_config, expected_hf_tensors
from megapo.integrity import read_dist_metadata
from megapo.layout import LayoutError, check_layout
from megapo.models.family import Family, ModelSpec, padded_vocab

MEGAPO_META = "megapo_checkpoint.json"  # written by hf-to-megatron next to the torch_dist files
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".distcp", ".partial")
WEIGHT_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", MEGAPO_META, "metadata.json",
                "common.pt", ".metadata")


@dataclass
class ModelFolder:
    folder: Path  # holds config.json (and usually the tokenizer)
    hf: dict
    family: Family
    spec: ModelSpec


@dataclass
class HFInput(ModelFolder):
    tensors: dict[str, tuple[int, ...]]  # name -> shape, as expected and found
    dtypes: set[str]  # safetensors dtypes found ("F32", "BF16", ...)


@dataclass
class CheckpointInput:
    folder: Path  # the torch_dist folder
    model: ModelFolder
    meta: dict | None  # megapo_checkpoint.json when written by hf-to-megatron
    stored: dict[str, tuple[int, ...]]  # checkpoint key -> global shape (model tensors only)


def read_config(folder, arg: str) -> ModelFolder:
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(arg, f"{folder} is not a folder")
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(arg, f"no config.json in {folder}")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(arg, f"{path} is not valid JSON ({exc})") from None
    family, spec = check_config(hf, arg)
    return ModelFolder(folder, hf, family, spec)


def read_hf(folder, arg: str) -> HFInput:
    """An HF model folder whose safetensors hold exactly the tensors its config describes."""
    model = read_config(folder, arg)
    found, dtypes = check_hf_tensors(model.folder, model.family, model.spec, arg)
    return HFInput(model.folder, model.hf, model.family, model.spec, found, dtypes)


def check_hf_tensors(folder: Path, family, spec, arg: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The safetensors headers of `folder` (names, shapes, dtypes), checked to hold exactly the tensors of
    `family` / `spec` with their shapes, every file readable (a truncated one is refused); ConfigError naming
    `arg` otherwise. Reads headers only."""
    from megapo.weights.safetensors_io import open_tensors

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise ConfigError(arg, f"{index} has no weight_map") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(arg, f"no *.safetensors in {folder}")
    found: dict[str, tuple[int, ...]] = {}
    dtypes: set[str] = set()
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ConfigError(arg, f"{path} (listed in the index) does not exist")
        try:
            with open_tensors(path) as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    found[key] = tuple(piece.get_shape())
                    dtypes.add(piece.get_dtype())
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise ConfigError(arg, f"{path} is not a readable safetensors file ({exc})") from None
    expected = expected_hf_tensors(family, spec)
    missing = [k for k in expected if k not in found]
    if missing:
        raise ConfigError(arg, f"{len(missing)} tensor(s) the config describes are not in the safetensors, "
                               f"e.g. {missing[:3]}")
    extra = [k for k in found if k not in expected]
    if extra:
        raise ConfigError(arg, f"{len(extra)} tensor(s) in the safetensors are not described by the config "
                               f"(they would be dropped), e.g. {extra[:3]}")
    for key, shape in expected.items():
        if found[key] != shape:
            raise ConfigError(arg, f"tensor {key} has shape {found[key]}, config.json implies {shape}")
    return found, dtypes


def checkpoint_shapes(spec: ModelSpec, vocab_rows: int) -> dict[str, tuple[int, ...]]:
    """Global shapes of the model tensors in a Megatron-core torch_dist checkpoint, names as Megatron writes them
    (GQA: for both the local and the TE layer spec; MLA: the local spec's). Layers stacked on dim 0 (experts on
    dim 1), except in a model mixing dense and MoE layers, where every layer is written under its own number."""
    h, L = spec.hidden_size, spec.num_layers
    shapes = {"embedding.word_embeddings.weight": (vocab_rows, h), "decoder.final_layernorm.weight": (h,)}
    if not spec.tied_embeddings:
        shapes["output_layer.weight"] = (vocab_rows, h)
    if spec.num_moe_layers in (0, L):
        layer = {**_attention_shapes(spec), **_mlp_shapes(spec, moe=bool(spec.num_experts))}
        shapes.update({f"decoder.layers.{k}": (L, *v) for k, v in layer.items()})
        return shapes
    for i in range(L):
        layer = {**_attention_shapes(spec), **_mlp_shapes(spec, moe=spec.is_moe_layer(i))}
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def _attention_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """One layer's attention and input norm (GQA: the norm under TE's fused name, which the local spec maps to)."""
    h, d, m = spec.hidden_size, spec.head_dim, spec.mla
    if m is None:
        qkv = (spec.num_heads + 2 * spec.num_kv_heads) * d
        shapes = {"self_attention.linear_qkv.layer_norm_weight": (h,), "self_attention.linear_qkv.weight": (qkv, h),
                  "self_attention.linear_proj.weight": (h, spec.num_heads * d)}
        if spec.qkv_bias:
            shapes["self_attention.linear_qkv.bias"] = (qkv,)
        if spec.linear_bias:
            shapes["self_attention.linear_proj.bias"] = (h,)
        if spec.attention_sinks:
            shapes["self_attention.core_attention.softmax_offset"] = (spec.num_heads,)
        if spec.qk_norm:
            shapes.update({"self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,)})
        return shapes
    shapes = {"input_layernorm.weight": (h,),
              "self_attention.linear_kv_down_proj.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
              "self_attention.kv_layernorm.weight": (m.kv_lora_rank,),
              "self_attention.linear_kv_up_proj.weight": (spec.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                                          m.kv_lora_rank),
              "self_attention.linear_proj.weight": (h, spec.num_heads * m.v_head_dim)}
    if m.q_lora_rank:
        shapes.update({"self_attention.linear_q_down_proj.weight": (m.q_lora_rank, h),
                       "self_attention.q_layernorm.weight": (m.q_lora_rank,),
                       "self_attention.linear_q_up_proj.weight": (spec.num_heads * d, m.q_lora_rank)})
    else:
        shapes["self_attention.linear_q_proj.weight"] = (spec.num_heads * d, h)
    return shapes


def _mlp_shapes(spec: ModelSpec, *, moe: bool) -> dict[str, tuple[int, ...]]:
    """One layer's pre-MLP norm and dense MLP or MoE (router, its expert bias, experts, shared experts)."""
    h = spec.hidden_size
    norm = "mlp.linear_fc1.layer_norm_weight" if spec.mla is None else "pre_mlp_layernorm.weight"
    shapes = {norm: (h,)}
    if not moe:
        f = spec.ffn_hidden_size
        return {**shapes, "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f)}
    e, f, shared = spec.num_experts, spec.moe_ffn_hidden_size, spec.shared_expert_ffn
    shapes.update({"mlp.router.weight": (e, h), "mlp.experts.experts.linear_fc1.weight": (e, 2 * f, h),
                   "mlp.experts.experts.linear_fc2.weight": (e, h, f)})
    if spec.router_expert_bias:
        shapes["mlp.router.expert_bias"] = (e,)
    if spec.linear_bias:
        shapes.update({"mlp.router.bias": (e,), "mlp.experts.experts.linear_fc1.bias": (e, 2 * f),
                       "mlp.experts.experts.linear_fc2.bias": (e, h)})
    if shared:
        shapes.update({"mlp.shared_experts.linear_fc1.weight": (2 * shared, h),
                       "mlp.shared_experts.linear_fc2.weight": (h, shared)})
    return shapes


def find_checkpoint(path, arg: str) -> Path:
    """The torch_dist folder: PATH itself, or PATH/learner for a megapo trainer checkpoint (step_N/)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(arg, f"{path} is not a folder")
    for candidate in (path, path / "learner"):
        marker = candidate / "metadata.json"
        if marker.is_file():
            try:
                backend = json.loads(marker.read_text()).get("sharded_backend")
            except json.JSONDecodeError:
                backend = None
            if backend != "torch_dist":
                raise ConfigError(arg, f"{marker}: sharded_backend {backend!r}; only torch_dist is supported")
            if not (candidate / ".metadata").is_file():
                raise ConfigError(arg, f"{candidate} has no .metadata: an incomplete torch_dist checkpoint")
            return candidate
    raise ConfigError(arg, f"{path} is not a Megatron torch_dist checkpoint (no metadata.json, "
                           f"nor learner/metadata.json)")


def stored_model_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of the model tensors of a torch_dist folder, from its `.metadata`
    read through megapo.integrity's allow-list (a planted pickle raises UnsafePickle, unrun)."""
    metadata = read_dist_metadata(folder)
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if hasattr(v, "size") and k.split(".")[0] in ("embedding", "decoder", "output_layer")}


def model_mismatch(stored: dict[str, tuple[int, ...]], spec: ModelSpec, config_folder: Path) -> str | None:
    """How the stored tensors differ from the model `spec` (read from config_folder) describes, or None."""
    rows = stored.get("embedding.word_embeddings.weight", (0,))[0]
    expected = checkpoint_shapes(spec, rows)
    missing = [k for k in expected if k not in stored]
    if missing:
        return f"checkpoint lacks {missing[:3]} which the config ({config_folder}) describes"
    extra = [k for k in stored if k not in expected]
    if extra:
        return f"checkpoint holds {extra[:3]} which the config ({config_folder}) does not describe"
    for key, shape in expected.items():
        if stored[key] != shape:
            return (f"checkpoint tensor {key} has shape {stored[key]}, the config ({config_folder}/config.json) "
                    f"implies {shape}")
    if rows < spec.vocab_size:
        return f"checkpoint embedding has {rows} rows for vocab_size {spec.vocab_size}"
    return None


def read_checkpoint(path, arg: str, model_dir=None, model_arg: str = "--model") -> CheckpointInput:
    """A torch_dist checkpoint plus the config describing it: the checkpoint's own config.json
    (written by hf-to-megatron) or `model_dir` (needed for a trainer checkpoint, which has none)."""
    folder = find_checkpoint(path, arg)
    own = read_config(folder, arg) if (folder / "config.json").is_file() else None
    given = read_config(model_dir, model_arg) if model_dir is not None else None
    if own is None and given is None:
        raise ConfigError(model_arg, f"{folder} has no config.json (a trainer checkpoint?): pass {model_arg} "
                                     f"HF_DIR, the model it was trained from, for its config and tokenizer")
    if own is not None and given is not None and own.spec != given.spec:
        diff = [f"{k}: {getattr(own.spec, k)} vs {getattr(given.spec, k)}" for k in own.spec.__dataclass_fields__
                if getattr(own.spec, k) != getattr(given.spec, k)]
        raise ConfigError(model_arg, f"its config.json describes another model than the checkpoint's own "
                                     f"({'; '.join(diff)})")
    model = given or own
    meta_path = folder / MEGAPO_META
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    try:
        stored = stored_model_shapes(folder)
    except (OSError, ValueError) as exc:  # ValueError includes UnsafePickle: nothing of the file's ran
        raise ConfigError(arg, str(exc)) from None
    problem = model_mismatch(stored, model.spec, model.folder)
    if problem is not None:
        raise ConfigError(arg, problem)
    return CheckpointInput(folder, model, meta, stored)


def check_parallel(parallel: ParallelConfig, hf: dict, max_procs: int) -> None:
    """The layout fits the model and this machine; errors name the command-line flags."""
    try:
        check_layout(parallel, hf)
    except (LayoutError, ConfigError) as exc:
        flag = "--" + exc.field.split(".")[-1] if exc.field.startswith("parallel.") else "--tp/--pp/--ep/--dp"
        raise ConfigError(flag, str(exc).split(": ", 1)[-1]) from None
    if parallel.world_size > max_procs:
        raise ConfigError("--tp/--pp/--dp", f"the layout needs {parallel.world_size} processes; this machine "
                                            f"runs at most {max_procs}")


def check_vocab_rows(ckpt: CheckpointInput, parallel: ParallelConfig) -> None:
    """torch_dist reshards every dimension except the padded vocabulary (rounded up to a multiple of TP)."""
    rows = ckpt.stored["embedding.word_embeddings.weight"][0]
    want = padded_vocab(ckpt.model.spec.vocab_size, parallel.tp)
    if rows != want:
        raise ConfigError("--tp", f"the checkpoint's vocabulary is padded to {rows} rows, tp={parallel.tp} pads "
                                  f"vocab_size {ckpt.model.spec.vocab_size} to {want}; load it with a tp that "
                                  f"gives {rows}")


def check_output(path, arg: str) -> Path:
    path = Path(path)
    if path.exists():
        raise ConfigError(arg, f"{path} already exists; give a new folder (nothing is overwritten)")
    if not path.parent.is_dir():
        raise ConfigError(arg, f"parent folder {path.parent} does not exist")
    return path


def side_files(folder: Path) -> list[Path]:
    """The non-weight files of an HF folder (config, generation config, tokenizer, chat template)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and p.suffix not in WEIGHT_SUFFIXES and p.name not in WEIGHT_FILES)
