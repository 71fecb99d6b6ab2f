# Quick start: `make serve` and `make test` (README.md); `make generate` chats once.
PY := .venv/bin/python
# No XLA_FLAGS here: the tests ask for their 4 simulated devices themselves
# (tests/conftest.py), and the server picks its own (one on CPU, or what --mesh names).

.PHONY: setup setup-test generate serve test lint

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test,reference

generate: setup
	$(PY) -m conflux_jax chat "What is the capital of France?"

serve: setup
	$(PY) -m serving --model default

# Two workers: the suite is mostly cold XLA compiles, each on one core; loadfile keeps a
# module's fixtures (servers, engines) on one worker. 26 -> 18 min on a cold 2-core host.
test: setup-test
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: setup-test
	.venv/bin/ruff check .
