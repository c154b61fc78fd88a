# Entry points for people and CI; every target calls scripts/ci.py (see README "Setup and tests").
# Venvs live in .venvs/ (override with KERNELBAY_VENVS): .venvs/_shared holds the third-party
# packages once; every job gets a fresh .venvs/<job> with our packages built as wheels.
PYTHON ?= python3
CI := $(PYTHON) scripts/ci.py

.PHONY: demo test lint setup jobs gha clean

## set up everything and run the kernelbay demo
demo:
	$(CI) demo

## set up everything and run the whole job matrix (lint first); what .ci/run and CI call
test:
	$(CI) setup && $(CI) run --all

## only the lint job (ruff + mypy)
lint:
	$(CI) setup && $(CI) run lint

setup:
	$(CI) setup

jobs:
	$(CI) jobs

## regenerate .github/workflows/ci.yml from the job matrix
gha:
	$(CI) gha --write

clean:
	rm -rf .venvs .cache/demo-checkpoint
