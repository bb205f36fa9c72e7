"""The rollout engines `rollout.engine` names, and what each can do (its class's EngineCapabilities).

One table: a name and the class that implements it. The class is imported only when asked for, so reading
a config does not import an engine it does not use. Adding an engine = one line here and a class that declares
`capabilities`: megapo.trainer.engine_setup builds it by those (an in-process engine from the model folder, a
client from a server's host:port), never by its name.
"""

from __future__ import annotations

import importlib

from megapo.engines.base import Engine, EngineCapabilities

ENGINES = {  # rollout.engine -> "module:Class"
    "embedded": "megapo.engines.embedded:EmbeddedEngine",  # megapo's PyTorch model in the trainer's process
    "vllm": "megapo.engines.vllm:VLLMEngine",  # clients of vLLM servers (or one megapo starts)
    "sglang": "megapo.engines.sglang:SGLangEngine",  # clients of running SGLang servers
}


def engine_names() -> tuple[str, ...]:
    return tuple(ENGINES)


def engine_class(name: str) -> type[Engine]:
    """The class of engine `name`; ValueError naming the choices for an unknown one."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def capabilities(name: str) -> EngineCapabilities:
    """What engine `name` can do (its class declares it)."""
    return engine_class(name).capabilities


def needs_servers(name: str) -> bool:
    """Whether engine `name` runs only against rollout.servers: not in-process, and megapo starts none itself."""
    caps = capabilities(name)
    return not caps.in_process and not caps.starts_server
