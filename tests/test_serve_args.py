"""`megapo serve` and VLLMServer settings that reach the vLLM process: the dtype comes from --dtype, else the run
config's rollout.dtype, else bfloat16; --cpu-cores becomes vLLM's OpenMP binding. Checked on the command line
and environment the server would be started with (nothing is started here)."""

import argparse
import os

import pytest

from megapo.cli import run_command
from megapo.commands import serve
from megapo.engines.server import VLLMServer, VLLMServerConfig

CONFIG = "megapo/configs/tiny_moe_addition.yaml"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_intermixed_args(list(argv))


def _vllm_overrides(model) -> list[str]:
    return [f"model.path={model}", "rollout.engine=vllm", "algorithm.routing_replay=r2", "rollout.weight_sync=disk"]


@pytest.mark.parametrize("extra,expected", [([], "float32"), (["--dtype", "float16"], "float16")])
def test_dtype_from_the_run_config_unless_given(tiny_model_factory, extra, expected):
    model = tiny_model_factory()
    args = _args(CONFIG, *_vllm_overrides(model), "rollout.dtype=float32", *extra)
    served = serve._served(args)
    assert (served["model_dir"], served["dtype"]) == (str(model), expected)
    assert served["max_model_len"] > 0


def test_dtype_default_with_a_bare_model(tiny_model_factory):
    model = tiny_model_factory()
    assert serve._served(_args("--model", str(model)))["dtype"] == "bfloat16"


def test_bad_dtype_in_the_config_is_refused_naming_the_field(tiny_model_factory, capsys):
    model = tiny_model_factory()
    rc = run_command("serve", _args(CONFIG, *_vllm_overrides(model), "rollout.dtype=fp4"))
    assert rc == 2 and "rollout.dtype" in capsys.readouterr().err


def test_server_process_gets_dtype_and_core_binding(tiny_model_factory):
    model = tiny_model_factory()
    server = VLLMServer(VLLMServerConfig(str(model), dtype="float32", cpu_cores="1"))
    command = server.command()
    assert command[command.index("--dtype") + 1] == "float32"
    assert server.env()["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    unbound = VLLMServer(VLLMServerConfig(str(model))).env()
    assert unbound.get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # left to vLLM


def test_server_processes_may_write_bytecode(tiny_model_factory, monkeypatch):
    """A machine-wide PYTHONDONTWRITEBYTECODE would make each of a server's processes compile vLLM again."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = VLLMServer(VLLMServerConfig(str(tiny_model_factory()))).env()
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["HF_HUB_OFFLINE"] == "1"
