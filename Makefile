# The two commands of the README. Each does all the set-up on a fresh machine (Python 3.11,
# Java 17+ and Maven on PATH): a virtualenv, the package with its pinned dependencies, then the
# job. The Kafka broker's jars are fetched by Maven on first use into ~/.cache/surge/kafka.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

.PHONY: demo test lint
demo: $(STAMP)
	$(VENV)/bin/surge demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=25
