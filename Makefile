# foundryx: `make train` runs the quickstart, `make test` runs the tests. Both install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.foundryx-installed
QUICKSTART_DATA ?= data/quickstart

# Every pip install is tried up to 3 times, 30 s apart, and resumes a cut-off download up to 20
# times: a fresh machine downloads about 7 GB, and one connection dropped for good mid-wheel
# (CI, 2026-11-24: ziglang stuck at 54.5 of 101 MB after pip's 5 resumes) must not fail the run.
# Retrying is safe: pip install of what is already installed does nothing.
RETRY = retry() { for try in 1 2 3; do "$$@" && return 0; [ $$try = 3 ] && return 1; \
	echo "foundryx: '$$*' failed (try $$try of 3); trying again in 30 s" >&2; sleep 30; done; }; retry
RESUME := --resume-retries 20

.PHONY: install install-modern lock-modern data train train-2proc test test-pinned test-modern test-all test-fast test-long lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(RETRY) $(PY) -m pip install -q --upgrade pip
	$(RETRY) $(PY) -m pip install -q $(RESUME) -c constraints.txt -e ".[dev,pinned]"
	@# The build leaves foundryx.egg-info here; on sys.path (cwd) it would shadow the installed
	@# metadata and hide entry points added later. The editable install does not need it.
	rm -rf foundryx.egg-info
	touch $@

install: $(STAMP)

# ---------------------------------------------------------------------------------------
# The modern leg: foundryx on today's stack (torch 2.15, transformers 5), in its own venv.
# Composer 0.32.1 and mosaicml-streaming 0.13 are frozen upstream with caps foundryx does not
# share (torch < 2.7.1, transformers < 5, numpy < 2.2): foundryx's own requirements list theirs
# less those caps (pyproject.toml), so the two go in with --no-deps, exactly as a user adds
# them to an environment they already have (README, "Installing").
# constraints-modern.txt pins every package (written by `make lock-modern`: the newest releases).
# PIP_CONSTRAINT=/dev/null: a machine-wide pip constraint (this VM caps torch at 2.14.1 through
# /etc/xdg/pip) must not hold the modern leg back; the constraints file named here still applies.
# ---------------------------------------------------------------------------------------
MODERN_VENV ?= .venv-modern
MODERN_PY := $(MODERN_VENV)/bin/python
MODERN_STAMP := $(MODERN_VENV)/.foundryx-installed
MODERN_TORCH := torch==2.15.0
FROZEN := mosaicml==0.32.1 mosaicml-streaming==0.13.0
MODERN_PIP = env PIP_CONSTRAINT=/dev/null $(1)/bin/python -m pip install -q $(RESUME)

# $(call modern_install,VENV,CONSTRAINTS)
define modern_install
	$(PYTHON) -m venv $(1)
	$(RETRY) $(1)/bin/python -m pip install -q --upgrade pip
	$(RETRY) $(MODERN_PIP) -c $(2) $(MODERN_TORCH) -e ".[dev]"
	rm -rf foundryx.egg-info
	$(RETRY) $(MODERN_PIP) -c $(2) --no-deps $(FROZEN)
	@# the only broken requirements must be the frozen packages' caps (and streaming's Azure and
	@# OCI clients: foundryx[object-stores])
	! $(1)/bin/python -m pip check | grep -v -E '^mosaicml(-streaming)? [^ ]+ has requirement (torch|torchvision|transformers|numpy|packaging|pillow|tabulate|importlib-metadata)[<>=]' \
	  | grep -v -E '^mosaicml-streaming [^ ]+ requires (oci|azure-[a-z-]+), which is not installed'
	$(1)/bin/python -c 'import composer, streaming, torch, transformers; print("installed: torch", torch.__version__, "transformers", transformers.__version__, "composer", composer.__version__, "streaming", streaming.__version__)'
endef

$(MODERN_STAMP): pyproject.toml constraints-modern.txt
	$(call modern_install,$(MODERN_VENV),constraints-modern.txt)
	touch $@

install-modern: $(MODERN_STAMP)

# Rewrites constraints-modern.txt: the modern install in a scratch venv with nothing held back
# (the newest release of every package that foundryx's ranges and $(MODERN_TORCH) admit), then
# pip freeze without foundryx. Run it when torch or transformers releases, then make test-modern.
LOCK_VENV := .venv-modern-lock
lock-modern:
	rm -rf $(LOCK_VENV)
	$(call modern_install,$(LOCK_VENV),/dev/null)
	( echo "# The modern leg (make install-modern): $(MODERN_TORCH), the newest releases foundryx"; \
	  echo "# admits, Composer and streaming installed --no-deps. Written by make lock-modern: do not"; \
	  echo "# edit by hand."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v -E '^(pip|foundryx)==' \
	) > constraints-modern.txt
	rm -rf $(LOCK_VENV)

data: install
	$(VENV)/bin/foundryx data quickstart --out $(QUICKSTART_DATA)

train: data
	$(PY) train.py yamls/quickstart.yaml

train-2proc: data
	$(VENV)/bin/foundryx launch -n 2 train.py yamls/quickstart.yaml max_duration=20ba

# make test = both torch legs, each the fast set plus its share of the slow set (tests/conftest.py
# names the modern leg's share). The second leg runs even when the first fails; make test fails
# if either does.
test: install install-modern
	status=0; \
	$(MAKE) --no-print-directory test-pinned || status=$$?; \
	$(MAKE) --no-print-directory test-modern || status=$$?; \
	exit $$status

# A leg is two runs: the fast set on 2 workers (pytest-xdist: its tests are single processes, so
# a 2-core machine runs two at once; 235 s for the pinned fast set, 2026-11-29), then the leg's
# share of the slow set on one (its tests start 2-4 processes each, which fill the cores). Both
# run even when the first fails; the leg fails if either does.
FAST = -m "not slow" -n 2
test-pinned: install
	status=0; \
	$(PY) -m pytest -q $(FAST) --slow-leg=pinned --durations=15 || status=$$?; \
	$(PY) -m pytest -q -m slow --slow-leg=pinned --durations=25 || status=$$?; \
	exit $$status

test-modern: install-modern
	status=0; \
	$(MODERN_PY) -m pytest -q $(FAST) --slow-leg=modern --durations=15 || status=$$?; \
	$(MODERN_PY) -m pytest -q -m slow --slow-leg=modern --durations=25 || status=$$?; \
	exit $$status

# every test on the pinned torch (what make test splits between the legs)
test-all: install
	$(PY) -m pytest -q --durations=25

# the long form of checks make test makes in short (make test runs none of these): SIGTERM at 20
# random moments of a 2-process run (~6 min), 10 seeded kills then a bit-exact resume (~2 min),
# the rank changes of tests/test_elastic_resume.py that make test leaves out (~4 min), every
# combination of the Triton attention's mask features (128 interpreter runs; make test: a
# pairwise-covering 7); pinned torch
test-long: install
	$(PY) -m pytest -q -m long --durations=10

test-fast: install
	$(PY) -m pytest -q $(FAST)

lint: install
	$(VENV)/bin/ruff check .
	$(PY) tools/check_layers.py .

clean:
	rm -rf runs data/quickstart
