"""The generic config loader: YAML + dotted overrides -> typed dataclasses, errors name the field."""

from dataclasses import dataclass, field
from typing import Any

import pytest

from megapo.config import ConfigError, InputError, OptimConfig, ParallelConfig, Range, bounded, check_fields, load_config


@dataclass
class Inner:
    width: int = 4
    rate: float = 0.5
    tags: list[str] = field(default_factory=list)


@dataclass
class Outer:
    name: str = "run"
    inner: Inner = field(default_factory=Inner)
    maybe: int | None = None
    flag: bool = False
    weights: list[float] = field(default_factory=list)
    opts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ranged:
    share: float = bounded(0.5, "(0, 1]")
    beta: float = bounded(0.9, "[0, 1)")
    count: int = bounded(1, ">= 1")
    every: int = bounded(0, ">= 0", "0 disables")


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: a\ninner: {width: 8, tags: [x]}\n")
    cfg = load_config(Outer, path, ["inner.rate=2", "maybe=3", "flag=true", "inner.tags=[y, z]"])
    assert cfg.name == "a" and cfg.inner.width == 8
    assert cfg.inner.rate == 2.0 and isinstance(cfg.inner.rate, float)
    assert cfg.maybe == 3 and cfg.flag is True and cfg.inner.tags == ["y", "z"]


def test_exponent_without_a_dot_is_a_number_in_files_and_overrides(tmp_path):
    """YAML 1.2 floats: PyYAML's YAML 1.1 reads `1e-3` as the string '1e-3' (it wants `1.0e-3`)."""
    path = tmp_path / "c.yaml"
    path.write_text("inner: {rate: 1e-3}\nweights: [2E+2, -5e-1, 1.5e1]\nname: 1e3x\n")
    cfg = load_config(Outer, path)
    assert cfg.inner.rate == 0.001 and cfg.weights == [200.0, -0.5, 15.0] and cfg.name == "1e3x"
    assert load_config(Outer, path, ["inner.rate=3e-4"]).inner.rate == 0.0003
    assert load_config(OptimConfig, None, ["lr=1e-5"]).lr == 1e-5


@pytest.mark.parametrize("override, field_name, words", [
    ("inner.widht=3", "inner.widht", "did you mean 'width'"),
    ("inner.width=3.5", "inner.width", "integer"),
    ("inner.width=true", "inner.width", "integer"),
    ("flag=1", "flag", "true or false"),
    ("name=[1]", "name", "string"),
    ("inner=5", "inner", "mapping"),
    ("maybe=x", "maybe", "expected an integer"),  # X | None: X's own message
    ("noequals", "noequals", "section.field=value"),
])
def test_errors_name_the_field(override, field_name, words):
    with pytest.raises(ConfigError) as err:
        load_config(Outer, None, [override])
    assert err.value.field == field_name
    assert words in str(err.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "nope.yaml")


@pytest.mark.parametrize("override, field_name", [
    ("tp=0", "parallel.tp"), ("dispatcher=ring", "parallel.dispatcher"), ("ep=4", "parallel.ep"),
])
def test_parallel_validation(override, field_name):
    with pytest.raises(ConfigError) as err:
        load_config(ParallelConfig, None, [override, "tp=2", "dp=1"] if override == "ep=4" else [override])
    assert err.value.field == field_name


def test_parallel_world_size_and_optim_checks():
    cfg = load_config(ParallelConfig, None, ["tp=2", "pp=2", "dp=3", "ep=2"])
    assert cfg.world_size == 12
    with pytest.raises(ConfigError) as err:
        load_config(OptimConfig, None, ["lr_schedule=step"])
    assert err.value.field == "optim.lr_schedule"


