"""Layering of megapo's source, read statically with `ast` (nothing here imports the modules it checks).

Two import graphs: one whose nodes are megapo's packages (megapo.trainer, megapo.weights, ...) and its
top-level modules (megapo.config, megapo.cli, ...), and one whose nodes are every module (megapo.trainer.config,
megapo.trainer.data, ...), which sees a circle inside a package too. Their edges are every import statement in a file: module-level
ones and the ones inside functions alike (megapo imports heavy modules lazily, and a lazy import is still a
dependency), `from megapo import compat` counting as an import of megapo.compat. megapo/cli.py names its
command modules as strings (imported with importlib); test_cli_commands_live_in_commands checks those.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megapo

PACKAGE_DIR = Path(megapo.__file__).resolve().parent
ROOT = PACKAGE_DIR.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The graph node a module belongs to: megapo.trainer.loop -> megapo.trainer, megapo.config -> itself."""
    return ".".join(module.split(".")[:2])


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, at any depth."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from megapo import compat` imports the module megapo.compat, not the package megapo
            subs = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
            found += [(name, node.lineno) for name in (subs or [base])]
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def import_graph(unit=_unit) -> dict[str, dict[str, str]]:
    """node -> {imported node: 'path:line' of the first import that makes the edge}, megapo nodes only; `unit`
    maps a module to its node (the package by default)."""
    graph: dict[str, dict[str, str]] = {}
    for path in _sources():
        src = unit(_module_name(path))
        edges = graph.setdefault(src, {})
        for name, line in _imports(path):
            dst = unit(name)
            if name.split(".")[0] == "megapo" and dst != src and dst != "megapo":
                edges.setdefault(dst, f"{path.relative_to(ROOT)}:{line}")
    return graph


def _owning_module(name: str) -> str:
    """The module an imported name lives in: `from megapo.x.y import Name` is read as megapo.x.y already, but
    `import megapo.x.y.Name`-like names (never in practice) fall back to the longest prefix that is a module."""
    parts = name.split(".")
    while len(parts) > 1 and not _is_module(".".join(parts)):
        parts.pop()
    return ".".join(parts)


def module_graph() -> dict[str, dict[str, str]]:
    """The import graph between megapo's modules (a package's __init__ is the package's own node)."""
    return import_graph(unit=_owning_module)


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan), so a report names them all."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            components.append(component + [node])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for component in components:
        if len(component) > 1:
            inside = {n: {d: w for d, w in graph.get(n, {}).items() if d in component} for n in component}
            found.append(find_cycle(inside))
    return sorted(found)


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph, or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def describe(cycle: list[str], graph) -> str:
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycles_between_packages():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {describe(cycle, graph)}"


# Cycles known and owed, each with why it is still here; the test below fails when one is gone (remove it then).
KNOWN_CYCLES: set[tuple[str, ...]] = set()  # none: a cycle found later is listed here only with its reason


def test_no_import_cycles_between_modules():
    """Inside a package too: a circle closed by an import inside a function is still a circle (the two modules
    cannot be understood, tested or moved apart)."""
    graph = module_graph()
    found = [c for c in cycles(graph) if tuple(sorted(set(c))) not in KNOWN_CYCLES]
    assert not found, f"{len(found)} import cycle(s) between modules:\n" + "\n".join(describe(c, graph) for c in found)
    gone = KNOWN_CYCLES - {tuple(sorted(set(c))) for c in cycles(graph)}
    assert not gone, f"KNOWN_CYCLES lists cycles that are gone (remove them): {sorted(gone)}"


def test_module_graph_sees_modules_inside_a_package():
    graph = module_graph()
    assert "megapo.trainer.loop" in graph and "megapo.trainer.run" in graph
    assert any(dst.startswith("megapo.trainer.") for dst in graph["megapo.trainer.run"])  # an edge inside trainer
    two = {"p.a": {"p.b": "a.py:1"}, "p.b": {"p.a": "b.py:2", "p.c": "b.py:3"}, "p.c": {"p.d": "c.py:1"},
           "p.d": {"p.c": "d.py:1"}, "p.e": {"p.a": "e.py:1"}}
    assert cycles(two) == [["p.a", "p.b", "p.a"], ["p.c", "p.d", "p.c"]]
    assert cycles({"a": {"b": ""}, "b": {}}) == []


CONFIG_SECTIONS = ("megapo/algorithms/config.py", "megapo/engines/config.py", "megapo/envs/config.py",
                   "megapo/models/config.py")


def test_config_sections_do_not_import_the_trainer():
    """A section lives with its package and imports nothing from megapo.trainer (RunConfig imports the sections)."""
    bad = [f"{name}:{line} imports {mod}" for name in CONFIG_SECTIONS for mod, line in _imports(ROOT / name)
           if mod.startswith("megapo.trainer")]
    assert not bad, "; ".join(bad)


def test_engine_setup_asks_capabilities_not_names():
    """Engine setup and the rollout section branch on EngineCapabilities, never on an engine's name."""
    from megapo.engines.registry import engine_names

    for name in ("megapo/trainer/engine_setup.py", "megapo/engines/config.py"):
        tree = ast.parse((ROOT / name).read_text())
        compared = [f"{name}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Compare)
                    for c in [node.left, *node.comparators] if isinstance(c, ast.Constant) and c.value in engine_names()]
        assert not compared, f"compares with an engine name: {compared}"


def test_cycle_finder_names_a_cycle():
    # a hand-written graph with the cycle weights -> learner -> weights, beside an acyclic branch
    graph = {"a.trainer": {"a.learner": "t.py:1"}, "a.learner": {"a.weights": "l.py:2"},
             "a.weights": {"a.learner": "w.py:3", "a.models": "w.py:4"}, "a.models": {}}
    assert find_cycle(graph) == ["a.learner", "a.weights", "a.learner"]
    assert describe(find_cycle(graph), graph) == "a.learner (l.py:2) -> a.weights (w.py:3) -> a.learner"
    assert find_cycle({"a": {"b": ""}, "b": {}, "c": {"a": ""}}) is None


