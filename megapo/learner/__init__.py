"""The Megatron-core learner (learner.py: `Learner`), its model builder (model.py), HF weight loading
(weights.py; gathering them back is megapo.weights.gather), vocabulary-parallel log-probs (logprobs.py),
[rows x width] packing (packing.py), the non-finite update guard (guard.py) and the `megapo logprobs`
command (logprobs_cmd.py). Import `megapo.learner.learner`
for the class: this package itself stays light so commands that do not need Megatron do not import it."""
