"""skyrl-trainer: RL post-training for LLMs over the Tinker client interface."""

__version__ = "0.1.0"
