# `make bench` and `make test` set up everything they need in .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned here (a CPU build these machines keep on disk); pyproject.toml states the supported range,
# whose newest release runs the DCP-protocol tests and the installed wheel's smoke run in a second venv.
TORCH ?= torch==2.13.0
# The newest release comes from the registry (~2.6 GB of CUDA libraries on a fresh machine); these machines'
# pip caps torch through a constraints file, lifted (PIP_CONSTRAINT) for that venv's installs alone.
NEWEST_TORCH ?= torch==2.15.0
NEWEST_VENV ?= .venv-torch-newest
NEWEST_PIP := PIP_CONSTRAINT=/dev/null $(NEWEST_VENV)/bin/python -m pip
# A clean venv for the installed wheel: the newest torch and what the wheel itself requires, nothing else.
WHEEL_VENV ?= .venv-wheel
WHEEL_PIP := PIP_CONSTRAINT=/dev/null $(WHEEL_VENV)/bin/python -m pip
WHEEL_DIR := build/wheel

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,bench,torchtitan,lint]'
	touch $@

$(NEWEST_VENV)/.installed: pyproject.toml setup.py Makefile
	rm -rf $(NEWEST_VENV) && python3 -m venv $(NEWEST_VENV)
	$(NEWEST_PIP) install -q --upgrade pip
	$(NEWEST_PIP) install -q $(NEWEST_TORCH)
	$(NEWEST_PIP) install -q -e '.[test]'
	touch $@

# The newest torch first, then ckptio's wheel as users get it (not editable), with the dependencies it names.
$(WHEEL_VENV)/.installed: pyproject.toml setup.py Makefile $(VENV)/.installed
	rm -rf $(WHEEL_VENV) && python3 -m venv $(WHEEL_VENV)
	$(WHEEL_PIP) install -q --upgrade pip
	$(WHEEL_PIP) install -q $(NEWEST_TORCH)
	$(MAKE) --no-print-directory wheel
	$(WHEEL_PIP) install -q $(WHEEL_DIR)/ckptio-*.whl
	touch $@

.PHONY: wheel test-installed
wheel: $(VENV)/.installed
	rm -rf $(WHEEL_DIR) build/lib && $(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) .

.PHONY: bench test test-fast test-slow test-torch-newest lint radosgw azurite
bench: $(VENV)/.installed
	$(VENV)/bin/ckptio bench $(ARGS)

# Lint and format checks first: seconds, and they fail before minutes of tests. radosgw's packages and
# Azurite install meanwhile (independent of the venv the lint step builds on first use). Then the main
# run (`test-fast`, within its 10-minute budget), the slow scenarios, the installed wheel, the newest torch.
test:
	@$(MAKE) --no-print-directory radosgw & $(MAKE) --no-print-directory azurite & \
	$(MAKE) --no-print-directory lint && wait && \
	$(MAKE) --no-print-directory test-fast && \
	$(MAKE) --no-print-directory test-slow && \
	$(MAKE) --no-print-directory test-installed && \
	$(MAKE) --no-print-directory test-torch-newest

# The wheel of this checkout installed (not editable) beside the newest torch, which pip must keep, and what a
# user runs first (tests/installed/user_smoke.py), from a folder outside the checkout.
test-installed: $(WHEEL_VENV)/.installed
	$(MAKE) --no-print-directory wheel
	$(WHEEL_PIP) install -q --force-reinstall --no-deps $(WHEEL_DIR)/ckptio-*.whl
	$(WHEEL_PIP) check
	@dir=$$(mktemp -d) && cp tests/installed/user_smoke.py $$dir/ && cd $$dir && \
	  CKPTIO_CHECKOUT=$(CURDIR) CKPTIO_EXPECT_TORCH=$(patsubst torch==%,%,$(NEWEST_TORCH)) $(abspath $(WHEEL_VENV))/bin/python user_smoke.py; \
	  status=$$?; rm -rf $$dir; exit $$status

# The tests marked `protocol` (plain dcp.save/load/async_save on gloo ranks, read-once, staging, resharding)
# on the newest torch release pyproject.toml admits, from this checkout's source; property tests take 25
# examples there (the main run covers their input space with 100).
test-torch-newest: $(NEWEST_VENV)/.installed
	CKPTIO_PROPERTY_EXAMPLES=25 $(NEWEST_VENV)/bin/python -m pytest -q -m "protocol and not slow" $(ARGS)

# Ceph radosgw, the production S3 server the S3 tests also run against (Debian packages, ~15 s once).
# Without root or apt-get, its tests skip and say so.
RADOSGW_PACKAGES := radosgw ceph-mon ceph-osd
APT_INSTALL_RADOSGW := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(RADOSGW_PACKAGES)
radosgw:
	@command -v radosgw >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { $(APT_INSTALL_RADOSGW) >/dev/null 2>&1 || { apt-get update -qq && $(APT_INSTALL_RADOSGW) >/dev/null; }; }; } || \
	  echo "radosgw not installed: its tests will skip (on Debian, as root: apt-get install $(RADOSGW_PACKAGES))"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# The scenarios marked slow: long multi-process runs, and the heavy store-axis ones beyond moto.
# (pytest's status 5, nothing selected, is not a failure where ARGS narrow the run.)
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow $(ARGS) || [ $$? -eq 5 ]

# Azurite, the Azure Blob emulator the Azure tests and `ckptio bench --target azure` run against (npm, ~20 s
# once, into .azurite/). Without npm, its tests skip and say so. fake-gcs-server comes with the test extra.
AZURITE_VERSION ?= 3.37.0
azurite:
	@[ -x .azurite/node_modules/.bin/azurite-blob ] || { command -v npm >/dev/null && \
	  npm install -s --no-audit --no-fund --prefix .azurite azurite@$(AZURITE_VERSION) >/dev/null; } || \
	  echo "Azurite not installed: its tests will skip (npm install --prefix .azurite azurite)"
