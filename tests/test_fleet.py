"""The elastic fleet's membership logic (megapo.engines.router, megapo.trainer.fleet) over in-process fake servers:
joining servers take no request before they hold the current weights, a server that dies or stalls during a
weight update is dropped and the update completes for the others within the timeout, the servers file adds and
removes servers, the sync reports the fleet metrics, and the config names the fields it refuses.
(tests/test_vllm_server.py's fleet test does the same with real vLLM servers and a broadcast sync.)"""

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megapo.engines.base import Sample, SamplingParams
from megapo.engines.http import ConnectionLost, HTTPError
from megapo.engines.router import DROPPED, JOINING, SERVING, NoLiveEngine, Router
from megapo.trainer.fleet import Fleet, read_servers_file, sync_in_time


class FakeServer:
    """Answers like a server holding weight version `version`: each sample's one token is that version, so a
    sample shows which weights made it. dead: every call loses its connection; stall: weight loads block (and
    health checks fail) until released."""

    workers = 1

    def __init__(self, name):
        self.name, self.version, self.dead, self.requests, self.loads = name, 0, False, 0, []
        self.stall = threading.Event()
        self.stall.set()
        self.closed = False
        self.refuse = None

    def _check(self):
        if self.dead:
            raise ConnectionLost(f"{self.name}: connection refused")

    def generate(self, prompts, params):
        self._check()
        self.requests += 1
        time.sleep(0.02)  # requests overlap, so the router spreads them over the servers
        return [[Sample(prompt_ids=list(p), output_ids=[self.version], logprobs=[0.0], finish_reason="length",
                        weight_version=self.version) for _ in range(params.n)] for p in prompts]

    def update_weights_from_disk(self, path, version):
        self._check()
        self.stall.wait()
        if self.refuse:
            raise self.refuse
        self.loads.append((path, version))
        self.version = version

    def update_weights(self, named, version):
        self.update_weights_from_disk("<tensors>", version)

    def pause(self):
        self._check()

    def resume(self):
        self._check()

    def health(self):
        return not self.dead and self.stall.is_set()

    def close(self):
        self.closed = True


def versions_served(out):
    return sorted({s.output_ids[0] for g in out for s in g})


PROMPTS = [[i, i + 1] for i in range(16)]
PARAMS = SamplingParams(n=2, max_new_tokens=1, seed=0)


def test_a_joining_server_serves_only_once_it_holds_the_current_weights():
    a, b, c = FakeServer("a"), FakeServer("b"), FakeServer("c")
    router = Router([a, b], names=["a:1", "b:1"], max_in_flight_per_engine=2)
    router.update_weights_from_disk("/w/v1", 1)  # the fleet moves to version 1 ...
    k = router.add_server(c, "c:1")  # ... and c joins holding the model's version 0
    assert router.state == [SERVING, SERVING, JOINING] and router.versions[k] == -1 and router.joined == 1
    out = router.generate(PROMPTS, PARAMS)
    assert c.requests == 0 and versions_served(out) == [1]  # nothing from c's old weights
    router.update_weights_from_disk("/w/v2", 2)
    assert c.loads == [("/w/v2", 2)] and router.state == [SERVING] * 3 and router.versions == [2, 2, 2]
    out = router.generate(PROMPTS, PARAMS)
    assert c.requests > 0 and versions_served(out) == [2]
    assert router.serving() == [0, 1, 2] and router.workers == 3
    router.close()


def test_a_server_that_dies_during_an_update_is_dropped_and_the_update_stands_for_the_others(caplog):
    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a, b], names=["a:1", "b:1"])
    b.dead = True
    with caplog.at_level(logging.WARNING, logger="megapo.engines.router"):
        router.update_weights_from_disk("/w/v1", 1)
    assert router.weight_version == 1 and a.version == 1 and router.versions[0] == 1
    assert router.state == [SERVING, DROPPED] and router.dropped == 1 and b.closed
    assert any("dropped b:1" in r.getMessage() and "ConnectionLost" in r.getMessage() for r in caplog.records)
    b.dead = False  # back up, but it missed version 1: never used again unless it joins anew
    out = router.generate(PROMPTS, PARAMS)
    assert b.requests == 0 and versions_served(out) == [1] and router.members() == [0]
    # it may join again under its address; it serves after the next update
    router.add_server(b, "b:1")
    router.update_weights_from_disk("/w/v2", 2)
    router.generate(PROMPTS, PARAMS)
    assert b.requests > 0 and router.serving() == [0, 2]
    router.close()


