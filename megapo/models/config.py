"""The `model` section of the run config (ModelConfig, its `tiny` block) and the rules inside it: the folder
holds an HF model (config.json, a tokenizer) or model.tiny says which one to write there, and the learner knows
its family. Rules that read other sections (the layout, the engine, routing replay) are RunConfig's
(megapo/trainer/config.py). Each rule raises ConfigError naming the dotted field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megapo.config import ConfigError, bounded, check_creatable_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a folder's tokenizer


@dataclass
class TinyModelConfig:
    """Arguments of megapo.models.tiny.write_tiny_model; the model is written to model.path if absent."""

    family: str = "qwen3_moe"  # qwen3_moe | mixtral (MoE) | qwen2 (dense)
    layers: int = bounded(2, ">= 1")  # decoder layers
    experts: int = bounded(8, ">= 1")  # routed experts per MoE layer (unused by qwen2)
    topk: int = bounded(2, ">= 1")  # experts each token is routed to (at most experts)
    hidden: int = bounded(64, ">= 1")  # hidden size
    heads: int = bounded(4, ">= 1")  # attention heads
    kv_heads: int = bounded(2, ">= 1")  # key/value heads (grouped-query attention)
    head_dim: int = bounded(32, ">= 1")  # width of one attention head
    ffn: int = bounded(128, ">= 1")  # intermediate size of a dense MLP (config.json intermediate_size)
    moe_ffn: int = bounded(128, ">= 1")  # intermediate size of one expert
    vocab: int = bounded(512, ">= 300", "256 byte symbols + specials + merges")  # tokenizer vocabulary size
    seed: int = 0  # seed of the random weights


@dataclass
class ModelConfig:
    """The model RL starts from."""

    path: str = ""  # HF folder (config.json, safetensors, tokenizer)
    tiny: TinyModelConfig | None = None  # create a tiny model at `path` when it does not exist yet

    def exists(self) -> bool:
        """Whether model.path holds a config.json already (else model.tiny writes the model at start-up)."""
        return (Path(self.path) / "config.json").is_file()

    def validate(self) -> tuple[dict, str, object]:
        """The model's config.json (read, or the one model.tiny will write), where it comes from (for errors) and
        the learner's ModelSpec of it; ConfigError naming model.path / model.tiny.* when the folder cannot give a
        model the learner trains."""
        if not self.path:
            raise ConfigError("model.path", "must be set (an HF folder, or where model.tiny writes one)")
        if not self.exists():
            if self.tiny is None:
                raise ConfigError("model.path", f"{self.path} has no config.json (and no model.tiny block to create one)")
            check_creatable_dir(self.path, "model.path")
            hf, where = tiny_hf_config(self.tiny), "model.tiny"  # the model will be created: check its shape
        else:
            from megapo.layout import read_hf_config

            path = Path(self.path)
            hf, where = read_hf_config(path, "model.path"), str(path / "config.json")
            if not any((path / f).is_file() for f in TOKENIZER_FILES):
                raise ConfigError("model.path", f"{self.path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
        return hf, where, learner_spec(hf, where)


def learner_spec(hf: dict, where: str):
    """The learner's ModelSpec of `hf` (config.json at `where`), or ConfigError saying why the learner cannot
    train it: an unknown model_type, a missing field, or an MoE config under a dense family (e.g. llama)."""
    from megapo.layout import num_experts
    from megapo.models.family import family_for

    try:
        spec = family_for(hf).spec(hf)
    except ConfigError as err:
        raise ConfigError("model.path", f"{where}: {err.message}") from None
    except KeyError as err:
        raise ConfigError("model.path", f"{where}: model_type {hf.get('model_type')!r} needs field {err}") from None
    if num_experts(hf) and not spec.num_experts:
        raise ConfigError("model.path", f"{where}: model_type {hf.get('model_type')!r} is a dense family, but the config "
                          f"declares {num_experts(hf)} experts; an MoE model needs its MoE model_type "
                          "(qwen3_moe, mixtral)")
    return spec


def tiny_hf_config(t: TinyModelConfig) -> dict:
    """The config.json model.tiny will write (the model itself is written after validation)."""
    from megapo.models.tiny import build_config, tiny_families

    if t.family not in tiny_families():
        raise ConfigError("model.tiny.family", f"must be one of {', '.join(tiny_families())}, got {t.family!r}")
    if t.family != "qwen2" and t.topk > t.experts:
        raise ConfigError("model.tiny.topk", f"must be at most model.tiny.experts={t.experts}, got {t.topk}")
    return build_config(t.family, vocab_size=t.vocab, hidden=t.hidden, layers=t.layers, experts=t.experts,
                        topk=t.topk, heads=t.heads, kv_heads=t.kv_heads, head_dim=t.head_dim, ffn=t.ffn,
                        moe_ffn=t.moe_ffn, eos_id=0, pad_id=0).to_dict()  # token ids do not matter here


def has_chat_template(path: str | Path) -> bool:
    """Whether the tokenizer in HF folder `path` carries a chat template."""
    import json

    path = Path(path)
    if (path / "chat_template.jinja").is_file():
        return True
    cfg = path / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))
