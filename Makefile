# Two commands do all the set-up: `make serve` and `make test`. `make help` lists the rest.

# Python 3.10, 3.11 or 3.12 (pyproject.toml's requires-python; tests/test_python_versions.py holds
# the two to each other): the first of python3.11, python3.12, python3.10, python3 and python on
# PATH that is one of them, unless given (make PYTHON=/opt/python3.12/bin/python3).
PYTHON_VERSIONS := 3.10 3.11 3.12
# $(call first_python,VERSIONS,COMMANDS): the first command on PATH whose Python is one of VERSIONS.
first_python = $(firstword $(foreach p,$(2),$(if $(filter $(shell command -v $(p) >/dev/null 2>&1 && $(p) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null),$(1)),$(p))))
PYTHON ?= $(call first_python,$(PYTHON_VERSIONS),python3.11 python3.12 python3.10 python3 python)
# The `ascend` extra's onnxruntime-cann 1.22.1 has wheels for Python 3.10 and 3.11 only (none for 3.12):
# its virtualenv (.venv/cann) takes PYTHON when that is one of them, else python3.11 or python3.10.
CANN_PYTHON_VERSIONS := 3.10 3.11
CANN_PYTHON ?= $(call first_python,$(CANN_PYTHON_VERSIONS),$(PYTHON) python3.11 python3.10)
VENV   := .venv
BIN    := $(VENV)/bin
# What serving needs (`.[cpu]`), then what `make triton`, `make test` and `make bench` add to it.
SERVE_STAMP  := $(VENV)/.installed-serve
TRITON_STAMP := $(VENV)/.installed-triton
STAMP        := $(VENV)/.installed
BENCH_STAMP  := $(VENV)/.bench-installed
# The `ascend` install (onnxruntime-cann) beside the CPU one: the two cannot share a virtualenv.
CANN_VENV  := $(VENV)/cann
CANN_STAMP := $(CANN_VENV)/.installed
# Triton's perf_analyzer 2.51, taken from the tritonclient 2.51.0 wheel (tools/perf_analyzer.py).
PERF_ANALYZER := $(VENV)/perf_analyzer/bin/perf_analyzer
# Debian's packages the tests run: Prometheus (prometheus, promtool; tests/test_prometheus.py runs it
# against the servers), and curl and openssl, which the documentation's snippets use (tests/test_docs.py).
SYSTEM_STAMP := $(VENV)/.system-packages-installed
SYSTEM_PACKAGES := prometheus curl openssl
# The code of kserve/storage-initializer:v0.15.2 (manifests/triton's init container): the `kserve`
# 0.15.2 package, whose protobuf 4 cannot share .venv. tests/test_storage.py runs its Storage.download.
STORAGE_INITIALIZER_VENV  := $(VENV)/kserve-0.15.2
STORAGE_INITIALIZER_STAMP := $(STORAGE_INITIALIZER_VENV)/.installed
# MLServer, a peer in `make bench`.
MLSERVER_VENV  := $(VENV)/mlserver
MLSERVER_STAMP := $(MLSERVER_VENV)/.installed

# `make serve` and `make triton`: the repository and the ports (each has its server's defaults),
# plus any further flags, e.g. make serve SERVE_ARGS='--model_control_mode poll --workers 2'.
MODEL_DIR ?= model_repository
serve: HTTP_PORT ?= 8080
serve: GRPC_PORT ?= 8081
serve: METRICS_PORT ?= 9090
triton: HTTP_PORT ?= 8000
triton: GRPC_PORT ?= 8001
triton: METRICS_PORT ?= 8002
# `make triton`: tritonserver's own flags, after tools/run_triton.py's `--` (see `make serve`'s SERVE_ARGS).
# Triton stops when a model fails to load; as `make serve` does, `make triton` serves the models that
# load and reports the others in its repository index. TRITON_ARGS= gives Triton's own default.
TRITON_ARGS ?= --exit-on-error=false
# `make conformance`: the server the suite starts, kserve-ascend or triton.
SERVER ?= kserve-ascend

