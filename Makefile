# foundryx: `make train` runs the quickstart, `make test` runs the tests. Both install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.foundryx-installed
QUICKSTART_DATA ?= data/quickstart

.PHONY: install data train train-2proc test test-fast lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	@# The build leaves foundryx.egg-info here; on sys.path (cwd) it would shadow the installed
	@# metadata and hide entry points added later. The editable install does not need it.
	rm -rf foundryx.egg-info
	touch $@

install: $(STAMP)

data: install
	$(VENV)/bin/foundryx data quickstart --out $(QUICKSTART_DATA)

train: data
	$(PY) train.py yamls/quickstart.yaml

train-2proc: data
	$(VENV)/bin/composer -n 2 train.py yamls/quickstart.yaml max_duration=20ba

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs data/quickstart
