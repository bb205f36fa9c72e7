"""A remote reward model (data.reward_model.url; megapo/trainer/reward_model.py RemoteRewardModel, docs/CONTRACTS.md
"Remote reward model") against a stand-in scorer run here: http.server on 127.0.0.1 in a thread, scoring with
transformers' AutoModelForSequenceClassification on a tiny score folder, answering only the right key.

- The client's scores equal transformers' on the same folder; the server sees the protocol's body and the header.
- A tiny `megapo train` with data.reward_model.url logs reward/model = the mean of the scores the server returned
  for that step, and adds coef × them (reward/with_model).
- A scorer failing twice then answering costs retries, not scores; always 500: reward_errors=fail raises naming the
  url and the status (and `megapo train` stops, exit 1, naming them), zero scores 0 and counts them; a malformed
  reply (count, non-number, NaN) names the url.
- A wrong key: one request (no retry), an error naming data.reward_model.api_key_file, whatever reward_errors says.
- Config refusals before anything is made: path and url both, a url without http(s)://, a missing key file.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from train_runs import CONFIG, ROOT, train_rows

KEY = "k" * 24
ZERO = "def zero(response, answer):\n    return 0.0\n"
SEQUENCES = [[1, 5, 9, 2], [3, 3], [7, 8, 9, 10, 11, 12], [4]]
PROMPT_LENGTHS = [2, 1, 3, 1]


@pytest.fixture(scope="module")
def tiny_rm(tiny_model_factory):
    return tiny_model_factory("qwen3_moe", head="score")


@pytest.fixture(scope="module")
def hf_rm(tiny_rm):
    import torch
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(tiny_rm, torch_dtype=torch.float32).eval()


def hf_scores(model, sequences) -> list[float]:
    """transformers' score of each sequence alone (no padding), fp32."""
    import torch

    with torch.no_grad():
        return [float(model(torch.tensor([s])).logits[0, 0]) for s in sequences]


class Scorer:
    """The stand-in scorer's behaviour and what it saw: `fail_first` requests answered 500, then `status` (200:
    scores) or `reply` as the body; every request and every scores list recorded."""

    def __init__(self, model):
        self.model, self.fail_first, self.status, self.reply = model, 0, 200, None
        self.requests: list[dict] = []
        self.headers: list[str | None] = []
        self.answered: list[list[float]] = []
        self.lock = threading.Lock()

    def answer(self, auth: str | None, body: dict) -> tuple[int, object]:
        with self.lock:
            self.headers.append(auth)
            self.requests.append(body)
            if auth != f"Bearer {KEY}":
                return 401, {"error": "bad key"}
            if self.fail_first > 0:
                self.fail_first -= 1
                return 500, {"error": "warming up"}
            if self.status != 200:
                return self.status, {"error": "scorer down"}
            if self.reply is not None:
                return 200, self.reply
            scores = hf_scores(self.model, body["sequences"])
            self.answered.append(scores)
            return 200, {"scores": scores}


@pytest.fixture()
def scorer(hf_rm):
    state = Scorer(hf_rm)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, reply = state.answer(self.headers.get("Authorization"), body)
            raw = json.dumps(reply).encode()  # NaN goes out as the token NaN, which json.loads reads back
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # shutdown() waits for serve_forever's next poll: 0.05 s, not the default 0.5 s, at each test's teardown
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture()
def key_file(tmp_path):
    path = tmp_path / "rm_key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    from megapo.trainer import reward_model

    monkeypatch.setattr(reward_model, "BACKOFF_S", 0.01)


def _client(scorer, key_file, errors="fail"):
    from megapo.trainer.reward_model import RemoteRewardModel

    return RemoteRewardModel(scorer.url, 30.0, errors, str(key_file))