def test_graph_counts_function_level_imports():
    # megapo/trainer/run.py imports the learner only inside build_learner (a lazy import): still an edge
    source = (PACKAGE_DIR / "trainer" / "run.py").read_text()
    lazy = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)
            for i in ast.walk(n) if isinstance(i, ast.ImportFrom) and (i.module or "").startswith("megapo.learner")]
    assert lazy, "run.py no longer imports megapo.learner inside a function: pick another lazy import here"
    assert "megapo.learner" in import_graph()["megapo.trainer"]


def test_library_imports_no_command_code():
    """Only megapo.cli and the commands themselves import megapo.commands; no megapo module imports the
    checkout's top-level packages (tools/, benchmarks)."""
    graph = import_graph()
    users = {src: edges["megapo.commands"] for src, edges in graph.items()
             if "megapo.commands" in edges and src not in ("megapo.cli", "megapo.commands")}
    assert not users, f"library code imports command code: {users}"
    outside = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in _sources()
               for name, line in _imports(path) if name.split(".")[0] in ("tools", "launch", "tests")]
    assert not outside, "megapo imports a package outside megapo: " + "; ".join(outside)


def test_cli_commands_live_in_commands():
    from megapo.cli import COMMANDS

    elsewhere = {name: module for name, (module, _) in COMMANDS.items() if not module.startswith("megapo.commands.")}
    assert not elsewhere, f"megapo/cli.py dispatches outside megapo/commands/: {elsewhere}"
    missing = [module for module, _ in COMMANDS.values() if not _is_module(module)]
    assert not missing, f"megapo/cli.py names modules that do not exist: {missing}"


# A public name defined at module level in more than one megapo module must do the same job in each: these
# are protocols, one implementation per module, each listed with the modules allowed to define it.
SHARED_NAMES = {
    "add_arguments": (("megapo.commands.",), "a command module's parser (the protocol of megapo/cli.py)"),
    "run": (("megapo.commands.",), "a command module's body (the protocol of megapo/cli.py)"),
    "main": (("megapo.cli", "megapo.commands.", "megapo.convert.worker"), "a process's entry point (python -m)"),
    "spec": (("megapo.models.",), "a family's Megatron spec (one mapping.py per family)"),
    "Learner": (("megapo.learner.protocol", "megapo.learner.learner"),
                "the trainer's learner: the protocol it types learners with, and the Megatron implementation"),
    "config": (("megapo.models.",), "a family's tiny-model config.json fields (its tiny.py; megapo/models/tiny.py)"),
    "finish": (("megapo.models.",), "a family's tiny-model weights after init (its tiny.py; megapo/models/tiny.py)"),
    "task": (("megapo.tasks.",), "a built-in task's constructor (megapo/tasks/registry.py)"),
    "example": (("megapo.tasks.",), "a task's i-th example of a split"),
    "examples": (("megapo.tasks.",), "a task's examples of a split"),
    "split_of": (("megapo.tasks.",), "a task's split of a prompt"),
    "reward": (("megapo.tasks.",), "a task's own reward"),
    "decode_routed_experts": (("megapo.engines.vllm", "megapo.engines.sglang"),
                              "an engine client decoding its server's routed-experts payload (each its own wire format)"),
}


def definitions() -> dict[str, list[str]]:
    """Public (no leading underscore) module-level class and function name -> the modules defining it."""
    found: dict[str, list[str]] = {}
    for path in _sources():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name[0] != "_":
                found.setdefault(node.name, []).append(_module_name(path))
    return found


def collisions(found: dict[str, list[str]], allowed: dict) -> dict[str, list[str]]:
    """The names defined in more than one module that the allow-list does not cover (every module of a
    shared name must start with one of its prefixes)."""
    return {name: modules for name, modules in found.items() if len(modules) > 1 and not (
        name in allowed and all(m.startswith(allowed[name][0]) for m in modules))}


def test_no_two_public_names_in_different_modules():
    bad = collisions(definitions(), SHARED_NAMES)
    assert not bad, "one public name, several modules (rename, or add a protocol to SHARED_NAMES): " + "; ".join(
        f"{name}: {', '.join(modules)}" for name, modules in sorted(bad.items()))


def test_collision_check_sees_a_collision():
    found = {"ModelSpec": ["megapo.models.family", "megapo.engines.torch_lm"], "run": ["megapo.commands.a",
             "megapo.commands.b"], "spec": ["megapo.models.qwen2.mapping", "megapo.trainer.loop"], "solo": ["megapo.x"]}
    assert collisions(found, SHARED_NAMES) == {"ModelSpec": found["ModelSpec"], "spec": found["spec"]}
    assert definitions()["ModelSpec"] == ["megapo.models.family"]  # the reader sees the real definitions


def test_shared_names_are_still_shared():
    """An allow-list entry whose name is no longer defined twice is stale: remove it."""
    found = definitions()
    stale = [name for name in SHARED_NAMES if len(found.get(name, [])) < 2]
    assert not stale, f"SHARED_NAMES lists names defined once or not at all: {stale}"


def test_one_module_touches_the_safetensors_library():
    """Every safetensors file megapo writes or reads goes through megapo/weights/safetensors_io.py."""
    users = [f"{path.relative_to(ROOT)}:{line}" for path in _sources() if path.name != "safetensors_io.py"
             for name, line in _imports(path) if name.split(".")[0] == "safetensors"]
    assert not users, "safetensors imported outside megapo/weights/safetensors_io.py: " + ", ".join(users)
