"""Check a parallel layout against a model before any process starts.

Used by every entry point that starts learner processes (logprobs, train, convert, launch slurm),
so an impossible layout is refused with the numbers that do not fit, not by a hang or a shape
error inside Megatron minutes later.
"""

from __future__ import annotations

import json
from pathlib import Path

from megapo.config import ConfigError, ParallelConfig


class LayoutError(ConfigError):
    pass


def read_hf_config(model_dir: str | Path, field_name: str = "model") -> dict:
    """An HF folder's config.json; LayoutError naming `field_name` and the file when it is absent or not JSON."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise LayoutError(field_name, f"no config.json in {model_dir}")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LayoutError(field_name, f"{path} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise LayoutError(field_name, f"{path} must hold a JSON object")
    return hf


def num_experts(hf: dict) -> int:
    """Experts per MoE layer, 0 for a dense model (field names differ between families)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def check_layout(parallel: ParallelConfig, hf: dict, world_size: int | None = None) -> None:
    """Raise LayoutError naming the numbers when `parallel` cannot run the model described by `hf`."""
    parallel.validate()
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    layers = hf["num_hidden_layers"]
    experts = num_experts(hf)
    if heads % tp:
        raise LayoutError("parallel.tp", f"tp={tp} does not divide num_attention_heads={heads}")
    if kv_heads % tp:
        raise LayoutError("parallel.tp", f"tp={tp} does not divide num_key_value_heads={kv_heads}")
    if layers % pp:
        raise LayoutError("parallel.pp", f"pp={pp} does not divide num_hidden_layers={layers}")
    ffn = hf.get("intermediate_size")
    if ffn and ffn % tp:
        raise LayoutError("parallel.tp", f"tp={tp} does not divide intermediate_size={ffn}")
    if experts:
        if experts % ep:
            raise LayoutError("parallel.ep", f"ep={ep} does not divide the number of experts ({experts})")
        # the learner splits experts over TP only when ep == 1 (expert tensor parallel = 1 otherwise)
        moe_ffn = hf.get("moe_intermediate_size") or hf.get("intermediate_size")
        if ep == 1 and moe_ffn and moe_ffn % tp:
            raise LayoutError("parallel.tp", f"tp={tp} does not divide the expert width ({moe_ffn}) with ep=1")
    elif ep > 1:
        raise LayoutError("parallel.ep", f"ep={ep} but the model is dense (no experts)")
    if world_size is not None and world_size != parallel.world_size:
        raise LayoutError(
            "parallel",
            f"world size {world_size} != tp*pp*dp = {tp}*{pp}*{parallel.dp} = {parallel.world_size}",
        )
