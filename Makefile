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

.PHONY: install install-modern lock-modern data train train-2proc test test-pinned test-modern test-all test-fast lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(RETRY) $(PY) -m pip install -q --upgrade pip
	$(RETRY) $(PY) -m pip install -q $(RESUME) -c constraints.txt -e ".[dev]"
	@# The build leaves foundryx.egg-info here; on sys.path (cwd) it would shadow the installed
	@# metadata and hide entry points added later. The editable install does not need it.
	rm -rf foundryx.egg-info
	touch $@

install: $(STAMP)

# ---------------------------------------------------------------------------------------
# The modern leg: foundryx on a current torch, in its own venv. Composer 0.32.1 pins
# torch < 2.7.1, so it is installed with --no-deps and its other requirements are listed here
# (from its METADATA). foundryx itself goes in with --no-deps too, then its requirements less
# Composer: pip would otherwise resolve Composer's pins again and bring torch 2.7 back.
# constraints-modern.txt pins every package (written by `make lock-modern`).
# ---------------------------------------------------------------------------------------
MODERN_VENV ?= .venv-modern
MODERN_PY := $(MODERN_VENV)/bin/python
MODERN_STAMP := $(MODERN_VENV)/.foundryx-installed
MODERN_TORCH := torch==2.14.1 torchvision==0.29.1
COMPOSER := mosaicml==0.32.1
COMPOSER_REQUIREMENTS := "pyyaml>=6.0,<7" "tqdm>=4.62.3,<5" "torchmetrics>=1.0,<1.7.5" \
	"torch_optimizer>=0.3.0,<0.4" "requests>=2.26.0,<3" "numpy>=1.21.5,<2.3.0" "psutil>=5.8.0,<8" \
	"coolname>=1.1.0,<3" "tabulate==0.9.0" "py-cpuinfo>=8.0.0,<10" "packaging>=21.3.0,<25.1" \
	"importlib-metadata>=5.0.0,<9" "mosaicml-cli>=0.5.25,<0.8" "pillow>=10.3.0,<12"
# foundryx's requirements (with the dev extra) but Composer, one a line, from its installed metadata
FOUNDRYX_REQUIREMENTS := import importlib.metadata as m; from packaging.requirements import Requirement; \
	reqs = [Requirement(r) for r in m.requires("foundryx")]; \
	print(*[str(r).split(";")[0] for r in reqs if r.name != "mosaicml" and (not r.marker or r.marker.evaluate({"extra": "dev"}))], sep="\n")

# $(call modern_install,VENV,CONSTRAINTS)
define modern_install
	$(PYTHON) -m venv $(1)
	$(RETRY) $(1)/bin/python -m pip install -q --upgrade pip
	$(RETRY) $(1)/bin/python -m pip install -q $(RESUME) -c $(2) $(MODERN_TORCH) $(COMPOSER_REQUIREMENTS)
	$(RETRY) $(1)/bin/python -m pip install -q $(RESUME) -c $(2) --no-deps $(COMPOSER)
	$(RETRY) $(1)/bin/python -m pip install -q $(RESUME) -c $(2) --no-deps -e ".[dev]"
	rm -rf foundryx.egg-info
	$(1)/bin/python -c '$(FOUNDRYX_REQUIREMENTS)' > $(1)/foundryx-requirements.txt
	$(RETRY) $(1)/bin/python -m pip install -q $(RESUME) -c $(2) $(MODERN_TORCH) -r $(1)/foundryx-requirements.txt
	rm -rf foundryx.egg-info
	@# the only broken requirements must be Composer's torch and torchvision pins
	! $(1)/bin/python -m pip check | grep -v -E '^mosaicml [^ ]+ has requirement (torch|torchvision)[<>=]'
	$(1)/bin/python -c 'import composer, torch, torchvision; print("installed: torch", torch.__version__, "torchvision", torchvision.__version__, "composer", composer.__version__)'
endef

$(MODERN_STAMP): pyproject.toml constraints-modern.txt
	$(call modern_install,$(MODERN_VENV),constraints-modern.txt)
	touch $@

install-modern: $(MODERN_STAMP)

# Rewrites constraints-modern.txt: the modern install in a scratch venv, constrained by
# constraints.txt less the torch stack (so the two legs differ in torch, torchvision, triton and
# the CUDA libraries, and in what those force), then pip freeze without foundryx.
LOCK_VENV := .venv-modern-lock
lock-modern:
	rm -rf $(LOCK_VENV)
	mkdir -p $(LOCK_VENV)
	grep -v -E '^(torch|torchvision|triton|nvidia-[a-z0-9-]+)==' constraints.txt > $(LOCK_VENV)/seed.txt
	$(call modern_install,$(LOCK_VENV),$(LOCK_VENV)/seed.txt)
	( echo "# The modern leg (make install-modern): torch 2.14.1 with Composer 0.32.1 installed"; \
	  echo "# --no-deps. Written by make lock-modern: do not edit by hand."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v -E '^(pip|foundryx)==' \
	) > constraints-modern.txt
	rm -rf $(LOCK_VENV)

data: install
	$(VENV)/bin/foundryx data quickstart --out $(QUICKSTART_DATA)

train: data
	$(PY) train.py yamls/quickstart.yaml

train-2proc: data
	$(VENV)/bin/composer -n 2 train.py yamls/quickstart.yaml max_duration=20ba

# make test = both torch legs, each the fast set plus its share of the slow set (tests/conftest.py
# names the modern leg's share). The second leg runs even when the first fails; make test fails
# if either does.
test: install install-modern
	status=0; \
	$(MAKE) --no-print-directory test-pinned || status=$$?; \
	$(MAKE) --no-print-directory test-modern || status=$$?; \
	exit $$status

test-pinned: install
	$(PY) -m pytest -q --slow-leg=pinned --durations=25

test-modern: install-modern
	$(MODERN_PY) -m pytest -q --slow-leg=modern --durations=25

# every test on the pinned torch (what make test splits between the legs)
test-all: install
	$(PY) -m pytest -q --durations=25

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs data/quickstart
