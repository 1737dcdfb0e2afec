"""The in-process Tinker backend: one core, models, training workers and the local clients."""
