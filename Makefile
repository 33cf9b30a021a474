# lorastack: the two commands of the README are `make demo` and `make test`;
# `make test-compose` runs the compose walk in Docker (CI runs it after `make test`).
# Both build .venv/ first when the pinned requirement files changed.
VENV := .venv
STAMP := $(VENV)/.installed
# pyproject.toml too: the entry points that give `lorastack` its subcommands live there.
REQS := constraints.txt scripts/setup.sh $(wildcard requirements/*.txt) \
        $(wildcard libs/*/requirements.txt services/*/requirements.txt apps/*/requirements.txt \
                   tools/*/requirements.txt) \
        $(wildcard libs/*/pyproject.toml services/*/pyproject.toml apps/*/pyproject.toml \
                   tools/*/pyproject.toml)

.PHONY: setup demo test test-compose lint images push-images
setup: $(STAMP)

$(STAMP): $(REQS)
	scripts/setup.sh

demo: $(STAMP)
	$(VENV)/bin/lorastack demo

test: $(STAMP)
	scripts/test.sh

# Needs root (it installs and starts Docker where missing) and ~20 GB of disk.
test-compose: $(STAMP)
	scripts/test-compose.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

# The images under one tag (deploy/images.sh): make images push-images REGISTRY=... TAG=...
images:
	deploy/images.sh build

push-images:
	deploy/images.sh push
