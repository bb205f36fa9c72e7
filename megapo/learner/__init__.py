"""The Megatron-core learner (learner.py: `Learner`), its model builder (model.py; HF weights are loaded by
megapo.weights.hf_load and gathered back by megapo.weights.gather), vocabulary-parallel log-probs (logprobs.py),
[rows x width] packing (packing.py) and the non-finite update guard (guard.py); the `megapo logprobs` command
is megapo/commands/logprobs.py. Import `megapo.learner.learner`
for the class: this package itself stays light so commands that do not need Megatron do not import it."""
