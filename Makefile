# lorastack: the two commands of the README are `make demo` and `make test`.
# Both build .venv/ first when the pinned requirement files changed.
VENV := .venv
STAMP := $(VENV)/.installed
REQS := constraints.txt $(wildcard requirements/*.txt) $(wildcard services/*/requirements.txt) \
        libs/lorastack/requirements.txt scripts/setup.sh

.PHONY: setup demo test lint
setup: $(STAMP)

$(STAMP): $(REQS)
	scripts/setup.sh

demo: $(STAMP)
	$(VENV)/bin/lorastack demo

test: $(STAMP)
	scripts/test.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy
