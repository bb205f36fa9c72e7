"""A reward model in the loop (data.reward_model: path or url, coef): each sample's reward becomes

    r_i <- r_i + coef · RM(prompt_i + response_i)

before the advantages, where r_i is the verifier's (data.reward, after any length shaping) and RM is one of:

- `path`: an HF *ForSequenceClassification folder (one label, scored at the last token as transformers does) run as
  a frozen Megatron ScoreModel (megapo/learner/score.py) under the learner's layout and precision. The Megatron
  model is collective, so the scoring runs on every rank in the update (megapo.trainer.update.update_policy);
- `url`: a scorer service (RemoteRewardModel; the protocol is in docs/CONTRACTS.md, "Remote reward model"). It is
  asked once per step, by rank 0 in the same place, and its answer is broadcast, so that every rank adds the same
  scores; the calls follow the user rewards' rules (data.reward_timeout_s, data.reward_errors).

Either way every rank holds the same groups and adds the same scores. data.reward still applies: for the reward
model alone, give a reward of 0 for every response (a "module:function" returning 0.0); data.dynamic_sampling and
the length stage read the verifier's rewards, before the reward model's scores are added.

Metrics: reward/model, the batch mean of the RM's scores (before coef); reward/with_model, the batch mean of the
rewards the advantages are computed from; with a url, reward/model_errors, the sequences scored 0 because the
scorer failed (data.reward_errors=zero). The logged `reward` stays the verifier's.

Dense rewards (data.reward_model.dense: step | token; a `path` only): the same one forward scores every prefix of
each sequence (ScoreModel.prefix_scores), the response is cut into steps at data.reward_model.step_delimiter (or
every token), and instead of coef · RM being added to the reward, coef times the process advantage of
megapo/algorithms/process_rewards.py (its docstring has the formula) is added to each token's advantage after the
token stages (add_process_advantages). Metrics: reward/model (the mean score of the whole sequences, as above),
reward/process_mean (the mean dense reward per step), reward/steps_per_response.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import numbers
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from megapo.dist import broadcast_object, rank
from megapo.engines.http import ConnectionLost, HTTPError, JSONClient
from megapo.trainer.rewards import RewardError

log = logging.getLogger(__name__)

URL, KEY = "data.reward_model.url", "data.reward_model.api_key_file"
CHUNK = 256  # sequences per request: a step's batch in a few bodies of bounded size
RETRIES = 3  # a call that gets no answer or a 5xx is tried again this often: a restarting scorer costs a retry
BACKOFF_S = 0.25  # before retry k (0, 1, 2): BACKOFF_S · 2**k


def build_reward_model(cfg):
    """The reward model of data.reward_model: a RemoteRewardModel for a url, else a frozen Megatron ScoreModel under
    the learner's layout and precision (collective)."""
    rm = cfg.data.reward_model
    if rm.url:
        return RemoteRewardModel(rm.url, cfg.data.reward_timeout_s, cfg.data.reward_errors, rm.api_key_file)
    from megapo.learner.score import ScoreModel

    return ScoreModel(rm.path, cfg.parallel, seed=cfg.train.seed,
                      micro_batch_tokens=cfg.train.micro_batch_tokens, row_tokens=cfg.train.row_tokens,
                      precision=cfg.train.precision_spec(), field="data.reward_model.path")


def add_model_rewards(reward_model, groups: list, coef: float) -> dict:
    """g.rewards[i] += coef · score of prompt_ids + output_ids for every sample of every group, in place (every
    rank: the model is collective); the metrics reward/model and reward/with_model (and reward/model_errors)."""
    samples = [s for g in groups for s in g.samples]
    sequences = [list(s.prompt_ids) + list(s.output_ids) for s in samples]
    if not sequences:
        return {}
    remote = isinstance(reward_model, RemoteRewardModel)
    scores = iter(reward_model.scores(sequences, [len(s.prompt_ids) for s in samples]) if remote
                  else reward_model.scores(sequences))
    scored: list[float] = []
    for g in groups:
        extra = [next(scores) for _ in g.samples]
        scored.extend(extra)
        g.rewards = [r + coef * x for r, x in zip(g.rewards, extra)]
    combined = [r for g in groups for r in g.rewards]
    metrics = {"reward/model": sum(scored) / len(scored), "reward/with_model": sum(combined) / len(combined)}
    if remote:
        metrics["reward/model_errors"] = reward_model.pop_errors()
    return metrics


