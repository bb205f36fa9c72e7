"""SGLangEngine against a small fake SGLang server that follows SGLang's documented request/response formats.

SGLang cannot run on CPU. The fake answers /generate from megapo's embedded engine (so tokens, log-probs and
routes are real model outputs) and encodes them the way SGLang does: meta_info.output_token_logprobs as
[logprob, token_id, text] triples, meta_info.finish_reason.type, meta_info.weight_version, and
meta_info.routed_experts as base64 of a flat int array (dtype in meta_info.routed_experts_dtype, int32 if absent).
"""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from megapo.engines.base import SamplingParams
from megapo.engines.embedded import EmbeddedEngine
from megapo.engines.sglang import SGLangEngine
from megapo.weights.safetensors_io import iter_folder

PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]


class FakeSGLang:
    def __init__(self, model_dir, routes_dtype=None):
        self.backend = EmbeddedEngine(model_dir)
        self.routes_dtype = routes_dtype
        self.calls: list[tuple[str, dict]] = []
        self.version = "0"
        self.paused = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, obj, text=False):
                data = obj.encode() if text else json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append((self.path, {}))
                self._send({"status": "ok"} if self.path == "/health" else {})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                fake.calls.append((self.path, body))
                handler = {"/generate": fake.generate, "/update_weights_from_disk": fake.from_disk,
                           "/flush_cache": lambda b: "Cache flushed.",
                           "/pause_generation": lambda b: setattr(fake, "paused", True) or {},
                           "/continue_generation": lambda b: setattr(fake, "paused", False) or {},
                           "/init_weights_update_group": lambda b: {"success": True, "message": "ok"},
                           "/update_weights_from_distributed": fake.from_distributed}[self.path]
                answer = handler(body)
                self._send(answer, text=isinstance(answer, str))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, body):
        sp = body["sampling_params"]
        assert body["return_logprob"] is True and isinstance(body["input_ids"][0], int)
        params = SamplingParams(n=sp["n"], temperature=sp["temperature"], top_p=sp["top_p"],
                                max_new_tokens=sp["max_new_tokens"], stop_token_ids=tuple(sp["stop_token_ids"]),
                                seed=sp.get("sampling_seed"), return_routes=body.get("return_routed_experts", False))
        outs = []
        for s in self.backend.generate([body["input_ids"]], params)[0]:
            meta = {"id": "r", "finish_reason": {"type": s.finish_reason}, "weight_version": self.version,
                    "prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.output_ids),
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.logprobs, s.output_ids)]}
            if s.routes is not None:
                flat = s.routes.reshape(-1)
                if self.routes_dtype:
                    flat = flat.astype(self.routes_dtype)
                    meta["routed_experts_dtype"] = self.routes_dtype
                else:
                    flat = flat.astype(np.int32)
                meta["routed_experts"] = base64.b64encode(flat.tobytes()).decode()
            outs.append({"text": "", "output_ids": s.output_ids, "meta_info": meta})
        return outs[0] if len(outs) == 1 else outs

    def from_disk(self, body):
        self.backend.update_weights_from_disk(body["model_path"], int(body["weight_version"]))
        self.version = body["weight_version"]
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    def from_distributed(self, body):
        self.version = body["weight_version"]
        return {"success": True, "message": "ok"}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake(tiny_moe):
    f = FakeSGLang(tiny_moe)
    yield f
    f.close()


