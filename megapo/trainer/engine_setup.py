"""The rollout engine of a run, built from its config (`rollout.engine`, `rollout.servers`), by what the engine's
capabilities say (megapo.engines.registry), never by its name:

- in_process (embedded): the engine class on the trainer's rank 0, computing in rollout.dtype (auto: float32).
- servers (`rollout.servers`, host:port, e.g. from the Slurm template, and/or `rollout.servers_file`, the elastic
  fleet, megapo.trainer.fleet): one client per server (with the run's key where the capabilities say api_key),
  behind a Router when there are several or a servers file.
- starts_server (vllm) and no servers: megapo starts its own vLLM server from <repo>/.venv-vllm on
  `rollout.host` (megapo.engines.server), and the engine stops it on close(). An engine that does neither
  (sglang: its wheel is CUDA-only) needs servers; RunConfig.validate says so.

Weights reach the servers through megapo.weights with `rollout.weight_sync`: `disk` (the servers must see the
trainer's output folder, i.e. the same machine or a shared filesystem) or, for vLLM, `broadcast` (the servers'
workers join the learner's weight-sync group at `rollout.sync_host`, see megapo.trainer.run.broadcast_transport).
"""

from __future__ import annotations

from pathlib import Path

from megapo.engines.registry import capabilities, engine_class
from megapo.trainer.config import RunConfig


def server_max_model_len(cfg: RunConfig) -> int:
    """Context length a started server needs: the longest prompt plus the longest response."""
    return max(64, cfg.data.max_prompt_tokens + cfg.response_tokens())


def _client(cfg: RunConfig, model_dir: Path, server: str):
    """A client of the server at host:port, with the run's key where the engine's servers take one."""
    from megapo.engines.auth import read_key_file

    extra = {}
    if capabilities(cfg.rollout.engine).api_key:
        extra["api_key"] = read_key_file(cfg.rollout.api_key_file, "rollout.api_key_file")
    return engine_class(cfg.rollout.engine)(f"http://{server}", config_dir=str(model_dir), **extra)


def checked_client(cfg: RunConfig, model_dir: Path, server: str):
    """A client of the server at host:port that answers its health check (and, where the servers take a key,
    takes the run's)."""
    client = _client(cfg, model_dir, server)
    try:
        if not client.health():
            raise ConnectionError(f"{server} does not answer its health check")
        if capabilities(cfg.rollout.engine).api_key:
            client.check_access("rollout.api_key_file")
    except BaseException:
        client.close()
        raise
    return client


def engine_from_config(cfg: RunConfig, model_dir: Path, out_dir: Path):
    """The engine (rank 0 only). The caller closes it at the end of the run. RunConfig.validate has checked that
    an engine that is neither in-process nor started by megapo has servers."""
    if capabilities(cfg.rollout.engine).in_process:
        return _in_process_engine(cfg, model_dir)
    if cfg.rollout.has_servers():
        return _server_clients(cfg, model_dir)
    return _started_server_engine(cfg, model_dir, out_dir)


def _in_process_engine(cfg: RunConfig, model_dir: Path):
    import torch

    dtype = getattr(torch, cfg.rollout.compute_dtype(cfg.train.precision))
    return engine_class(cfg.rollout.engine)(model_dir, seed=cfg.train.seed, dtype=dtype,
                                            router_noise=cfg.rollout.router_noise)


def _server_clients(cfg: RunConfig, model_dir: Path):
    """One checked client per server of rollout.servers / servers_file; a Router over several, or over a fleet."""
    from megapo.engines.router import Router

    servers = cfg.rollout.run_servers()
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


def _started_server_engine(cfg: RunConfig, model_dir: Path, out_dir: Path):
    """A server megapo starts itself (an engine whose capabilities say starts_server: megapo.engines.server),
    and a client of it that stops it on close()."""
    from megapo.engines.server import VLLMServer, VLLMServerConfig

    # weights reach it from the run folder (disk sync) or the model folder
    dtype = cfg.rollout.compute_dtype(cfg.train.precision)
    server = VLLMServer(VLLMServerConfig(str(model_dir), host=cfg.rollout.host, dtype=dtype,
                                         max_model_len=server_max_model_len(cfg),
                                         log_path=str(out_dir / "vllm-server.log"),
                                         api_key_file=cfg.rollout.api_key_file or None,
                                         weights_dirs=[str(out_dir), str(model_dir)]))
    server.start()
    return engine_class(cfg.rollout.engine)(server.url, config_dir=str(model_dir), server=server)
