"""The RL driver loop, in the order of the algorithm (the parts: megapo.trainer.run.Run).

One step:
    prompts ─► engine.generate (n samples each, log-probs, routes for R3; or multi-turn trajectories)
            ─► rewards, length shaping, dynamic sampling                     (megapo.trainer.rollout)
            ─► advantages ─► π_old (R2 records routes, R3 replays the engine's) ─► π_ref for KL terms
            ─► token stages ─► learner.train_step per mini-batch              (megapo.trainer.update)
            ─► weight sync learner → engine ─► held-out eval ─► checkpoint ─► metrics row

Every rank runs this loop (the learner's methods are collective); only rank 0 owns the engine, computes
rewards and writes files, and broadcasts each step's train batch to the other ranks.
"""

from __future__ import annotations

import logging

from megapo.engines.base import Engine
from megapo.learner.protocol import Learner
from megapo.trainer.config import RunConfig
from megapo.trainer.metrics import StepTimer
from megapo.trainer.run import Run
from megapo.trainer.stop import TrainingStopped

log = logging.getLogger(__name__)


def train(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, learner: Learner | None = None,
          engine: Engine | None = None,
          print_fn=print, stop=None) -> dict:
    """Run RL as configured; return the last metrics row. `resume` / `overwrite`: what to do with a previous
    run in train.output_dir (Run.open). `learner`/`engine` may be passed in (tests). `stop`
    (megapo.trainer.stop.StopFlag): when set on any rank, every rank saves a checkpoint after the current
    step and raises TrainingStopped."""
    run = Run.open(cfg, resume=resume, overwrite=overwrite, learner=learner, engine=engine, print_fn=print_fn)
    if run is None:
        return {}
    row: dict = {}
    with run:  # a stopped or failed run still ends the rollout thread and any server megapo started
        run.start_rollouts()
        for step in run.steps():
            timer = StepTimer()
            groups, metrics, tokens = run.generate(step, timer)
            if groups:
                metrics.update(run.update(step, groups, timer))
                with timer("sync"):
                    metrics.update(run.sync_weights(step))
            else:
                log.warning("step %d: no informative group after %d sampling rounds; skipping the update", step,
                            cfg.data.max_sampling_rounds)
            run.rollouts_done()
            if run.eval_due(step):
                with timer("eval"):
                    metrics.update(run.evaluate())
            stopping = stop is not None and stop.agreed() and step < cfg.train.steps  # all ranks agree
            if stopping or run.checkpoint_due(step):
                with timer("checkpoint"):
                    run.checkpoint(step)
            row = run.log(step, metrics, timer, tokens)  # tokens/s: generated tokens per second of the step
            if stopping:
                run.finish()
                raise TrainingStopped(step)
    run.finish()
    return row
