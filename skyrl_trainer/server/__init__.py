"""A Tinker-compatible HTTP server over the in-process backend (`python -m skyrl_trainer.server`)."""