# ----------------------------------------------------------------------------- data.reward_model.dense


@dataclass
class DenseRewards:
    """Each sample's prefix scores s(-1) .. s(L - 1) ([L + 1] fp32, the prompt's first) and its steps' last token
    indices, in batch order, with the groups' sizes (megapo/algorithms/process_rewards.py)."""

    scores: list
    ends: list[list[int]]
    group_sizes: list[int]


def dense_model_rewards(reward_model, groups: list, dense: str, delimiter: str, tokenizer) -> tuple[DenseRewards, dict]:
    """Every rank (collective): the prefix scores of every sample from one forward of the score model, each
    response's steps (`dense`: step, cut where the decoded text completes `delimiter`; token: every token), and the
    metrics reward/model, reward/process_mean, reward/steps_per_response. The groups' rewards are left as they are."""
    from megapo.algorithms.process_rewards import step_ends, step_rewards, token_texts

    samples = [s for g in groups for s in g.samples]
    if not samples:
        return DenseRewards([], [], []), {}
    sequences = [list(s.prompt_ids) + list(s.output_ids) for s in samples]
    scores = reward_model.prefix_scores(sequences, [len(s.prompt_ids) - 1 for s in samples])
    if dense == "token":
        ends = [list(range(len(s.output_ids))) for s in samples]
    else:
        cache: dict = {}  # each token id decoded once per step
        ends = [step_ends(token_texts(tokenizer, list(s.output_ids), cache), delimiter) for s in samples]
    rewards = [step_rewards(x.double(), e) for x, e in zip(scores, ends)]
    flat = [float(r) for rs in rewards for r in rs]
    metrics = {"reward/model": sum(float(x[-1]) for x in scores) / len(scores),
               "reward/process_mean": sum(flat) / len(flat),
               "reward/steps_per_response": len(flat) / len(samples)}
    return DenseRewards(scores, ends, [len(g.samples) for g in groups]), metrics


def add_process_advantages(batch: list, dense: DenseRewards, coef: float) -> dict:
    """sample.advantage <- A_t + coef · Â_t per response token (process_rewards.process_advantages), in place, on
    every rank (the same batch and scores everywhere); the metric reward/process_adv_abs, the mean |Â_t|."""
    from megapo.algorithms.process_rewards import add_to_advantages, process_advantages

    if len(batch) != len(dense.scores):
        raise ValueError(f"batch: {len(batch)} train samples, {len(dense.scores)} scored by the reward model")
    process, _ = process_advantages(dense.scores, dense.ends, dense.group_sizes)
    for sample, values in zip(batch, add_to_advantages([s.advantage for s in batch], process, coef)):
        sample.advantage = values
    flat = [abs(float(v)) for p in process for v in p]
    return {"reward/process_adv_abs": sum(flat) / len(flat)} if flat else {}


# ----------------------------------------------------------------------------- data.reward_model.url


