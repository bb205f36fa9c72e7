"""Multi-turn environments (tool use) and the rollouts that play them: base.py (Environment, StepResult,
Trajectory), tools.py (tool-call formats, the calculator), registry.py (env.name), rollout.py (the driver)."""
