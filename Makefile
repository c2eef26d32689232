# One-command workflows on a fresh clone. Everything lives in $(VENV).
VENV      ?= .venv
PYTHON    ?= python3
TORCH_PIN ?= torch==2.13.0
RANKS     ?= 2
SIZES     ?= 8,4K,64K,1M,16M,64M
PY        := $(VENV)/bin/python
SOURCES   := $(shell find csrc ringcomm -name '*.cc' -o -name '*.h' -o -name '*.py') setup.py pyproject.toml CMakeLists.txt

.PHONY: install test bench clean

# venv, the torch pin first (so nothing pulls a CUDA build), then the package (editable) with
# its test extras and Open MPI (the anchor `--compare mpi` runs; tests/test_bench.py uses it),
# then the torch backend's first build (ringcomm/backend.py), so no test waits for it.
$(VENV)/.installed: $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,mpi]'
	$(PY) -c 'import ringcomm.backend as b; b.load()'  # the torch backend, built once, cached
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest tests

# The main job: ringcomm vs gloo and Open MPI, $(RANKS) local ranks, with the memory floor, one run.
bench: install
	$(PY) -m ringcomm.bench --ranks $(RANKS) --sizes $(SIZES) --compare gloo,mpi --floor

clean:
	rm -rf build *.egg-info ringcomm/_C*.so