def test_generate_decodes_sglang_format(fake, tiny_moe):
    engine = SGLangEngine(fake.url, config_dir=str(tiny_moe))
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=6, seed=5, return_routes=True)
    out = engine.generate(PROMPTS, params)
    # reference: the same model run directly, with the seed SGLangEngine gives prompt i (seed + i*n)
    ref_engine = EmbeddedEngine(tiny_moe)
    for i, (prompt, group) in enumerate(zip(PROMPTS, out)):
        ref = ref_engine.generate([prompt], SamplingParams(n=3, temperature=0.8, max_new_tokens=6, seed=5 + 3 * i,
                                                           return_routes=True))[0]
        assert len(group) == 3
        for s, r in zip(group, ref):
            assert s.output_ids == r.output_ids and s.logprobs == r.logprobs
            assert s.finish_reason == "length" and s.weight_version == 0
            assert s.routes.shape == (len(prompt) + 6 - 1, 2, 2) and np.array_equal(s.routes, r.routes)
    # the request SGLang received
    path, body = next(c for c in fake.calls if c[0] == "/generate")
    sp = body["sampling_params"]
    assert sp["ignore_eos"] is True and sp["max_new_tokens"] == 6 and sp["n"] == 3 and "sampling_seed" in sp
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0


def test_routes_with_narrow_wire_dtype_and_stop(tiny_moe):
    f = FakeSGLang(tiny_moe, routes_dtype="uint8")
    try:
        engine = SGLangEngine(f.url, moe_shape=(2, 2))
        [[free]] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, seed=1, return_routes=True))
        stop = free.output_ids[2]
        [[s]] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, seed=1, return_routes=True,
                                                              stop_token_ids=(stop,)))
        cut = free.output_ids.index(stop) + 1
        assert s.output_ids == free.output_ids[:cut] and s.finish_reason == "stop"
        assert np.array_equal(s.routes, free.routes[:len(PROMPTS[0]) + cut - 1])
    finally:
        f.close()


def test_weight_updates_pause_flush(fake, tiny_moe, tiny_model_factory):
    other = tiny_model_factory("qwen3_moe", seed=1)
    engine = SGLangEngine(fake.url, config_dir=str(tiny_moe))
    before = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0))
    engine.update_weights_from_disk(str(other), version=4)
    after = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0))
    assert engine.weight_version == 4 and all(g[0].weight_version == 4 for g in after)
    assert [g[0].output_ids for g in after] != [g[0].output_ids for g in before]
    body = dict(fake.calls)["/update_weights_from_disk"]
    assert body["weight_version"] == "4" and body["flush_cache"] is True and body["model_path"].endswith(other.name)
    # tensors staged as safetensors, loaded from disk: back to the first model
    engine.update_weights(iter_folder(tiny_moe), version=5)
    again = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0))
    assert [g[0].output_ids for g in again] == [g[0].output_ids for g in before]

    engine.pause()
    assert fake.paused and dict(fake.calls)["/pause_generation"] == {"mode": "retract"}
    engine.resume()
    assert not fake.paused
    engine.flush_cache()  # plain-text answer
    assert engine.health()

    # NCCL path: metadata over HTTP, tensors through the caller's broadcast
    sent = []
    engine.init_weights_update_group("127.0.0.1", 29500, rank_offset=1, world_size=2)
    tensors = [("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.zeros(512, 64, dtype=torch.bfloat16))]
    engine.update_weights_from_distributed(tensors, version=6, broadcast=sent.append)
    assert len(sent) == 2 and engine.weight_version == 6
    init = dict(fake.calls)["/init_weights_update_group"]
    assert init == {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
                    "group_name": "weight_update_group", "backend": "nccl"}
    dist = dict(fake.calls)["/update_weights_from_distributed"]
    assert dist["names"] == ["model.norm.weight", "lm_head.weight"]
    assert dist["dtypes"] == ["float32", "bfloat16"] and dist["shapes"] == [[64], [512, 64]]


def test_bad_arguments(tiny_moe):
    with pytest.raises(ValueError, match="pause_mode"):
        SGLangEngine("http://127.0.0.1:1", pause_mode="wait")
    with pytest.raises(ValueError, match="url"):
        SGLangEngine("127.0.0.1:1")
    engine = SGLangEngine("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="config_dir"):
        engine.update_weights([("model.norm.weight", torch.ones(64))], 1)
    assert not engine.health()
