"""Probe cases of the class 'poor: late config / input errors': YAML and config-file errors, field values,
model folders (config.json, tokenizer, weights), data files and output paths refused before anything runs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tools.probe.inputs import _data_refusal, _good_rows, _jsonl, _parquet
from tools.probe.outcomes import RUN_TIMEOUT_S, snapshot
from tools.probe.registry import case, config_refusal, refused


LATE = "poor: late config / input errors"


@case(LATE)
def yaml_syntax_error(ctx):
    folder = ctx.fresh("yaml_syntax")
    config = ctx.config(folder)
    lines = config.read_text().splitlines()
    lines.insert(3, "  oops: [unclosed")
    config.write_text("\n".join(lines) + "\n")
    out = ctx.train(config)
    verdict = refused(ctx, out, "config.yaml:", forbid=(folder / "run",))
    if verdict[1][0] == "good" and not re.search(r"config\.yaml:[45]\b", out.text):
        return out, ("poor", "the YAML error does not give the line (4 or 5)")
    return verdict


@case(LATE)
def yaml_syntax_error_in_an_override(ctx):
    return config_refusal(ctx, "override_syntax", ("train.log=[jsonl",), ("train.log",))


@case(LATE)
def config_file_missing(ctx):
    folder = ctx.fresh("config_missing")
    return refused(ctx, ctx.train(folder / "nope.yaml"), "nope.yaml")


@case(LATE)
def config_top_level_not_a_mapping(ctx):
    folder = ctx.fresh("config_list")
    (folder / "c.yaml").write_text("- a\n- b\n")
    return refused(ctx, ctx.train(folder / "c.yaml"), "c.yaml")


def _field_case(name, overrides, named, **sections):
    def probe(ctx):
        return config_refusal(ctx, name, overrides, named, **sections)
    probe.__name__ = name
    case(LATE)(probe)


for _name, _overrides, _named in [
    ("adam_beta1_2", ("optim.adam_beta1=2",), ("optim.adam_beta1",)),
    ("adam_beta2_1", ("optim.adam_beta2=1",), ("optim.adam_beta2",)),
    ("kl_coef_nan", ("algorithm.kl_coef=.nan",), ("algorithm.kl_coef",)),
    ("unknown_field", ("optim.lrr=0.1",), ("optim.lrr",)),
    ("unknown_section", ("optimizer.lr=0.1",), ("optimizer",)),
    ("wrong_type_steps", ("train.steps=abc",), ("train.steps",)),
    ("override_without_equals", ("train.steps",), ("train.steps",)),
    ("steps_zero", ("train.steps=0",), ("train.steps",)),
    ("n_samples_zero", ("rollout.n_samples=0",), ("rollout.n_samples",)),
    ("top_p_above_1", ("rollout.top_p=1.5",), ("rollout.top_p",)),
    ("unknown_objective", ("algorithm.objective=ppo2",), ("algorithm.objective",)),
    ("unknown_advantage", ("algorithm.advantage=gae",), ("algorithm.advantage",)),
    ("unknown_loss_agg", ("algorithm.loss_agg=mean",), ("algorithm.loss_agg",)),
    ("unknown_objective_option", ("algorithm.objective_options={clip_hgh: 0.3}",), ("algorithm.objective_options",)),
    ("unknown_engine", ("rollout.engine=hf",), ("rollout.engine",)),
    ("mini_batches_not_dividing", ("train.mini_batches=3",), ("train.mini_batches",)),
    ("reward_unknown_module", ("data.reward=no_such_module:fn",), ("data.reward", "no_such_module")),
    ("reward_unknown_function", ("data.reward=probe_rewards:absent",), ("data.reward", "absent")),
    ("layout_tp_not_dividing_heads", ("parallel.tp=3",), ("parallel.tp",)),
    ("layout_ep_not_dividing_experts", ("parallel.ep=3", "parallel.dp=3", "data.prompts_per_step=3"),
     ("parallel.ep",)),
]:
    _field_case(_name, _overrides, _named)


def _model_variant(ctx, name, edit) -> tuple[Path, Path]:
    """(case folder, model copy) with `edit(model_dir)` applied to the copy."""
    folder = ctx.fresh(name)
    model = folder / "model"
    shutil.copytree(ctx.model, model)
    edit(model)
    return folder, model


def _edit_config_json(**changes):
    def edit(model):
        cfg = json.loads((model / "config.json").read_text())
        cfg.update(changes)
        (model / "config.json").write_text(json.dumps(cfg))
    return edit


def _model_refusal(ctx, name, edit, *names):
    folder, model = _model_variant(ctx, name, edit)
    out = ctx.train(ctx.config(folder), f"model.path={model}")
    return refused(ctx, out, *names, forbid=(folder / "run",))


@case(LATE)
def routing_replay_on_a_dense_model(ctx):
    def dense(model):
        cfg = json.loads((model / "config.json").read_text())
        for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef",
                    "output_router_logits"):
            cfg.pop(key, None)
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
        (model / "config.json").write_text(json.dumps(cfg))
    folder, model = _model_variant(ctx, "r3_on_dense", dense)
    out = ctx.train(ctx.config(folder), f"model.path={model}", "algorithm.routing_replay=r3")
    return refused(ctx, out, "algorithm.routing_replay", forbid=(folder / "run",))


@case(LATE)
def model_type_deepseek_v3(ctx):
    return _model_refusal(ctx, "deepseek_v3", _edit_config_json(model_type="deepseek_v3"), "model.path",
                          "deepseek_v3")


@case(LATE)
def model_type_gpt_oss(ctx):
    return _model_refusal(ctx, "gpt_oss", _edit_config_json(model_type="gpt_oss"), "model.path", "gpt_oss")


@case(LATE)
def llama_on_an_moe_folder(ctx):
    return _model_refusal(ctx, "llama_on_moe", _edit_config_json(model_type="llama"), "model.path", "llama")


@case(LATE)
def config_json_unreadable(ctx):
    def edit(model):
        (model / "config.json").write_text('{"model_type": "qwen3_moe", ')
    return _model_refusal(ctx, "config_json_cut", edit, "config.json")


@case(LATE)
def model_folder_without_config_json(ctx):
    return _model_refusal(ctx, "no_config_json", lambda m: (m / "config.json").unlink(), "model.path",
                          "config.json")


@case(LATE)
def model_folder_without_tokenizer(ctx):
    def edit(model):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (model / f).unlink()
    return _model_refusal(ctx, "no_tokenizer", edit, "model.path", "tokenizer")


def _rewrite_tensors(model: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


def _weights_refusal(ctx, name, edit, *names):
    """A model folder whose weights are damaged: refused naming the file or tensor, before the learner
    trains anything (no output folder written)."""
    folder, model = _model_variant(ctx, name, edit)
    out = ctx.train(ctx.config(folder), f"model.path={model}", timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, *names, forbid=(folder / "run" / "checkpoints",))


@case(LATE, cheap=False)
def model_truncated_safetensors(ctx):
    def edit(model):
        data = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(data[:len(data) // 2])
    return _weights_refusal(ctx, "truncated_safetensors", edit, "model.safetensors")


@case(LATE, cheap=False)
def model_extra_tensor(ctx):
    import torch

    def edit(model):
        _rewrite_tensors(model, lambda t: t.__setitem__("model.layers.0.extra_probe.weight", torch.zeros(4)))
    return _weights_refusal(ctx, "extra_tensor", edit, "model.layers.0.extra_probe.weight")


@case(LATE, cheap=False)
def model_missing_tensor(ctx):
    def edit(model):
        _rewrite_tensors(model, lambda t: t.pop(sorted(n for n in t if n.endswith("k_proj.weight"))[0]))
    return _weights_refusal(ctx, "missing_tensor", edit, "k_proj.weight")


@case(LATE)
def data_non_utf8(ctx):
    def files(d):
        path = _jsonl(d / "train.jsonl", _good_rows(2))
        with open(path, "ab") as f:
            f.write(b'{"prompt": "\xff\xfe", "answer": "1"}\n')
        return [path]
    return _data_refusal(ctx, "non_utf8", files, "train.jsonl:3", "UTF-8")


@case(LATE)
def data_truncated_jsonl(ctx):
    def files(d):
        path = _jsonl(d / "train.jsonl", _good_rows(3))
        path.write_text(path.read_text() + '{"prompt": "4+4=", "ans')
        return [path]
    return _data_refusal(ctx, "truncated_jsonl", files, "train.jsonl:4")


@case(LATE)
def data_truncated_parquet(ctx):
    def files(d):
        path = _parquet(d / "train.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
        path.write_bytes(path.read_bytes()[:-20])
        return [path]
    return _data_refusal(ctx, "truncated_parquet", files, "train.parquet")


@case(LATE)
def data_mixed_jsonl_and_parquet(ctx):
    """One list may mix jsonl and parquet (megapo/trainer/data.py reads each by its suffix); the issue's traceback
    came from reading the parquet file as jsonl. Expected: the parquet file of a mixed list read as parquet and
    its bad row named (data.train_files[1], b.parquet), not a decode error of the wrong reader."""
    def files(d):
        return [_jsonl(d / "a.jsonl", _good_rows(2)),
                _parquet(d / "b.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", None]})]
    return _data_refusal(ctx, "mixed_formats", files, "data.train_files[1]", "b.parquet", "answer")


@case(LATE)
def data_file_missing(ctx):
    return _data_refusal(ctx, "data_missing", lambda d: [d / "absent.jsonl"], "absent.jsonl")


@case(LATE)
def data_file_empty(ctx):
    return _data_refusal(ctx, "data_empty", lambda d: [_jsonl(d / "train.jsonl", [])], "train.jsonl")


@case(LATE)
def data_row_not_an_object(ctx):
    return _data_refusal(ctx, "row_list", lambda d: [_jsonl(d / "train.jsonl", _good_rows(1) + ["[1, 2]"])],
                         "train.jsonl:2")


@case(LATE)
def data_missing_prompt_key(ctx):
    return _data_refusal(ctx, "no_prompt_key", lambda d: [_jsonl(d / "train.jsonl", [{"question": "1+1=",
                                                                                     "answer": "2"}])],
                         "train.jsonl:1", "prompt")


@case(LATE)
def data_unsupported_suffix(ctx):
    def files(d):
        (d / "train.csv").write_text("prompt,answer\n1+1=,2\n")
        return [d / "train.csv"]
    return _data_refusal(ctx, "csv", files, "train.csv")


@case(LATE)
def data_every_prompt_too_long(ctx):
    return _data_refusal(ctx, "prompts_too_long", lambda d: [_jsonl(d / "train.jsonl", _good_rows(3))],
                         "data.max_prompt_tokens", max_prompt_tokens=2)


@case(LATE)
def task_and_train_files_together(ctx):
    folder = ctx.fresh("task_and_files")
    f = _jsonl(folder / "train.jsonl", _good_rows(2))
    out = ctx.train(ctx.config(folder, data={"task": "addition", "train_files": [str(f)]}))
    return refused(ctx, out, "data.task", forbid=(folder / "run",))


@case(LATE)
def output_dir_is_a_file(ctx):
    folder = ctx.fresh("output_dir_file")
    (folder / "run").write_text("not a folder")
    config = ctx.config(folder)
    before = snapshot(folder)
    out = ctx.train(config)
    return refused(ctx, out, "train.output_dir", "is a file", watch=folder, before=before)


@case(LATE)
def output_dir_under_a_file(ctx):
    folder = ctx.fresh("output_dir_under_file")
    (folder / "blocker").write_text("x")
    config = ctx.config(folder, train={"output_dir": str(folder / "blocker" / "run")})
    return refused(ctx, ctx.train(config), "train.output_dir", "blocker")


@case(LATE)
def model_path_is_a_file(ctx):
    folder = ctx.fresh("model_path_file")
    (folder / "m").write_text("x")
    return refused(ctx, ctx.train(ctx.config(folder), f"model.path={folder / 'm'}"), "model.path",
                   forbid=(folder / "run",))
