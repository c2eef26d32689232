# One-command workflows on a fresh clone. Everything lives in $(VENV).
VENV      ?= .venv
PYTHON    ?= python3
TORCH_PIN ?= torch==2.13.0
RANKS     ?= 2
SIZES     ?= 8,4K,64K,1M,16M,64M
PY        := $(VENV)/bin/python
SOURCES   := $(shell find csrc ringcomm -name '*.cc' -o -name '*.h' -o -name '*.py') setup.py pyproject.toml CMakeLists.txt

.PHONY: install test lint bench docs fuzz sanitize clean

# venv, the torch pin first (so nothing pulls a CUDA build), then the package (editable) with
# its test extras and Open MPI (the anchor `--compare mpi` runs; tests/test_bench.py uses it),
# then the torch backend's first build (ringcomm/backend.py), so no test waits for it.
$(VENV)/.installed: $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,mpi,lint]'
	$(PY) -c 'import ringcomm.backend as b; b.load()'  # the torch backend, built once, cached
	touch $@

install: $(VENV)/.installed

# Two workers, each test module on one of them (its module fixtures built once), and the tests
# marked serial (pytest.ini: they need the machine to themselves) alone afterwards. One worker
# waits most of its time (timeouts, launches): on 2 cores it used 65% of one, 750 s. Two took
# 579-615 s in all; three took longer than two, and tests that time an idle CPU failed.
TEST_WORKERS ?= 2
test: install
	rc=0; \
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m 'not serial' --durations=30 || rc=1; \
	$(PY) -m pytest tests -m serial --durations=5 || rc=1; \
	exit $$rc

# Python through ruff (pyproject.toml), C++ and CUDA through clang-format (.clang-format).
CXX_SOURCES = $(shell git ls-files 'csrc/*.cc' 'csrc/*.h' 'csrc/*.cu' 'tests/native/*.cc' 'fuzz/*.cc' 'bench/*.cc')
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)

# The main job: ringcomm vs gloo and Open MPI, $(RANKS) local ranks, with the memory floor, one run.
bench: install
	$(PY) -m ringcomm.bench --ranks $(RANKS) --sizes $(SIZES) --compare gloo,mpi --floor

# docs/configuration.md's environment section, from the core's table of knobs (csrc/common/knobs.cc);
# tests/test_knobs.py fails while the page differs from it.
docs: install
	$(PY) -m ringcomm._knobs --write docs/configuration.md

# Fuzzing (docs/reliability.md): every fuzz/<target>.cc, built by clang under ASan + UBSan in
# $(FUZZ_BUILD) (not the package), runs $(FUZZ_RUNS) inputs from its seeds in fuzz/corpus/<target>/;
# what it finds new goes to $(FUZZ_BUILD)/corpus/<target>/, a crashing input to
# $(FUZZ_BUILD)/<target>-crash-*, its output to $(FUZZ_BUILD)/<target>.log. Fails if any crashed.
FUZZ_BUILD   ?= build/fuzz
FUZZ_RUNS    ?= 1000000
FUZZ_CC      ?= clang-14
FUZZ_CXX     ?= clang++-14
FUZZ_FLAGS   ?= -rss_limit_mb=2048 -malloc_limit_mb=2048
FUZZ_TARGETS ?= $(basename $(notdir $(wildcard fuzz/*.cc)))

fuzz:
	CC=$(FUZZ_CC) CXX=$(FUZZ_CXX) cmake -S . -B $(FUZZ_BUILD) -DRINGCOMM_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(FUZZ_BUILD) -j 2 --target $(FUZZ_TARGETS)
	@failed=0; for t in $(FUZZ_TARGETS); do \
	  log=$(FUZZ_BUILD)/$$t.log; mkdir -p $(FUZZ_BUILD)/corpus/$$t; \
	  $(FUZZ_BUILD)/$$t -runs=$(FUZZ_RUNS) $(FUZZ_FLAGS) -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/$$t- $(FUZZ_BUILD)/corpus/$$t \
	    $$(test -d fuzz/corpus/$$t && echo fuzz/corpus/$$t) >$$log 2>&1 || failed=1; \
	  echo "$$t: $$(sed -n 's/^stat::number_of_executed_units: *//p' $$log) inputs," \
	    "$$(grep -c 'Test unit written to' $$log) crashes," \
	    "$$(sed -n 's/^stat::average_exec_per_sec: *//p' $$log) exec/s," \
	    "$$(grep -o 'cov: [0-9]*' $$log | tail -1) (log: $$log)"; \
	done; exit $$failed

# Sanitizers (docs/reliability.md): the core and ringcomm._C built with ASan+UBSan, then TSan,
# each into $(SANITIZE_BUILD)-<kind>/ringcomm beside a copy of the Python package, and the
# multi-process tests run against it (python -P: the copy, not the source tree, is imported) with
# the sanitizer's runtime preloaded into Python (which is not instrumented: leaks are not checked,
# and TSan ignores what uninstrumented code does).
# A report fails the rank that hit it, and so the test.
SANITIZE_BUILD ?= build/sanitize
SANITIZE_KINDS ?= address thread
SANITIZE_TESTS ?= tests/test_collectives.py tests/test_all_reduce.py tests/test_errors.py \
                  tests/test_shm.py tests/test_sparse.py tests/test_fusion.py \
                  tests/test_handshake.py tests/test_callbacks.py tests/test_soak.py
SANITIZE_address = address,undefined
SANITIZE_thread  = thread
# With libstdc++ preloaded too: Python does not link it, and the sanitizer must find its
# __cxa_throw when it starts.
RUNTIME_address  = "$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)"
RUNTIME_thread   = "$$(g++ -print-file-name=libtsan.so) $$(g++ -print-file-name=libstdc++.so)"
SANITIZE_ENV     = ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
                   TSAN_OPTIONS=halt_on_error=1:abort_on_error=1:ignore_noninstrumented_modules=1:report_signal_unsafe=0

sanitize: install
	$(PY) -m pip install -q "$$(sed -n 's/.*"\(pybind11[^"]*\)".*/\1/p' pyproject.toml | head -1)"
	@set -e; for kind in $(SANITIZE_KINDS); do \
	  dir=$(SANITIZE_BUILD)-$$kind; mkdir -p $$dir/ringcomm; \
	  case $$kind in address) flags="$(SANITIZE_address)"; runtime=$(RUNTIME_address);; \
	                 thread) flags="$(SANITIZE_thread)"; runtime=$(RUNTIME_thread);; esac; \
	  cmake -S . -B $$dir/cmake -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRINGCOMM_SANITIZE=$$flags \
	    -DPython_EXECUTABLE=$(abspath $(PY)) -Dpybind11_DIR=$$($(PY) -c 'import pybind11; print(pybind11.get_cmake_dir())') \
	    -DCMAKE_LIBRARY_OUTPUT_DIRECTORY=$(abspath $(SANITIZE_BUILD))-$$kind/ringcomm >/dev/null; \
	  cmake --build $$dir/cmake --target _C; \
	  cp -r ringcomm/*.py ringcomm/hooks ringcomm/bench $$dir/ringcomm/; \
	  echo "== $$kind: $(SANITIZE_TESTS)"; \
	  PYTHONPATH=$(abspath $(SANITIZE_BUILD))-$$kind LD_PRELOAD="$$runtime" $(SANITIZE_ENV) \
	    $(PY) -P -m pytest -p no:cacheprovider $(SANITIZE_TESTS); \
	done

clean:
	rm -rf build *.egg-info ringcomm/_C*.so
