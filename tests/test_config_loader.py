"""The generic config loader: YAML + dotted overrides -> typed dataclasses, errors name the field."""

from dataclasses import dataclass, field

import pytest

from megapo.config import ConfigError, OptimConfig, ParallelConfig, load_config


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


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: a\ninner: {width: 8, tags: [x]}\n")
    cfg = load_config(Outer, path, ["inner.rate=2", "maybe=3", "flag=true", "inner.tags=[y, z]"])
    assert cfg.name == "a" and cfg.inner.width == 8
    assert cfg.inner.rate == 2.0 and isinstance(cfg.inner.rate, float)
    assert cfg.maybe == 3 and cfg.flag is True and cfg.inner.tags == ["y", "z"]


@pytest.mark.parametrize("override, field_name, words", [
    ("inner.widht=3", "inner.widht", "did you mean 'width'"),
    ("inner.width=3.5", "inner.width", "integer"),
    ("inner.width=true", "inner.width", "integer"),
    ("flag=1", "flag", "true or false"),
    ("name=[1]", "name", "string"),
    ("inner=5", "inner", "mapping"),
    ("maybe=x", "maybe", "does not fit"),
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