.PHONY: help serve test triton conformance models bench check-ascend clean

help:
	@echo 'make serve        serve MODEL_DIR (model_repository) on HTTP_PORT 8080, GRPC_PORT 8081, METRICS_PORT 9090;'
	@echo '                  SERVE_ARGS adds flags (kserve-ascend --help lists them). Installs only what serving needs.'
	@echo 'make test         every test, against real servers (installs the test toolchain, ~11 min)'
	@echo 'make triton       real Triton 2.51 with the ascend backend on MODEL_DIR, ports 8000, 8001, 8002;'
	@echo '                  TRITON_ARGS adds tritonserver flags (default: --exit-on-error=false).'
	@echo 'make conformance  the OIP v2 conformance suite against a server it starts (SERVER=kserve-ascend or triton)'
	@echo 'make bench        the benchmark against Triton, MLServer and stock KServe (~27 min; BENCH_ARGS=--quick: ~5 min)'
	@echo 'make models       regenerate the committed model files from their seeds'
	@echo 'make check-ascend check an Ascend host: CANN, pyACL, an NPU, the CANN execution provider'
	@echo 'PYTHON=...        the Python 3.10-3.12 to build .venv with (found on PATH by default: $(or $(PYTHON),none))'
	@echo 'CANN_PYTHON=...   the Python 3.10 or 3.11 of the `ascend` install, .venv/cann (default: $(or $(CANN_PYTHON),none))'

# The virtualenv, from a Python of the versions pyproject.toml allows, or why not.
$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "kserve-ascend needs Python $(PYTHON_VERSIONS), and none of python3.11, python3.12, python3.10," \
	  "python3, python on PATH is one (python3 is $$(python3 --version 2>&1 | tail -1)). Install one (Debian 12:" \
	  "apt-get install python3 python3-venv; Ubuntu 22.04+: apt-get install python3 python3-venv) or name it:" \
	  "make PYTHON=/path/to/python3" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV) || { echo "$(PYTHON) cannot make a virtualenv: install its venv module (Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
	$(BIN)/pip install --quiet --upgrade pip

# Each stamp reinstalls only when pyproject.toml changes.
$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[cpu]'
	touch $@

$(TRITON_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[cpu,triton]'
	touch $@

# The test toolchain: serving's and Triton's installs are part of it.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[cpu,test]'
	touch $@ $(SERVE_STAMP) $(TRITON_STAMP)

# The install path of Ascend hosts, verified: `.[ascend]` brings onnxruntime-cann and no CPU
# onnxruntime beside it, and `pip check` is clean. tests/test_cann_ep.py runs the CANN execution
# provider in it against stub CANN libraries it compiles (hence the C and C++ compilers).
$(CANN_STAMP): pyproject.toml | $(BIN)/python
	@test -n "$(CANN_PYTHON)" || { echo "the 'ascend' extra (onnxruntime-cann 1.22.1) needs Python $(CANN_PYTHON_VERSIONS)," \
	  "and none of $(PYTHON), python3.11, python3.10 on PATH is one. Install one or name it: make CANN_PYTHON=/path/to/python3.11" >&2; exit 1; }
	command -v g++ >/dev/null || apt-get install -y -qq g++ || { apt-get update -qq && apt-get install -y -qq g++; }
	test -x $(CANN_VENV)/bin/python || $(CANN_PYTHON) -m venv $(CANN_VENV)
	$(CANN_VENV)/bin/pip install --quiet --upgrade pip
	$(CANN_VENV)/bin/pip install --quiet -e '.[ascend]'
	$(CANN_VENV)/bin/pip check
	touch $@

# Once: pip downloads the wheel, the binary is extracted and linked to the libb64 and libcudart that
# nvidia-pytriton (a test dependency) ships. The target is the binary itself; the recipe also writes
# $(BIN)/perf_analyzer, which runs it by name with those libraries (no LD_LIBRARY_PATH to set).
$(PERF_ANALYZER): $(STAMP) tools/perf_analyzer.py
	$(BIN)/python tools/perf_analyzer.py
	touch $@

$(STORAGE_INITIALIZER_STAMP): | $(BIN)/python
	test -x $(STORAGE_INITIALIZER_VENV)/bin/python || $(PYTHON) -m venv $(STORAGE_INITIALIZER_VENV)
	$(STORAGE_INITIALIZER_VENV)/bin/pip install --quiet 'kserve[storage]==0.15.2'
	touch $@

$(SYSTEM_STAMP): | $(STAMP)
	( for c in $(SYSTEM_PACKAGES); do command -v $$c >/dev/null || exit 1; done ) \
	  || apt-get install -y -qq $(SYSTEM_PACKAGES) || { apt-get update -qq && apt-get install -y -qq $(SYSTEM_PACKAGES); }
	touch $@

serve: $(SERVE_STAMP)
	$(BIN)/python -m kserve_ascend --model_dir $(MODEL_DIR) --http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT) \
	  --metrics_port $(METRICS_PORT) $(SERVE_ARGS)

# Two pytest runs: first the tests that wait on servers, two files at a time (pytest-xdist; a file's
# servers start once, in its worker), then, alone, those marked `serial`, which load the machine or time
# what it does (tests/conftest.py lists them). Both run whatever the first one's outcome.
test: $(STAMP) $(CANN_STAMP) $(PERF_ANALYZER) $(SYSTEM_STAMP) $(STORAGE_INITIALIZER_STAMP)
	status=0; \
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not serial" || status=$$?; \
	$(BIN)/python -m pytest -m serial || status=$$?; \
	exit $$status

# On an Ascend host (CANN toolkit installed, set_env.sh sourced): CANN, pyACL, an NPU, the CANN
# execution provider, and one model served through the real server, each with its fix.
check-ascend: $(CANN_STAMP)
	$(CANN_VENV)/bin/python tools/check_ascend_host.py

# Real Triton (from the nvidia-pytriton wheel) with the `ascend` backend on :8000/:8001/:8002.
triton: $(TRITON_STAMP)
	$(BIN)/python tools/run_triton.py --model-repository $(MODEL_DIR) --http-port $(HTTP_PORT) \
	  --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) -- $(TRITON_ARGS)

