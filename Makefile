# The two entry points the README documents: `make serve` and `make test`.
VENV := .venv
# A distribution's own Python refuses pip installs (PEP 668, EXTERNALLY-MANAGED): there the project gets
# its own virtual environment in $(VENV); any other python3 (a venv, pyenv, a container's) is used as is.
ifndef PYTHON
PYTHON := $(shell python3 -c "import os, sys, sysconfig; managed = os.path.exists(os.path.join(\
	sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')) and sys.prefix == sys.base_prefix; \
	print('$(VENV)/bin/python' if managed else 'python3')")
endif
PIP := $(PYTHON) -m pip
HOST ?= 127.0.0.1
PORT ?= 8080
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install install-test client-envs chromium serve test test-gpu lint

# torch first: an explicit pin keeps pip from replacing an installed build with another one.
install: $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV)/bin/python)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e .

install-test: install
	$(PIP) install -q -e ".[test]"
	@command -v chromium >/dev/null || $(MAKE) --no-print-directory chromium

# Debian ships venv's ensurepip separately (python3-venv).
$(VENV)/bin/python:
	python3 -m venv $(VENV) || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv && python3 -m venv $(VENV); }

# The client packages the integration tests drive (Pipecat, LiveKit, the vendor SDKs), one virtual
# environment each under .venvs/, rebuilt when tests/integrations/requirements/<env>.txt changes.
client-envs: install-test
	$(PYTHON) tests/integrations/client_envs.py

# The browser test drives Debian's chromium package (as root, or through sudo).
chromium:
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
	command -v chromium >/dev/null

# The tiny random models by default (built once into ~/.cache/cosyvoice-realtime); the web page is at
# http://$(HOST):$(PORT)/.
serve: install
	$(PYTHON) -m realtime serve --host $(HOST) --port $(PORT)

# pytest exits 5 when it collected nothing: treat that as a failure, never as a pass.
test: install-test client-envs
	$(PYTHON) -m ruff check engines realtime scripts tests
	$(PYTHON) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran" >&2; exit 1; fi; exit $$rc

# The GPU-marked tests alone (graphs vs eager on CUDA), under the same pytest configuration; needs a CUDA
# device. On a GPU machine without this package's dependencies: benchmarks/on_device.sh make test-gpu.
# GPU_WORKERS=N runs them in N processes (pytest-xdist): their compiles and graph captures are host work
# that a GPU machine's cores can share.
GPU_WORKERS ?=
test-gpu:
	$(PYTHON) -m pytest -q -m gpu $(if $(GPU_WORKERS),-n $(GPU_WORKERS) -p no:benchmark) tests/engines; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran" >&2; exit 1; fi; exit $$rc

lint:
	$(PYTHON) -m ruff check engines realtime scripts tests
	$(PYTHON) -m mypy engines realtime
