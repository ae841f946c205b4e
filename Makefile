# The README's two commands: `make demo` and `make test`. Each prepares what it needs on a fresh
# machine: the system packages (apt-get, when root) and a virtual environment in .venv with torch
# pinned by constraints.txt to the CPU build.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SYSTEM_PACKAGES := openssh-server iperf3 iproute2
PYTEST_ARGS ?=
DEMO_OUT ?= demo-output
# Network namespaces need root; without it the demo runs the emulated nodes as local processes.
EMULATE_MODE := $(if $(filter 0,$(shell id -u)),,--mode local)

.PHONY: demo test lint bench system-packages venv clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[node,dev]'
	touch $@

venv: $(STAMP)

system-packages:
	@scripts/ensure-system-packages $(SYSTEM_PACKAGES)

demo: $(STAMP) system-packages
	@echo "== what this machine can do for an emulated testbed"
	@$(BIN)/testbed doctor || echo "(doctor found something missing: see the table above)"
	@echo "== the default inventory, validated and resolved"
	$(BIN)/testbed inventory show -i inventory.yaml
	@echo "== facts of this machine, gathered as from any node"
	$(BIN)/testbed inventory check -i examples/inventories/controller.yaml
	@echo "== the emulated testbed: a namespace, an sshd and a CPU quota per node (local mode without root)"
	$(BIN)/testbed emulate up -i inventory.yaml $(EMULATE_MODE)
	@$(BIN)/testbed inventory check -i inventory.yaml; status=$$?; \
	  if [ $$status -eq 0 ] && [ -z "$(EMULATE_MODE)" ]; then \
	    echo "== link shaping on the data veths: apply (read back), measure with iperf3, undo"; \
	    $(BIN)/testbed link apply -i inventory.yaml && \
	    $(BIN)/testbed link verify -i inventory.yaml --duration 2; status=$$?; \
	    $(BIN)/testbed link clear -i inventory.yaml || status=1; \
	  fi; \
	  if [ $$status -eq 0 ]; then \
	    echo "== power modes through the stand-in nvpmodel (read back), 3 s of telemetry at 10 Hz, restore"; \
	    $(BIN)/testbed power set orin MODE_15W -i inventory.yaml && \
	    $(BIN)/testbed telemetry record -i inventory.yaml --seconds 3 --out $(DEMO_OUT)/telemetry && \
	    $(BIN)/python -c "import pandas as pd, sys; f = pd.read_parquet(sys.argv[1]); \
	      p = f[f.metric == 'board_power_mw']; \
	      print('orin board power: median %.0f mW over %d samples (%s, %s)' % (p.value.median(), len(p), \
	        p.kind.iloc[0], p.sensor.iloc[0]))" $(DEMO_OUT)/telemetry/orin.parquet; status=$$?; \
	    $(BIN)/testbed power restore -i inventory.yaml || status=1; \
	  fi; \
	  if [ $$status -eq 0 ] && [ -z "$(EMULATE_MODE)" ]; then \
	    echo "== provisioning: a venv per node with the node wheel, the tiny model cut per role (m=2)"; \
	    $(BIN)/testbed provision -i inventory.yaml --model examples/models/tiny --partition m=2,P=2 && \
	    echo "== split inference over MPI: 2 server stages, 3 devices, the tiny model (U-shape, m=2)" && \
	    $(BIN)/testbed workers run examples/schedules/tiny-python.jsonl -i inventory.yaml --method ushape \
	      -P 2 -m 2 --out $(DEMO_OUT)/split || status=1; \
	  fi; \
	  $(BIN)/testbed emulate down -i inventory.yaml; exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/vermin -q -t=3.8- --violations --no-tips --eval-annotations nodes

test: $(STAMP) system-packages lint
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(STAMP) system-packages
	$(BIN)/python bench/fanout.py
	$(BIN)/python bench/emulate.py
	$(BIN)/python bench/shaping.py
	$(BIN)/python bench/telemetry.py
	$(BIN)/python bench/split.py
	$(BIN)/python bench/provision.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis $(DEMO_OUT)
