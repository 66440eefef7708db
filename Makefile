# torchtpu: `make demo` trains a small GPT on device "tpu"; `make test` runs the test suite.
# Both create and use a local virtualenv (.venv) on first use.

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where pip finds torch. Empty: pip's configured index. For a CPU-only wheel from the PyTorch
# index (instead of PyPI's CUDA build) use: make TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# Extra dependency sets of torchtpu to install: tpu (jax[tpu]) or cuda (jax[cuda12]), e.g.
# make demo EXTRAS=tpu
EXTRAS  ?=
comma   := ,
PYTEST_ARGS ?=
TESTS   ?= tests
DEMO_ARGS ?= --steps 200 --layers 2 --embd 96 --heads 4 --batch-size 16 --seq-len 64 --log-every 10 --sample 160
STAMP   := $(VENV)/.torchtpu-installed$(if $(EXTRAS),-$(EXTRAS))

.PHONY: all venv venv-sglang demo demo-cpu test bench clean help

all: help

help:
	@echo "make demo       train a small GPT on device tpu (creates $(VENV) if needed)"
	@echo "make demo-cpu   the same run on PyTorch CPU eager, for comparison"
	@echo "make test       run the test suite"
	@echo "make bench      per-op eager overhead: tpu vs PyTorch CPU vs raw JAX"
	@echo "make venv       only create $(VENV) and install torchtpu (editable) into it"
	@echo "make venv-sglang create $(SGLANG_VENV): SGLang $(SGLANG_VERSION) + torchtpu, for tests/test_sglang*.py"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[test$(if $(EXTRAS),$(comma)$(EXTRAS))]"
	@touch $@

# SGLang gets its own virtualenv (its pins are not ours to impose on .venv). `pip install
# sglang` hard-requires CUDA wheels (flashinfer, cuda-python, sglang-kernel...), so SGLang is
# installed with --no-deps plus the pure-Python packages it imports. Its torch pin comes with
# the torchvision that SGLang imports at module level (torch 2.14.1 and torchvision 0.29.1 for
# SGLang 0.5.23). Everything else (jax, numpy, fastapi...) is reused from $(VENV) through a
# .pth file naming its site-packages, found at build time; the venv's own packages come first.
SGLANG_VENV    ?= .venv-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_PINS    ?= torch==2.14.1 torchvision==0.29.1
SGLANG_DEPS    ?= transformers==5.19.0 tokenizers==0.23.2 "huggingface-hub>=1.5,<2" \
                  "kernels>=0.14.1,<0.15" openai==2.8.0 orjson pybase64 msgspec pyzmq \
                  uvloop ipython traitlets "python-dateutil<3" soundfile==0.13.1 partial_json_parser \
                  prometheus-client python-multipart setproctitle sentencepiece==0.2.1 \
                  tiktoken interegular apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 \
                  xgrammar==0.2.7 loguru gguf jsonschema jsonschema-specifications referencing \
                  rpds-py cffi pycparser pytest
SGLANG_PY      := $(SGLANG_VENV)/bin/python
SGLANG_STAMP   := $(SGLANG_VENV)/.torchtpu-sglang-installed
# What .venv-sglang builds on (empty: an existing $(VENV), left as it is)
SGLANG_BASE_STAMP ?= $(STAMP)

venv-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(SGLANG_BASE_STAMP) Makefile pyproject.toml
	@test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  "$$($(SGLANG_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torchtpu-base-venv.pth"
	$(SGLANG_PY) -m pip install $(SGLANG_PINS)
	$(SGLANG_PY) -m pip install --no-deps "sglang==$(SGLANG_VERSION)" $(SGLANG_DEPS)
	$(SGLANG_PY) -m pip install --no-deps -e .
	SGLANG_PLATFORM=tpu $(SGLANG_PY) -c "import sglang, torch; from sglang.srt.entrypoints.engine import Engine; from sglang.srt.platforms import current_platform as p; print('sglang', sglang.__version__, 'torch', torch.__version__, p, 'ready in $(SGLANG_VENV)')"
	@touch $@

demo: $(STAMP)
	$(PY) examples/train_gpt.py --device tpu $(DEMO_ARGS)

demo-cpu: $(STAMP)
	$(PY) examples/train_gpt.py --device cpu $(DEMO_ARGS)

test: $(STAMP) $(SGLANG_STAMP)
	$(PY) -m pytest $(TESTS) -q --durations=25 $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/eager_overhead.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
