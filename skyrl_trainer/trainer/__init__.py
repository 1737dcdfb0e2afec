"""The RL trainer: the loop and its algorithm pieces. It talks to models only through the Tinker
client interface (a `ServiceClient`, local or remote); it imports nothing from
`skyrl_trainer.backend` (tests/trainer/test_import_boundary.py checks it)."""
