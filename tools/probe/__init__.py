"""The bad-input and fault probe's library (issue 22), one module per job: outcomes (the classifier),
context (the shared inputs), registry (CASES and the verdict helpers), inputs (shared input files), one module per
class of cases (nonfinite, code_execution, reruns, coercions, lost_state, serve, late, rewards, damaged, signals,
conventions), catalog (every case, in order) and runner (a case's Result, counts, table). The command line is
tools/probe_inputs.py (`python -m tools.probe_inputs`).
"""
