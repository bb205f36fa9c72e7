"""One error surface: a config or input error of any command ends as `megapo <cmd>: <message>` and exit code 2,
before anything is written -- no traceback, no KeyError, no config.json of a run that never started.

Each case states its own expectation: the exit code, the field / file / line the message must name, and that
train.output_dir (and model.path, which model.tiny would write) still does not exist.
"""

import json
import shutil
from pathlib import Path

import pytest

from megapo.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "megapo/configs/tiny_moe_addition.yaml"


def _train(capsys, tmp_path, *overrides, config=CONFIG, model=None):
    out = tmp_path / "run"
    model = model or tmp_path / "model"  # absent: model.tiny of the shipped config would write it
    rc = main(["train", str(config), f"train.output_dir={out}", f"model.path={model}", *overrides])
    err = capsys.readouterr().err
    return rc, err, out


def _model_with(tmp_path, source, **changes) -> Path:
    """A copy of model folder `source` whose config.json has `changes` (None removes a key)."""
    d = tmp_path / f"model-{len(list(tmp_path.glob('model-*')))}"
    shutil.copytree(source, d)
    hf = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.mark.parametrize("override, field_name", [
    ("optim.lr=.inf", "optim.lr"),
    ("algorithm.kl_coef=.nan", "algorithm.kl_coef"),
    ("optim.adam_beta1=2", "optim.adam_beta1"),
    ("rollout.top_p=1.5", "rollout.top_p"),
])
def test_bad_numbers_exit_2_before_anything_is_written(capsys, tmp_path, override, field_name):
    rc, err, out = _train(capsys, tmp_path, override)
    assert rc == 2
    assert err.startswith(f"megapo train: {field_name}: "), err
    assert "Traceback" not in err
    assert not out.exists() and not (tmp_path / "model").exists()


def test_yaml_syntax_error_names_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\ntrain: {steps: 3\n")  # the flow mapping is never closed
    rc, err, out = _train(capsys, tmp_path, config=bad)
    assert rc == 2 and err.startswith(f"megapo train: {bad}:") and "not valid YAML" in err
    line = int(err.split(f"{bad}:")[1].split(":")[0])
    assert line in (3, 4)  # where the unclosed mapping is (PyYAML reports the end of it)
    assert not out.exists()


def test_bad_override_yaml_names_the_override(capsys, tmp_path):
    rc, err, out = _train(capsys, tmp_path, "train.log=[jsonl,")
    assert rc == 2 and err.startswith("megapo train: train.log: value '[jsonl,' is not valid YAML")


def test_missing_config_file(capsys, tmp_path):
    rc, err, out = _train(capsys, tmp_path, config=tmp_path / "nope.yaml")
    assert rc == 2 and f"config file {tmp_path / 'nope.yaml'} does not exist" in err
    assert not out.exists()


def test_output_dir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "run").write_text("not a folder")
    rc, err, _ = _train(capsys, tmp_path)
    assert rc == 2 and err.startswith(f"megapo train: train.output_dir: {tmp_path / 'run'} is a file")
    assert (tmp_path / "run").read_text() == "not a folder"
    assert not (tmp_path / "model").exists()  # model.tiny was not written either


def test_model_path_under_a_file(capsys, tmp_path):
    (tmp_path / "blob").write_text("x")
    rc, err, out = _train(capsys, tmp_path, model=tmp_path / "blob" / "model")
    assert rc == 2 and err.startswith("megapo train: model.path:") and "which is a file" in err
    assert not out.exists()


def test_a_family_field_missing_from_config_json_names_it(capsys, tmp_path, tiny_moe):
    model = _model_with(tmp_path, tiny_moe, model_type="deepseek_v3")  # a Qwen3-MoE config.json: no MLA ranks
    rc, err, out = _train(capsys, tmp_path, model=model)
    assert rc == 2 and err.startswith(f"megapo train: model.path: {model / 'config.json'}:"), err
    assert "qk_nope_head_dim" in err and not out.exists()


@pytest.mark.parametrize("model_type", ["olmoe", "dbrx"])  # (gpt_oss is a family now)
def test_unsupported_model_type_names_the_file(capsys, tmp_path, tiny_moe, model_type):
    model = _model_with(tmp_path, tiny_moe, model_type=model_type)
    rc, err, out = _train(capsys, tmp_path, model=model)
    assert rc == 2
    assert err.startswith(f"megapo train: model.path: {model / 'config.json'}: model_type {model_type!r} is not "
                          "supported"), err
    assert not out.exists()