def test_client_scores_equal_transformers_on_the_same_folder(scorer, key_file, hf_rm):
    got = _client(scorer, key_file).scores(SEQUENCES, PROMPT_LENGTHS)
    assert got == pytest.approx(hf_scores(hf_rm, SEQUENCES), abs=1e-6)
    assert scorer.requests == [{"sequences": SEQUENCES, "prompt_lengths": PROMPT_LENGTHS}]
    assert scorer.headers == [f"Bearer {KEY}"]


def test_a_batch_goes_in_chunks_of_at_most_chunk_sequences(scorer, key_file, hf_rm, monkeypatch):
    from megapo.trainer import reward_model

    monkeypatch.setattr(reward_model, "CHUNK", 3)
    got = _client(scorer, key_file).scores(SEQUENCES, PROMPT_LENGTHS)
    assert [len(r["sequences"]) for r in scorer.requests] == [3, 1]
    assert got == pytest.approx(hf_scores(hf_rm, SEQUENCES), abs=1e-6)


def test_a_run_with_a_remote_reward_model_adds_coef_times_its_scores(tmp_path, tiny_moe, scorer, key_file):
    (tmp_path / "zero_reward.py").write_text(ZERO)
    coef = 3.0
    rows = train_rows(tmp_path, "rm_url", f"model.path={tiny_moe}", "train.steps=2", "data.reward=zero_reward:zero",
                      f"data.reward_model.url={scorer.url}", f"data.reward_model.api_key_file={key_file}",
                      f"data.reward_model.coef={coef}", "data.prompts_per_step=4", "rollout.n_samples=4")
    assert [r["step"] for r in rows] == [1, 2]
    assert len(scorer.answered) == 2  # one request per step (not one per rank, not one per sample)
    for r, scores in zip(rows, scorer.answered):
        assert r["reward"] == 0.0  # the verifier's, logged as before
        assert r["reward/model"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
        assert r["reward/with_model"] == pytest.approx(coef * sum(scores) / len(scores), abs=1e-6)
        assert r["reward/model_errors"] == 0
    for body in scorer.requests:  # prompt + response, the prompt's length given
        assert all(0 < p < len(s) for s, p in zip(body["sequences"], body["prompt_lengths"]))


def test_a_scorer_failing_twice_then_answering_costs_retries_not_scores(scorer, key_file, hf_rm):
    scorer.fail_first = 2
    rm = _client(scorer, key_file)
    assert rm.scores(SEQUENCES, PROMPT_LENGTHS) == pytest.approx(hf_scores(hf_rm, SEQUENCES), abs=1e-6)
    assert len(scorer.requests) == 3 and rm.pop_errors() == 0


def test_a_dead_scorer_with_reward_errors_fail_raises_naming_the_url_and_status(scorer, key_file):
    from megapo.trainer.reward_model import RETRIES
    from megapo.trainer.rewards import RewardError

    scorer.status = 500
    with pytest.raises(RewardError) as err:
        _client(scorer, key_file).scores(SEQUENCES, PROMPT_LENGTHS)
    assert scorer.url in str(err.value) and "HTTP 500" in str(err.value) and "data.reward_model.url" in str(err.value)
    assert len(scorer.requests) == RETRIES + 1


def test_a_dead_scorer_with_reward_errors_zero_scores_zero_and_counts(scorer, key_file):
    from types import SimpleNamespace

    from megapo.trainer.reward_model import add_model_rewards

    scorer.status = 503
    groups = [SimpleNamespace(samples=[SimpleNamespace(prompt_ids=s[:p], output_ids=s[p:])
                                       for s, p in zip(SEQUENCES, PROMPT_LENGTHS)], rewards=[1.0, 0.0, 1.0, 0.0])]
    m = add_model_rewards(_client(scorer, key_file, errors="zero"), groups, 2.0)
    assert groups[0].rewards == [1.0, 0.0, 1.0, 0.0]
    assert m["reward/model"] == 0.0 and m["reward/model_errors"] == len(SEQUENCES)


def test_megapo_train_stops_naming_the_url_when_the_scorer_is_down(tmp_path, tiny_moe, scorer, key_file):
    scorer.status = 500
    out = tmp_path / "down"
    cmd = [sys.executable, "-m", "megapo.cli", "train", str(CONFIG), "sft.enabled=false", f"train.output_dir={out}",
           f"model.path={tiny_moe}", "train.steps=1", "train.eval_every=0", "train.ckpt_every=0", "train.log=[jsonl]",
           "data.prompts_per_step=4", "data.dynamic_sampling=false", f"data.reward_model.url={scorer.url}",
           f"data.reward_model.api_key_file={key_file}"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megapo train:") and scorer.url in last and "HTTP 500" in last, proc.stderr[-3000:]


@pytest.mark.parametrize("reply, words", [({"scores": [1.0]}, "returned 1 scores for 4 sequences"),
                                          ({"scores": [1.0, "x", 2.0, 3.0]}, "'x'"),
                                          ({"scores": [1.0, math.nan, 2.0, 3.0]}, "nan"),
                                          ({"score": 1.0}, "expected")])
def test_a_malformed_reply_is_an_error_naming_the_url(scorer, key_file, reply, words):
    from megapo.trainer.rewards import RewardError

    scorer.reply = reply
    with pytest.raises(RewardError) as err:
        _client(scorer, key_file).scores(SEQUENCES, PROMPT_LENGTHS)
    assert scorer.url in str(err.value) and words in str(err.value)
    assert len(scorer.requests) == 1  # the scorer answered: no retry
    scorer.requests.clear()
    rm = _client(scorer, key_file, errors="zero")  # zero: 0 for the batch, counted
    assert rm.scores(SEQUENCES, PROMPT_LENGTHS) == [0.0] * 4 and rm.pop_errors() == 4


@pytest.mark.parametrize("errors", ["fail", "zero"])
def test_a_wrong_key_is_refused_once_naming_the_key_file(scorer, tmp_path, errors):
    from megapo.trainer.reward_model import RemoteRewardModel
    from megapo.trainer.rewards import RewardError

    wrong = tmp_path / "wrong_key"
    wrong.write_text("w" * 24)
    wrong.chmod(0o600)
    with pytest.raises(RewardError) as err:
        RemoteRewardModel(scorer.url, 30.0, errors, str(wrong)).scores(SEQUENCES, PROMPT_LENGTHS)
    assert "data.reward_model.api_key_file" in str(err.value) and "401" in str(err.value)
    assert scorer.headers == ["Bearer " + "w" * 24]  # one request: a refused key is not retried


def _load(tmp_path, tiny_moe, *overrides):
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig

    return load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition",
                                         f"train.output_dir={tmp_path / 'run'}", *overrides])


def test_config_refusals_name_their_field_before_anything_starts(tmp_path, tiny_moe, tiny_rm, key_file):
    from megapo.config import ConfigError

    url = "http://127.0.0.1:9/score"
    cases = [((f"data.reward_model.path={tiny_rm}", f"data.reward_model.url={url}"), "data.reward_model.url"),
             (("data.reward_model.url=127.0.0.1:9/score",), "data.reward_model.url"),
             (("data.reward_model.url=ftp://host/score",), "data.reward_model.url"),
             ((f"data.reward_model.url={url}", f"data.reward_model.api_key_file={tmp_path / 'none'}"),
              "data.reward_model.api_key_file"),
             ((f"data.reward_model.api_key_file={key_file}",), "data.reward_model.api_key_file")]
    for overrides, field in cases:
        with pytest.raises(ConfigError) as err:
            _load(tmp_path, tiny_moe, *overrides)
        assert err.value.field == field, (overrides, str(err.value))
    assert not (tmp_path / "run").exists()  # refused before anything was written
    cfg = _load(tmp_path, tiny_moe, f"data.reward_model.url={url}", f"data.reward_model.api_key_file={key_file}")
    assert cfg.data.reward_model.enabled  # a url alone is a reward model; nothing listens there yet: not asked
