"""The rollout engine of a run, built from its config (`rollout.engine`, `rollout.servers`).

- embedded: megapo's in-process engine (megapo.engines.embedded) on the trainer's rank 0, computing in
            rollout.dtype (auto: float32).
- vllm:     with `rollout.servers` (host:port, e.g. from the Slurm template) and/or `rollout.servers_file` (the
            elastic fleet, megapo.trainer.fleet), one VLLMEngine client per server, behind a Router when there are
            several or a servers file; with no servers, megapo starts its own vLLM
            server from <repo>/.venv-vllm on `rollout.host` (megapo.engines.server), and the engine stops it
            on close().
- sglang:   clients of running SGLang servers (`rollout.servers` is required: the SGLang wheel is
            CUDA-only, megapo does not start it).

Weights reach the servers through megapo.weights with `rollout.weight_sync`: `disk` (the servers must see the
trainer's output folder, i.e. the same machine or a shared filesystem) or, for vLLM, `broadcast` (the servers'
workers join the learner's weight-sync group at `rollout.sync_host`, see megapo.trainer.run.broadcast_transport).
"""

from __future__ import annotations

from pathlib import Path

from megapo.config import ConfigError
from megapo.trainer.config import RunConfig


def server_max_model_len(cfg: RunConfig) -> int:
    """Context length a started server needs: the longest prompt plus the longest response."""
    return max(64, cfg.data.max_prompt_tokens + cfg.response_tokens())


def _client(cfg: RunConfig, model_dir: Path, server: str):
    if cfg.rollout.engine == "vllm":
        from megapo.engines.auth import read_key_file
        from megapo.engines.vllm import VLLMEngine

        key = read_key_file(cfg.rollout.api_key_file, "rollout.api_key_file")
        return VLLMEngine(f"http://{server}", config_dir=str(model_dir), api_key=key)
    from megapo.engines.sglang import SGLangEngine

    return SGLangEngine(f"http://{server}", config_dir=str(model_dir))


def checked_client(cfg: RunConfig, model_dir: Path, server: str):
    """A client of the server at host:port that answers its health check (and, for vLLM, takes the run's key)."""
    client = _client(cfg, model_dir, server)
    try:
        if not client.health():
            raise ConnectionError(f"{server} does not answer its health check")
        if cfg.rollout.engine == "vllm":
            client.check_access("rollout.api_key_file")
    except BaseException:
        client.close()
        raise
    return client


def run_servers(cfg: RunConfig) -> list[str]:
    """rollout.servers, then the lines of rollout.servers_file (the fleet at the start)."""
    from megapo.trainer.fleet import read_servers_file

    listed = read_servers_file(cfg.rollout.servers_file) if cfg.rollout.servers_file else []
    return list(dict.fromkeys(cfg.rollout.servers + listed))


def engine_from_config(cfg: RunConfig, model_dir: Path, out_dir: Path):
    """The engine (rank 0 only). The caller closes it at the end of the run."""
    kind = cfg.rollout.engine
    if kind == "embedded":
        import torch

        from megapo.engines.embedded import EmbeddedEngine

        dtype = getattr(torch, cfg.rollout.compute_dtype(cfg.train.precision))
        return EmbeddedEngine(model_dir, seed=cfg.train.seed, dtype=dtype, router_noise=cfg.rollout.router_noise)
    if cfg.rollout.servers or cfg.rollout.servers_file:
        from megapo.engines.router import Router

        if cfg.sft.enabled:  # the servers loaded model.path, not the warm-started copy the learner starts from
            raise ConfigError("sft.enabled", "rollout.servers serve model.path; run the warm start first and point "
                              "model.path at its output (or leave rollout.servers empty)")

        servers = run_servers(cfg)
        clients = []
        try:
            for server in servers:
                try:
                    clients.append(checked_client(cfg, model_dir, server))
                except ConnectionError as err:
                    raise ConnectionError(f"rollout.servers: {err}") from None
        except BaseException:
            for client in clients:
                client.close()
            raise
        if len(clients) == 1 and not cfg.rollout.servers_file:
            return clients[0]
        # a fleet (rollout.servers_file) is always a Router: servers join and leave it (megapo.trainer.fleet)
        return Router(clients, names=servers, sync_timeout_s=cfg.rollout.sync_timeout_s)
    if kind == "sglang":
        raise ConfigError("rollout.servers", "rollout.engine=sglang needs running servers (host:port); "
                          "megapo starts only vLLM servers itself")
    if kind == "vllm":
        from megapo.engines.server import VLLMServer, VLLMServerConfig
        from megapo.engines.vllm import VLLMEngine

        # weights reach it from the run folder (disk sync) or the model folder
        dtype = cfg.rollout.compute_dtype(cfg.train.precision)
        server = VLLMServer(VLLMServerConfig(str(model_dir), host=cfg.rollout.host, dtype=dtype,
                                             max_model_len=server_max_model_len(cfg),
                                             log_path=str(out_dir / "vllm-server.log"),
                                             api_key_file=cfg.rollout.api_key_file or None,
                                             weights_dirs=[str(out_dir), str(model_dir)]))
        server.start()
        return VLLMEngine(server.url, config_dir=str(model_dir), server=server)
    raise ConfigError("rollout.engine", f"unknown engine {kind!r}")