class ScorerError(RewardError):
    """The scorer at data.reward_model.url failed on a batch (no answer, an error status, a malformed reply);
    `fatal`: whatever data.reward_errors says (a refused key: every later call would fail the same way)."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


class RemoteRewardModel:
    """`scores(sequences, prompt_lengths)` on every rank: rank 0 POSTs them to `url` (CHUNK at a time, each call
    within timeout_s, retried on no answer or a 5xx) and broadcasts the scores, or the failure that every rank then
    raises. `errors` (data.reward_errors): fail raises a ScorerError; zero scores the failed chunk 0 and counts it
    (`pop_errors`). The key in `api_key_file` goes as the engine servers' header (megapo.engines.auth.bearer)."""

    def __init__(self, url: str, timeout_s: float, errors: str, api_key_file: str = ""):
        from megapo.engines.auth import read_key_file

        self.url, self.errors, self.keyed = url, errors, bool(api_key_file)
        self.path = urlsplit(url).path or "/"
        self._failures = 0  # sequences scored 0 since the last pop_errors()
        self._client = None
        if rank() == 0:  # only rank 0 talks to the scorer (and needs the key)
            key = read_key_file(api_key_file, KEY) if api_key_file else None
            self._client = _Client(url, timeout_s or None, key)  # 0: no limit

    def scores(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[float]:
        """Every rank (collective): the scorer's score of each sequence, in order."""
        answer = self._score_all(sequences, prompt_lengths) if rank() == 0 else None
        scores, failure, zeroed = broadcast_object(answer)
        self._failures += zeroed
        if failure is not None:
            raise ScorerError(failure)
        return scores

    def pop_errors(self) -> int:
        count, self._failures = self._failures, 0
        return count

    def _score_all(self, sequences, prompt_lengths) -> tuple[list[float] | None, str | None, int]:
        """Rank 0: (scores, None, sequences scored 0 under reward_errors=zero), or (None, message, 0) to stop."""
        scores: list[float] = []
        zeroed = 0
        for lo in range(0, len(sequences), CHUNK):
            chunk, lengths = sequences[lo:lo + CHUNK], prompt_lengths[lo:lo + CHUNK]
            try:
                scores.extend(self._score(chunk, lengths))
            except ScorerError as err:
                if self.errors == "fail" or err.fatal:
                    return None, str(err), 0
                if not self._failures and not zeroed:
                    log.warning("%s; scored 0 (data.reward_errors=zero; counted in reward/model_errors)", err)
                scores.extend([0.0] * len(chunk))
                zeroed += len(chunk)
        return scores, None, zeroed

    def _score(self, sequences, prompt_lengths) -> list[float]:
        body = {"sequences": [[int(t) for t in s] for s in sequences], "prompt_lengths": list(map(int, prompt_lengths))}
        return checked_scores(self._post(body), len(sequences), self.url)

    def _post(self, body: dict):
        """The scorer's reply; a call with no answer or a 5xx is tried again (RETRIES, with backoff)."""
        for attempt in range(RETRIES + 1):
            try:
                return self._client.post(self.path, body)
            except HTTPError as err:
                if err.status == 401:  # the key is wrong or missing: a retry would be refused too
                    raise ScorerError(self._refused(err), fatal=True) from None
                problem = f"answered HTTP {err.status}: {err.body[:300]}"
                if err.status < 500:  # the scorer rejects the request itself: retrying sends the same
                    raise ScorerError(f"{URL}={self.url} {problem}") from None
            except ConnectionLost as err:
                timed_out = isinstance(err.__cause__, TimeoutError)
                problem = "gave no answer within data.reward_timeout_s" if timed_out else f"did not answer: {err}"
            if attempt < RETRIES:
                log.warning("%s=%s %s; retrying (%d/%d)", URL, self.url, problem, attempt + 1, RETRIES)
                time.sleep(BACKOFF_S * 2 ** attempt)
        raise ScorerError(f"{URL}={self.url} {problem} (after {RETRIES} retries)")

    def _refused(self, err: HTTPError) -> str:
        if not self.keyed:
            return f"{KEY} is not set and the scorer at {self.url} wants a key (HTTP 401: {err.body[:200]})"
        return f"{KEY}: the scorer at {self.url} refused the key (HTTP 401: {err.body[:200]})"


def checked_scores(reply, count: int, url: str) -> list[float]:
    """The reply's {"scores": [...]}: `count` finite numbers (not booleans), else a ScorerError naming the url."""
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise ScorerError(f'{URL}={url} replied {json.dumps(reply)[:200]}; expected {{"scores": [one per sequence]}}')
    if len(scores) != count:
        raise ScorerError(f"{URL}={url} returned {len(scores)} scores for {count} sequences")
    for i, x in enumerate(scores):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
            raise ScorerError(f"{URL}={url} returned {x!r} as the score of sequence {i}; a score must be a finite "
                              "number")
    return [float(x) for x in scores]


class _Client(JSONClient):
    """megapo's JSONClient (kept-alive connection, the key's header) that also speaks https."""

    def __init__(self, url: str, timeout: float | None, api_key: str | None):
        parts = urlsplit(url)
        super().__init__(f"http://{parts.netloc}", timeout, api_key)
        self.tls = parts.scheme == "https"
        if self.tls:
            self.base_url, self.port = f"https://{parts.netloc}", parts.port or 443

    def _conn(self) -> http.client.HTTPConnection:
        if not self.tls:
            return super()._conn()
        if getattr(self._local, "conn", None) is None:
            self._local.conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout)
        return self._local.conn