def test_a_stalled_server_is_dropped_within_the_timeout():
    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a, b], sync_timeout_s=1.0)
    b.stall.clear()  # b's reload never returns, and b no longer answers its health check
    start = time.monotonic()
    router.update_weights_from_disk("/w/v1", 1)
    took = time.monotonic() - start
    assert 1.0 <= took < 2.5, took
    assert router.state == [SERVING, DROPPED] and router.serving() == [0]
    # the trainer's deadline shortens the wait further
    c = FakeServer("c")
    router.add_server(c, "c:1")
    c.stall.clear()
    router.deadline = time.monotonic() + 0.3
    start = time.monotonic()
    router.update_weights_from_disk("/w/v2", 2)
    assert time.monotonic() - start < 1.0 and router.state[2] == DROPPED
    b.stall.set()
    c.stall.set()
    router.close()


def test_a_live_server_that_refuses_an_update_is_an_error_and_losing_every_server_too():
    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a, b])
    b.refuse = HTTPError("http://b/collective_rpc", 500, "weights do not fit")
    with pytest.raises(HTTPError, match="weights do not fit"):
        router.update_weights_from_disk("/w/v1", 1)
    assert router.state == [SERVING, SERVING]  # a real error, not a dead server: nothing dropped
    b.refuse = None
    a.dead = b.dead = True
    with pytest.raises(NoLiveEngine):
        router.update_weights_from_disk("/w/v2", 2)
    with pytest.raises(ValueError, match="sync_timeout_s"):
        Router([a], sync_timeout_s=0)
    with pytest.raises(ValueError, match="names"):
        Router([a], names=["x", "y"])


def test_servers_file_adds_and_removes_servers(tmp_path, caplog):
    path = tmp_path / "servers.txt"
    fakes = {"a:1": FakeServer("a"), "b:1": FakeServer("b"), "c:1": FakeServer("c")}
    up = {"a:1", "b:1"}

    def make_client(address):
        if address not in up:
            raise ConnectionError(f"{address} does not answer its health check")
        return fakes[address]

    router = Router([fakes["a:1"]], names=["a:1"])
    path.write_text("# fleet\n\nb:1  # the second\nc:1\n")
    assert read_servers_file(path) == ["b:1", "c:1"]
    fleet = Fleet(router, ["a:1"], str(path), make_client)
    with caplog.at_level(logging.WARNING):
        fleet.refresh()
    assert router.names == ["a:1", "b:1"] and router.state == [SERVING, JOINING]  # c is not up yet
    assert any("c:1 not added" in r.getMessage() for r in caplog.records)
    up.add("c:1")
    fleet.refresh()  # tried again at every sync
    assert router.names == ["a:1", "b:1", "c:1"]
    path.write_text("c:1\n")  # b retired; a stays (rollout.servers)
    fleet.refresh()
    assert router.state == [SERVING, DROPPED, JOINING] and fakes["b:1"].closed
    path.write_text("c:1\nnot-an-address\n")  # a broken file leaves the fleet as it is
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fleet.refresh()
    assert router.members() == [0, 2]
    assert any("servers.txt:2: expected host:port" in r.getMessage() for r in caplog.records)


class StubLearner:
    def hf_state_dict(self):
        yield "w", torch.arange(4.0)


def test_sync_reports_the_fleet_and_drops_a_dead_server(tmp_path):
    from megapo.weights import DiskTransport

    path = tmp_path / "servers.txt"
    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a], names=["a:1"], sync_timeout_s=5)
    fleet = Fleet(router, [], str(path), lambda address: {"b:1": b}[address])
    from megapo.trainer.config import TrainConfig

    # (sync_in_time reads rollout's timeout and buckets, and train.precision: the dtype the weights travel in)
    cfg = SimpleNamespace(rollout=SimpleNamespace(sync_timeout_s=5.0, bucket_mb=1), train=TrainConfig())
    transport = DiskTransport(tmp_path / "sync")
    path.write_text("a:1\nb:1\n")
    m = sync_in_time(StubLearner(), router, 1, cfg, transport, fleet)
    assert m["fleet/servers"] == 2 and m["fleet/joined"] == 1 and m["fleet/dropped"] == 0
    assert b.loads == [(str(tmp_path / "sync" / "v1"), 1)] and a.version == b.version == 1
    a.dead = True
    m = sync_in_time(StubLearner(), router, 2, cfg, transport, fleet)
    assert m["fleet/servers"] == 1 and m["fleet/joined"] == 0 and m["fleet/dropped"] == 1
    assert b.version == 2 and router.deadline is None
    assert versions_served(router.generate(PROMPTS, PARAMS)) == [2]


