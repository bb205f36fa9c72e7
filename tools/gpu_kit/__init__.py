"""The GPU validation kit's library (issue 21), one module per job: context (sizes, bounds, the worker's Context),
helpers (shared measurements), one module per group of sections (environment, compat, learner_checks, replay,
nccl, large, broadcast), registry (the sections in order), worker and orchestrate (the processes). The command line
is tools/gpu_check.py (`python -m tools.gpu_check`, tools/gpu_check.sh).
"""
