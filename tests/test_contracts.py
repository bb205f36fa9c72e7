"""docs/CONTRACTS.md declares every method and attribute the trainer uses on an engine, a learner or a KL reference.

The trainer's side is read statically (ast) from megapo/trainer/*.py, megapo/replay/modes.py,
megapo/weights/*.py and megapo/envs/*.py (multi-turn rollouts drive the engine too): every `x.name` and every `hasattr(x, "name")` / `getattr(x, "name", ...)` whose receiver is
a variable called `engine` or `client` (engines), `learner` or `reference` (self.engine etc. too). The doc's side:
the names declared in the ```python blocks of its "## Engines" and "## Learner" sections (`def name(` or
`name: type`, several per line separated by `;`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "docs" / "CONTRACTS.md"
SECTION = {"engine": "Engines", "client": "Engines", "learner": "Learner", "reference": "Learner"}


def trainer_sources() -> list[Path]:
    megapo = ROOT / "megapo"
    return sorted([*(megapo / "trainer").glob("*.py"), megapo / "replay" / "modes.py", *(megapo / "weights").glob("*.py"),
                   *(megapo / "envs").glob("*.py")])


def _receiver(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        node = ast.Name(node.attr)  # self.engine counts as engine
    return node.id if isinstance(node, ast.Name) and node.id in SECTION else None


def used_names(source: str, where: str) -> dict[tuple[str, str], str]:
    """(receiver, name) -> 'where:line' of its first use in `source`."""
    used: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (r := _receiver(node.value)):
            used.setdefault((r, node.attr), f"{where}:{node.lineno}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
              and len(node.args) >= 2 and (r := _receiver(node.args[0])) and isinstance(node.args[1], ast.Constant)):
            used.setdefault((r, node.args[1].value), f"{where}:{node.lineno}")
    return used


def declared_names(doc: str) -> dict[str, set[str]]:
    """Section title -> the names its ```python blocks declare."""
    out: dict[str, set[str]] = {}
    for section in re.split(r"^## ", doc, flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        names = out.setdefault(title.split(" (")[0].strip(), set())
        for block in re.findall(r"```python\n(.*?)```", body, flags=re.S):
            for line in block.splitlines():
                for piece in line.split("#")[0].split(";"):
                    m = re.match(r"\s*(?:def\s+(\w+)\s*\(|(\w+)\s*:)", piece)
                    if m:
                        names.add(m.group(1) or m.group(2))
    return out


def undeclared(used: dict[tuple[str, str], str], declared: dict[str, set[str]]) -> list[str]:
    return [f"{receiver}.{name} ({where}) is not declared in docs/CONTRACTS.md ## {SECTION[receiver]}"
            for (receiver, name), where in sorted(used.items()) if name not in declared.get(SECTION[receiver], set())]


def test_every_engine_and_learner_member_the_trainer_uses_is_in_the_contract():
    used: dict[tuple[str, str], str] = {}
    for path in trainer_sources():
        used.update({k: v for k, v in used_names(path.read_text(), str(path.relative_to(ROOT))).items() if k not in used})
    assert ("engine", "generate") in used and ("learner", "train_step") in used  # the reader sees the calls
    missing = undeclared(used, declared_names(CONTRACTS.read_text()))
    assert not missing, "\n".join(missing)


def test_check_names_what_the_doc_lacks():
    source = ('def f(engine, learner, self):\n    engine.generate([], None)\n    if hasattr(learner, "warp"):\n'
              '        self.engine.teleport()\n    return learner.logprobs, other.thing\n')
    used = used_names(source, "x.py")
    assert set(used) == {("engine", "generate"), ("learner", "warp"), ("engine", "teleport"), ("learner", "logprobs")}
    doc = ("## Engines (e)\n```python\nclass Engine:\n    def generate(self); def pause(self)\n    workers: int  # n\n```\n"
           "## Learner\n```python\n    def logprobs(self)\n```\ntext mentioning warp\n")
    assert declared_names(doc) == {"Engines": {"generate", "pause", "workers"}, "Learner": {"logprobs"}}
    assert undeclared(used, declared_names(doc)) == [
        "engine.teleport (x.py:4) is not declared in docs/CONTRACTS.md ## Engines",
        "learner.warp (x.py:3) is not declared in docs/CONTRACTS.md ## Learner"]


def _class_block_names(doc: str, class_name: str) -> set[str]:
    """The names declared in the ```python block lines under `class <class_name>` (up to the next class / block end)."""
    block = re.search(rf"^class {class_name}\b.*?\n(.*?)(?=^class |^```)", doc, flags=re.S | re.M)
    assert block, f"docs/CONTRACTS.md declares no class {class_name}"
    names = set()
    for line in block.group(1).splitlines():
        for piece in line.split("#")[0].split(";"):
            m = re.match(r"\s*(?:def\s+(\w+)\s*\(|(\w+)\s*:)", piece)
            if m:
                names.add(m.group(1) or m.group(2))
    return names


def test_reference_protocol_matches_the_contract_and_both_references():
    """The Reference protocol the trainer types its π_ref with declares exactly the members CONTRACTS lists under
    `class Reference`, and MegatronReference and PlainReference each have every one of them."""
    from megapo.learner.reference import MegatronReference, PlainReference, Reference

    protocol = set(Reference.__annotations__) | {n for n, v in vars(Reference).items()
                                                 if callable(v) and not n.startswith("_")}
    assert protocol == {"collective", "response_logprobs", "close"}
    assert _class_block_names(CONTRACTS.read_text(), "Reference") == protocol
    for impl in (MegatronReference, PlainReference):
        assert all(hasattr(impl, name) for name in protocol), impl.__name__
    # what the trainer reads off a reference is the protocol's and nothing else
    used = {}
    for path in trainer_sources():
        used.update(used_names(path.read_text(), str(path.relative_to(ROOT))))
    assert {name for receiver, name in used if receiver == "reference"} <= protocol


def test_learner_protocol_matches_the_contract_and_the_megatron_learner():
    """The Learner / OnPolicyLearner protocols the trainer types its learners with declare what CONTRACTS lists
    under `class Learner` (besides the Megatron learner's constructor), the Megatron learner has every method of
    both, and what the trainer reads off a learner is the protocols' and nothing else."""
    from megapo.learner.protocol import Learner, OnPolicyLearner

    def members(proto) -> set[str]:
        return set(getattr(proto, "__annotations__", {})) | {n for n, v in vars(proto).items()
                                                              if callable(v) and not n.startswith("_")}

    protocol = members(Learner) | members(OnPolicyLearner)
    assert _class_block_names(CONTRACTS.read_text(), "Learner") - {"__init__", "precision"} == protocol
    source = (ROOT / "megapo" / "learner" / "learner.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Learner")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert {n for n, v in vars(Learner).items() if callable(v) and not n.startswith("_")} <= methods
    assert "train_step_on_policy" in methods
    used = {}
    for path in trainer_sources():
        used.update(used_names(path.read_text(), str(path.relative_to(ROOT))))
    assert {name for receiver, name in used if receiver == "learner"} <= protocol