def test_config_names_the_fleet_fields(tmp_path, tiny_moe):
    import sys

    from megapo.config import ConfigError

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_trainer_loop import run_config

    key = tmp_path / "key"
    key.write_text("k" * 43)
    key.chmod(0o600)
    base = {"model.path": str(tiny_moe), "rollout.engine": "vllm", "rollout.api_key_file": str(key),
            "rollout.weight_sync": "disk", "algorithm.routing_replay": "off", "data.task": "addition",
            "train.output_dir": str(tmp_path / "run")}

    def refused(**over):
        with pytest.raises(ConfigError) as err:
            run_config({**base, **over})
        return err.value

    missing = refused(**{"rollout.servers_file": str(tmp_path / "none.txt")})
    assert missing.field == "rollout.servers_file" and "cannot read" in str(missing)
    bad = tmp_path / "bad.txt"
    bad.write_text("127.0.0.1:8000\n127.0.0.1\n")
    err = refused(**{"rollout.servers_file": str(bad)})
    assert err.field == "rollout.servers_file" and "bad.txt:2" in str(err)
    empty = tmp_path / "empty.txt"
    empty.write_text("# none yet\n")
    assert refused(**{"rollout.servers_file": str(empty)}).field == "rollout.servers_file"
    good = tmp_path / "good.txt"
    good.write_text("127.0.0.1:8000\n")
    assert refused(**{"rollout.servers_file": str(good), "rollout.engine": "embedded",
                      "rollout.weight_sync": "tensor"}).field == "rollout.servers_file"
    assert refused(**{"rollout.servers_file": str(good), "rollout.sync_timeout_s": 0}).field == "rollout.sync_timeout_s"
    nokey = {k: v for k, v in base.items() if k != "rollout.api_key_file"}
    with pytest.raises(ConfigError) as e:
        run_config({**nokey, "rollout.servers_file": str(good)})
    assert e.value.field == "rollout.api_key_file"
    cfg = run_config({**base, "rollout.servers_file": str(good), "rollout.sync_timeout_s": 30})
    assert cfg.rollout.sync_timeout_s == 30 and cfg.rollout.servers == []


def test_a_broadcast_sync_that_keeps_failing_ends_within_the_timeout_naming_it(monkeypatch):
    from megapo.trainer import fleet as fleet_mod
    from megapo.weights.broadcast import BroadcastTransport, SyncFailed

    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a, b], names=["a:1", "b:1"])
    fleet = Fleet(router, ["a:1", "b:1"], "", lambda address: None)
    formed = []

    def form_groups(cfg, learner, engine, transport):
        formed.append(tuple(router.members()))
        transport.formed_for, transport.broken = tuple(router.members()), False
        return True

    class FailingTransport(BroadcastTransport):
        def send(self, named, engines, bucket_bytes, version, dtype):
            for _ in named:
                pass
            time.sleep(0.3)
            b.dead = True  # b dies in the first attempt: dropped, the next attempt goes to a alone
            raise SyncFailed(f"broadcast of weight version {version} failed: a peer stalled")

    class Learner:
        def stage_tensors(self):
            yield "w", torch.zeros(2)

    monkeypatch.setattr(fleet_mod, "form_groups", form_groups)
    cfg = SimpleNamespace(rollout=SimpleNamespace(sync_timeout_s=3.5, bucket_mb=1))  # group timeout 1.17 s
    start = time.monotonic()
    with pytest.raises(fleet_mod.SyncTimeout, match=r"rollout.sync_timeout_s=3.5 s .*a peer stalled"):
        sync_in_time(Learner(), router, 1, cfg, FailingTransport(None), fleet)
    took = time.monotonic() - start
    assert took < 3.5, took
    assert formed[0] == (0, 1) and formed[1] == (0,)  # b dropped after the first failure, the group formed again
    assert len(formed) >= 2 and router.state == [SERVING, DROPPED] and router.deadline is None
