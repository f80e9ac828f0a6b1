# Two commands do all the set-up: `make serve` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

MODEL_DIR ?= model_repository
HTTP_PORT ?= 8080
GRPC_PORT ?= 8081

.PHONY: serve test triton models clean

# Idempotent: reinstalls only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

serve: $(STAMP)
	$(BIN)/python -m kserve_ascend --model_dir $(MODEL_DIR) --http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT)

test: $(STAMP)
	$(BIN)/python -m pytest

# Real Triton (from the nvidia-pytriton wheel) with the `ascend` backend on :8000/:8001/:8002.
triton: $(STAMP)
	$(BIN)/python tools/run_triton.py --model-repository $(MODEL_DIR)

# Regenerates the committed model files from seeded weights.
models: $(STAMP)
	$(BIN)/python tools/make_simple.py
	$(BIN)/python tools/make_yolov8n.py

clean:
	rm -rf $(VENV) .pytest_cache
