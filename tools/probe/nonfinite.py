"""Probe cases of the class 'wrong: non-finite config numbers / state': non-finite config numbers refused
by name, updates to non-finite weights skipped or stopped, a model holding NaN refused by convert.
"""

from __future__ import annotations

import shutil

from tools.probe.inputs import _metrics_rows
from tools.probe.outcomes import RUN_TIMEOUT_S, classify, message_line
from tools.probe.registry import case, config_refusal, refused


NONFINITE = "wrong: non-finite config numbers / state"


def _nonfinite(field_name: str, value: str, named: str | None = None, **sections):
    def probe(ctx):
        return config_refusal(ctx, f"{field_name}={value}", (f"{field_name}={value}",), (named or field_name,),
                              **sections)
    return probe


for _field, _value, _named, _sections in [
    ("optim.lr", ".inf", None, {}), ("optim.lr", ".nan", None, {}), ("optim.lr", "-.inf", None, {}),
    ("optim.grad_clip", ".nan", None, {}), ("optim.adam_eps", ".inf", None, {}),
("rollout.temperature", ".inf", None, {}),
    ("rollout.top_p", ".nan", None, {}), ("algorithm.entropy_coef", ".inf", None, {}),
    ("algorithm.objective_options", "{clip_high: .nan}", "algorithm.objective_options", {}),
    ("algorithm.mismatch_options", "{cap: .inf}", "algorithm.mismatch_options",
     {"algorithm": {"objective": "gspo", "advantage": "grpo", "routing_replay": "off", "mismatch": "tis"}}),
    ("data.truncated_reward", ".nan", None, {}),
    ("sft.lr", ".nan", None, {"sft": {"enabled": True}}),
]:
    _fn = _nonfinite(_field, _value, _named, **_sections)
    _fn.__name__ = f"config_{_field.replace('.', '_')}_{_value.strip('{}').replace(':', '').replace(' ', '_')}"
    case(NONFINITE)(_fn)


# An update that leaves every weight non-finite while each number stays within float32: Adam's first step size is
# lr / (1 - beta1) = 3e38 (beta1 0), and weight decay 1 subtracts lr * w: weights of size > 1 reach inf.
POISON = ("optim.lr=3.0e+38", "optim.adam_beta1=0", "optim.weight_decay=1", "optim.grad_clip=0")


@case(NONFINITE)
def adam_step_beyond_float32_is_refused(ctx):
    """optim.lr=1.0e+38 with adam_beta1 0.9: Adam's first step size 1e39 is not a float32 (it was a RuntimeError
    traceback inside the optimizer). Expected: exit 2 naming optim.lr, nothing written."""
    return config_refusal(ctx, "lr_1e38", ("optim.lr=1.0e+38",), ("optim.lr",))


@case(NONFINITE, cheap=False)
def update_to_nonfinite_weights_is_skipped(ctx):
    """POISON: every update would leave non-finite weights. Expected: each such update undone
    (train/skipped_nonfinite 1), the run finishes, its checkpoints are of finite weights."""
    folder = ctx.fresh("lr_poison")
    out = ctx.train(ctx.config(folder), *POISON, timeout=RUN_TIMEOUT_S)
    rows = [r for r in _metrics_rows(folder / "run") if "train/skipped_nonfinite" in r]
    if out.rc != 0:
        return out, ("poor" if out.rc is not None else "wrong", f"exit {out.rc}: {message_line(out)}")
    if not rows or any(r["train/skipped_nonfinite"] != 1 for r in rows):
        return out, ("wrong", f"an update to non-finite weights was applied: {rows}")
    return out, ("good", f"exit 0, {len(rows)} update(s) to inf weights skipped (train/skipped_nonfinite=1)")


@case(NONFINITE, cheap=False)
def update_to_nonfinite_weights_without_restore_stops(ctx):
    """optim.restore_nonfinite=false: no copy to undo from, so the run stops (exit 1, one line naming the field),
    and no checkpoint of the poisoned weights is written."""
    folder = ctx.fresh("lr_poison_no_restore")
    out = ctx.train(ctx.config(folder), *POISON, "optim.restore_nonfinite=false", timeout=RUN_TIMEOUT_S)
    ckpts = folder / "run" / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    return out, classify(out, rc=1, names=("optim.restore_nonfinite", "non-finite"),
                         wrong_state=f"checkpoint(s) of the poisoned weights written: {saved}" if saved else None)


@case(NONFINITE, cheap=False)
def convert_model_holding_nan(ctx):
    """`megapo convert hf-to-megatron` of a model one of whose tensors holds a NaN: refused naming the tensor;
    no output folder."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = ctx.fresh("convert_nan")
    model = folder / "model"
    shutil.copytree(ctx.model, model)
    tensors = load_file(model / "model.safetensors")
    poisoned = sorted(n for n in tensors if n.endswith("q_proj.weight"))[0]
    tensors[poisoned] = tensors[poisoned].clone()
    tensors[poisoned].view(-1)[3] = torch.nan
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = ctx.megapo("convert", "hf-to-megatron", "--hf", model, "--out", folder / "ckpt", timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "non-finite", rc=out.rc if out.rc not in (0, None) else 1, forbid=(folder / "ckpt",),
                   traceback_ok=True)
