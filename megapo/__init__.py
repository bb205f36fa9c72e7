"""megapo: reinforcement-learning post-training for Mixture-of-Experts LLMs on Megatron-core."""

__version__ = "0.1.0"
