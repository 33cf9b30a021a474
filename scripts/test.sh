#!/usr/bin/env bash
# The README's test command runs this: lint, format check, type check, then every test.
# Extra arguments go to pytest (e.g. scripts/test.sh -k store -x; -n 0: one process).
# Two processes (pytest-xdist), a test file each at a time (conftest.py): the suite spends
# much of its time starting processes and waiting on them, half a 2-core machine idle.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -n "${LORASTACK_TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder "$@"
