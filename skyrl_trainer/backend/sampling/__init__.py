"""Sampling engines of the in-process backend (vLLM, or a PyTorch engine where vLLM is absent)."""