@pytest.mark.parametrize("override, field_name", [
    ("inner.rate=.nan", "inner.rate"), ("inner.rate=.inf", "inner.rate"), ("inner.rate=-.inf", "inner.rate"),
    ("weights=[1.0, .nan]", "weights[1]"), ("opts={clip: {low: .inf}}", "opts.clip.low"),
])
def test_non_finite_numbers_are_refused_anywhere(override, field_name):
    with pytest.raises(ConfigError) as err:
        load_config(Outer, None, [override])
    assert err.value.field == field_name and "finite" in str(err.value)


@pytest.mark.parametrize("override, field_name, message", [
    ("share=0", "share", "must be in (0, 1], got 0.0"),
    ("share=1.01", "share", "must be in (0, 1], got 1.01"),
    ("beta=1", "beta", "must be in [0, 1), got 1.0"),
    ("beta=-0.1", "beta", "must be in [0, 1), got -0.1"),
    ("count=0", "count", "must be >= 1, got 0"),
    ("every=-1", "every", "must be >= 0 (0 disables), got -1"),
])
def test_declared_ranges_name_the_field_and_the_range(override, field_name, message):
    with pytest.raises(ConfigError) as err:
        load_config(Ranged, None, [override])
    assert err.value.field == field_name and str(err.value) == f"{field_name}: {message}"


def test_range_boundaries_that_are_allowed():
    cfg = load_config(Ranged, None, ["share=1", "beta=0", "count=1", "every=0"])
    assert (cfg.share, cfg.beta, cfg.count, cfg.every) == (1.0, 0.0, 1, 0)


def test_configs_built_in_python_are_held_to_the_same_ranges():
    with pytest.raises(ConfigError) as err:
        check_fields(Ranged(share=2.0), "section")
    assert err.value.field == "section.share"
    with pytest.raises(ConfigError) as err:
        OptimConfig(adam_beta2=1.0).validate()
    assert err.value.field == "optim.adam_beta2"
    with pytest.raises(ConfigError) as err:
        OptimConfig(lr=float("nan")).validate()
    assert err.value.field == "optim.lr"


def test_a_range_written_wrong_fails_where_it_is_declared():
    with pytest.raises(ValueError, match="range '=> 0'"):
        Range("=> 0")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: a\ninner:\n\twidth: 3\n")  # a tab cannot indent YAML
    with pytest.raises(InputError) as err:
        load_config(Outer, path)
    assert err.value.field == f"{path}:3:1" and "not valid YAML" in str(err.value)


def test_non_utf8_config_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(InputError) as err:
        load_config(Outer, path)
    assert err.value.field == str(path) and "UTF-8" in str(err.value)


def test_adam_step_beyond_float32_is_refused_naming_lr():
    """Adam's first bias-corrected step size is lr / (1 - beta1); beyond float32's max the optimizer raised a
    RuntimeError mid-step. The same lr with beta1 = 0 fits (3e38 < 3.4028e38) and is accepted."""
    with pytest.raises(ConfigError) as err:
        load_config(OptimConfig, None, ["lr=1.0e+38"])  # 1e38 / 0.1 = 1e39
    assert err.value.field == "optim.lr" and "float32" in str(err.value)
    assert load_config(OptimConfig, None, ["lr=3.0e+38", "adam_beta1=0"]).lr == 3.0e38


def test_config_digest_reads_content_not_bytes(tmp_path):
    """A bench folder keys its cells by config_digest: comments, key order and layout leave it; a value changes it."""
    import hashlib
    import json

    from megapo.config import config_digest

    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text("train:\n  steps: 60   # short\n  seed: 0\nrollout: {n_samples: 8}\n")
    b.write_text("# a comment\nrollout:\n  n_samples: 8\ntrain: {seed: 0, steps: 60}\n")
    c.write_text("train:\n  steps: 61\n  seed: 0\nrollout: {n_samples: 8}\n")
    content = {"rollout": {"n_samples": 8}, "train": {"seed": 0, "steps": 60}}
    expected = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    assert config_digest(a) == config_digest(b) == expected
    assert config_digest(c) != expected
