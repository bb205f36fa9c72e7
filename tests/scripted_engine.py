"""The no-op half of a scripted stand-in Engine and a fixed prompt source, for tests that drive the rollout loop with
an engine whose `generate` they write themselves (test_hdpo_caspo, test_anytime, test_soup, test_envs)."""

from __future__ import annotations

from megapo.engines.base import Engine


class ScriptedEngine(Engine):
    """An Engine whose weight, pause and health calls do nothing; a test's subclass writes `generate`."""

    def update_weights(self, named_tensors, version): ...
    def update_weights_from_disk(self, path, version): ...
    def pause(self): ...
    def resume(self): ...
    def health(self): return True
    def close(self): ...


class Source:
    """The prompts 0 .. n-1 at every step."""

    def next_batch(self, n):
        return list(range(n))