def test_dense_family_on_an_moe_folder(capsys, tmp_path, tiny_moe):
    model = _model_with(tmp_path, tiny_moe, model_type="llama")  # still declares its 8 experts
    rc, err, out = _train(capsys, tmp_path, "rollout.engine=sglang", "rollout.servers=[127.0.0.1:1]",
                          "rollout.weight_sync=disk", "algorithm.routing_replay=off", "sft.enabled=false", model=model)
    assert rc == 2
    assert err.startswith(f"megapo train: model.path: {model / 'config.json'}: model_type 'llama' is a dense family")
    assert "8 experts" in err and not out.exists()


def test_model_config_that_is_not_json(capsys, tmp_path, tiny_moe):
    model = _model_with(tmp_path, tiny_moe)
    (model / "config.json").write_text('{"model_type": "qwen3_moe",')
    rc, err, out = _train(capsys, tmp_path, model=model)
    assert rc == 2 and err.startswith(f"megapo train: model.path: {model / 'config.json'} is not valid JSON")


def test_llama_needs_an_engine_that_runs_it(capsys, tmp_path, tiny_dense):
    """The learner trains llama; the embedded engine does not run it: refused in validation, naming the engine,
    not after the learner is built. The same model served by SGLang servers passes validation."""
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    model = _model_with(tmp_path, tiny_dense, model_type="llama", attention_bias=True)  # qwen2 weights: q/k/v biases
    common = ["algorithm.routing_replay=off", "sft.enabled=false"]
    rc, err, out = _train(capsys, tmp_path, *common, model=model)
    assert rc == 2
    assert err.startswith("megapo train: rollout.engine: the embedded engine runs megapo's PyTorch model, which "
                          f"cannot run {model / 'config.json'}"), err
    assert "'llama'" in err and not out.exists()
    cfg = load_config(RunConfig, CONFIG, [f"model.path={model}", f"train.output_dir={out}", *common,
                                          "rollout.engine=sglang", "rollout.servers=[127.0.0.1:1]",
                                          "rollout.weight_sync=disk"])
    assert cfg.rollout.engine == "sglang"


def test_other_commands_share_the_error_surface(capsys, tmp_path):
    """`megapo sft` and `megapo plot` raise ConfigError for bad input; `megapo` reports it the same way."""
    rc = main(["sft", "--model", str(tmp_path), "--out", str(tmp_path / "sft"), "--threshold", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("megapo sft: --threshold: must be in (0, 1]"), err
    rc = main(["plot", str(tmp_path / "no-run"), "--out", str(tmp_path / "c.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("megapo plot: run_dir:"), err
    assert not (tmp_path / "sft").exists() and not (tmp_path / "c.png").exists()


def test_commands_with_subcommands_and_servers_report_through_the_same_surface(capsys, tmp_path, tiny_moe):
    """serve, logprobs, convert, launch and bench no longer catch their own errors: each bad argument ends as
    `megapo <command> [<subcommand>]: <what it names>`, exit 2, no traceback, nothing written."""
    nope = tmp_path / "nope"
    cases = [
        (["serve", "--model", str(tiny_moe), "--host", "0.0.0.0"], "megapo serve: host 0.0.0.0 is not a loopback"),
        (["logprobs", "--model", str(nope), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o")],
         f"megapo logprobs: model: no config.json in {nope}"),
        (["convert", "hf-to-megatron", "--hf", str(nope), "--out", str(tmp_path / "o")],
         "megapo convert hf-to-megatron: --hf: "),
        (["launch", "local", str(tmp_path / "none.yaml"), "--dry-run"],
         f"megapo launch local: CONFIG: config file {tmp_path / 'none.yaml'} does not exist"),
        (["bench", "projection", "--model", "qwen3-8b", "--out", str(tmp_path / "o")],
         "megapo bench projection: --model: unknown model 'qwen3-8b'"),
    ]
    for argv, start in cases:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(start) and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "o").exists()


def test_model_folder_whose_tensors_do_not_match_its_config(capsys, tmp_path, tiny_moe):
    """Extra, missing and truncated safetensors are found at validation (exit 2 naming model.path and the tensor
    or file), not as a KeyError / SafetensorError after the learner starts."""
    import torch
    from safetensors.torch import load_file, save_file

    def broken(edit):
        model = _model_with(tmp_path, tiny_moe)
        tensors = load_file(model / "model.safetensors")
        edit(tensors)
        save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
        return model

    extra = broken(lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    missing = broken(lambda t: t.pop(next(k for k in sorted(t) if k.endswith("k_proj.weight"))))
    truncated = _model_with(tmp_path, tiny_moe)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 100])
    for model, named in ((extra, "model.layers.0.extra.weight"), (missing, "k_proj.weight"),
                         (truncated, "model.safetensors")):
        rc, err, out = _train(capsys, tmp_path, "sft.enabled=false", model=model)
        assert rc == 2 and err.startswith("megapo train: model.path: ") and named in err, err
        assert "Traceback" not in err and not out.exists()
