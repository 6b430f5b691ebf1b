# Two entry points for a fresh machine: `make demo` (the main job on a built-in model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_DIR ?= out/demo
# llama.cpp (the parity reference) builds from source in ~4 minutes on 2 cores; pip caches the wheel.
LLAMA_CPP_ARGS ?= -DGGML_NATIVE=OFF

.PHONY: venv native parity simde test avx512-emulated demo serve lint clean

$(VENV)/.installed: requirements.txt requirements-test.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt -r requirements-test.txt
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

venv: $(VENV)/.installed

native: venv
	$(PY) setup.py -q build_ext --inplace

$(VENV)/.parity: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CPP_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(PIP) install -q llama-cpp-python==0.3.36 \
		|| echo "warning: llama-cpp-python did not install; llama.cpp parity tests will be skipped"
	touch $@

parity: $(VENV)/.parity

# SIMDe (header-only) lets the C++ tests run the VNNI kernels on a CPU without VNNI.
simde:
	@test -f /usr/include/simde/x86/avx512/dpbusd.h || apt-get install -y -q libsimde-dev >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q libsimde-dev >/dev/null) \
		|| echo "warning: libsimde-dev did not install; the emulated VNNI kernel test will not run"

test: venv native parity simde
	$(PY) -m pytest -q --timeout=1800 tests

# The C++ kernel tests on an emulated AVX-512 VNNI CPU (Bochs; minutes; not part of `make test`).
avx512-emulated:
	scripts/avx512_emulated/check.sh

# The built-in demo model (pocketmoe/data/demo-model.gguf): a plain completion and a chat turn, then how to serve it.
demo: venv native
	$(PY) -m pocketmoe.demo

# The OpenAI-compatible server on 127.0.0.1:8000 (the demo model unless SERVE_ARGS has --model PATH).
SERVE_ARGS ?=
serve: venv native
	$(PY) -m pocketmoe.serve $(SERVE_ARGS)

lint: venv
	$(VENV)/bin/ruff check pocketmoe tests scripts

clean:
	rm -rf build $(VENV) out pocketmoe/_native*.so
