"""HF <-> Megatron-core (torch_dist) checkpoint conversion; the `megapo convert` command is megapo/commands/convert.py.

support.py   what is accepted (config keys, expected tensor names and shapes)
inputs.py    checks of input folders before any process starts
hf_writer.py streaming safetensors writer (shards + index)
worker.py    the per-rank work, run under torchrun
verify.py    HF transformers vs Megatron learner log-probs on a few sequences
"""
