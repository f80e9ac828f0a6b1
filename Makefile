# Two commands do all the set-up: `make serve` and `make test` (`make bench` measures).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
# The `ascend` install (onnxruntime-cann) beside the CPU one: the two cannot share a virtualenv.
CANN_VENV  := $(VENV)/cann
CANN_STAMP := $(CANN_VENV)/.installed
# Triton's perf_analyzer 2.51, taken from the tritonclient 2.51.0 wheel (tools/perf_analyzer.py).
PERF_ANALYZER := $(VENV)/perf_analyzer/bin/perf_analyzer
# Debian's Prometheus (prometheus, promtool): tests/test_prometheus.py runs it against the servers.
PROMETHEUS_STAMP := $(VENV)/.prometheus-installed
# The code of kserve/storage-initializer:v0.15.2 (manifests/triton's init container): the `kserve`
# 0.15.2 package, whose protobuf 4 cannot share .venv. tests/test_storage.py runs its Storage.download.
STORAGE_INITIALIZER_VENV  := $(VENV)/kserve-0.15.2
STORAGE_INITIALIZER_STAMP := $(STORAGE_INITIALIZER_VENV)/.installed
# MLServer, a peer in `make bench`.
MLSERVER_VENV  := $(VENV)/mlserver
MLSERVER_STAMP := $(MLSERVER_VENV)/.installed

MODEL_DIR ?= model_repository
HTTP_PORT ?= 8080
GRPC_PORT ?= 8081

.PHONY: serve test triton models bench check-ascend clean

# Idempotent: reinstalls only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[cpu,test]'
	touch $@

# The install path of Ascend hosts, verified: `.[ascend]` brings onnxruntime-cann and no CPU
# onnxruntime beside it, and `pip check` is clean. tests/test_cann_ep.py runs the CANN execution
# provider in it against stub CANN libraries it compiles (hence the C and C++ compilers).
$(CANN_STAMP): pyproject.toml
	command -v g++ >/dev/null || apt-get install -y -qq g++ || { apt-get update -qq && apt-get install -y -qq g++; }
	test -x $(CANN_VENV)/bin/python || $(PYTHON) -m venv $(CANN_VENV)
	$(CANN_VENV)/bin/pip install --quiet --upgrade pip
	$(CANN_VENV)/bin/pip install --quiet -e '.[ascend]'
	$(CANN_VENV)/bin/pip check
	touch $@

# Once: pip downloads the wheel, the binary is extracted and linked to the libb64 and libcudart that
# nvidia-pytriton (a test dependency) ships. The target is the binary itself.
$(PERF_ANALYZER): $(STAMP) tools/perf_analyzer.py
	$(BIN)/python tools/perf_analyzer.py
	touch $@

$(STORAGE_INITIALIZER_STAMP):
	test -x $(STORAGE_INITIALIZER_VENV)/bin/python || $(PYTHON) -m venv $(STORAGE_INITIALIZER_VENV)
	$(STORAGE_INITIALIZER_VENV)/bin/pip install --quiet 'kserve[storage]==0.15.2'
	touch $@

$(PROMETHEUS_STAMP): | $(STAMP)
	command -v prometheus >/dev/null || apt-get install -y -qq prometheus || { apt-get update -qq && apt-get install -y -qq prometheus; }
	touch $@

serve: $(STAMP)
	$(BIN)/python -m kserve_ascend --model_dir $(MODEL_DIR) --http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT)

test: $(STAMP) $(CANN_STAMP) $(PERF_ANALYZER) $(PROMETHEUS_STAMP) $(STORAGE_INITIALIZER_STAMP)
	$(BIN)/python -m pytest

# On an Ascend host (CANN toolkit installed, set_env.sh sourced): CANN, pyACL, an NPU, the CANN
# execution provider, and one model served through the real server, each with its fix.
check-ascend: $(CANN_STAMP)
	$(CANN_VENV)/bin/python tools/check_ascend_host.py

# Real Triton (from the nvidia-pytriton wheel) with the `ascend` backend on :8000/:8001/:8002.
triton: $(STAMP)
	$(BIN)/python tools/run_triton.py --model-repository $(MODEL_DIR)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e '.[cpu,test,bench]'
	touch $@

# MLServer 1.7.1, a peer in the bench, in its own virtualenv (its pins do not fit .venv's); uvloop
# below 0.22: with 0.23 its parallel-inference workers fail to start ("There is no current event loop").
$(MLSERVER_STAMP):
	test -x $(MLSERVER_VENV)/bin/python || $(PYTHON) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/pip install --quiet 'mlserver==1.7.1' 'uvloop<0.22'
	touch $@

# The same loads against kserve-ascend (--workers 1 and 2), Triton, MLServer and stock KServe
# (bench/run.py; hey, perf_analyzer and tritonclient) with py-spy profiles and the detection chain,
# ~25 min: bench/results/results.md, results.json, qps_p99.png, side_by_side.png, profile-*, detect.md.
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