# The suite of conformance/ against a server it starts on conformance/models (python -m conformance
# --http HOST:PORT --grpc HOST:PORT runs it against one you started).
conformance: $(STAMP)
	$(BIN)/python -m conformance --serve $(SERVER)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e '.[cpu,test,bench]'
	touch $@

# MLServer 1.7.1, a peer in the bench, in its own virtualenv (its pins do not fit .venv's); uvloop
# below 0.22: with 0.23 its parallel-inference workers fail to start ("There is no current event loop").
$(MLSERVER_STAMP): | $(BIN)/python
	test -x $(MLSERVER_VENV)/bin/python || $(PYTHON) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/pip install --quiet 'mlserver==1.7.1' 'uvloop<0.22'
	touch $@

# The same loads against kserve-ascend (--workers 1 and 2), Triton, MLServer and stock KServe
# (bench/run.py; hey, perf_analyzer and tritonclient) with py-spy profiles and the detection chain,
# ~27 min: bench/results/results.md, results.json, qps_p99.png, side_by_side.png, profile-*, detect.md.
# `make bench BENCH_ARGS=--quick` (1 s per point, one concurrency per model, ~5 min) checks that it
# runs and writes to bench/results/quick/ (not committed).
bench: $(BENCH_STAMP) $(PERF_ANALYZER) $(MLSERVER_STAMP)
	command -v hey >/dev/null || apt-get install -y -qq hey || { apt-get update -qq && apt-get install -y -qq hey; }
	$(BIN)/python bench/run.py $(BENCH_ARGS)

# Regenerates the committed model files from seeded weights.
models: $(STAMP)
	$(BIN)/python tools/make_simple.py
	$(BIN)/python tools/make_yolov8n.py
	$(BIN)/python tools/make_sequence_models.py
	$(BIN)/python tools/make_simple_string.py

clean:
	rm -rf $(VENV) .pytest_cache
