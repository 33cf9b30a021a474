"""The layers import only downwards: core <- services <- app; core <- tools.

    libs/lorastack       core: settings, store, manifests, errors, logging, command host
    services/<svc>       trainer, merger, inference, gateway: the core only, never each other
    apps/lorastack       the `lorastack` app: the core and the services
    tools/evaluation     eval, loadtest, cost: the core only (the stack over HTTP and the store)
    libs/testing         test support (the fake vLLM, free_port): the core only

Every import statement in every source module counts, also those inside functions (the
lazy imports that keep `lorastack --help` fast), so an upward arrow cannot hide in one.
A package's own tests (its `tests/` folder) keep to the same layers, with the test support
besides; a test of two services together lives in the repository's `tests/`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = {"lorastack"}
SERVICES = {"trainer", "merger", "inference", "gateway"}
TESTING = "lorastack_testing"
PACKAGES = {
    # import name: (source folder, first-party packages it may import besides itself)
    "lorastack": ("libs/lorastack/src", set()),
    **{s: (f"services/{s}/src", CORE) for s in SERVICES},
    "lorastack_app": ("apps/lorastack/src", CORE | SERVICES),
    "evaluation": ("tools/evaluation/src", CORE),
    TESTING: ("libs/testing/src", CORE),  # test support: tests and bench only
}
FIRST_PARTY = set(PACKAGES)


def imported_packages(path: Path) -> dict[str, int]:
    """First-party top-level packages `path` imports, with the first line of each."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                found.setdefault(top, node.lineno)
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_points_upward_or_sideways(package: str) -> None:
    folder, allowed = PACKAGES[package]
    modules = sorted((REPO / folder / package).rglob("*.py"))
    assert modules, f"no modules under {folder}/{package}"
    wrong = [
        f"{m.relative_to(REPO)}:{line} imports {top}"
        for m in modules
        for top, line in imported_packages(m).items()
        if top != package and top not in allowed
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(set(PACKAGES) - {TESTING}))
def test_a_package_s_tests_keep_to_its_layer(package: str) -> None:
    folder, allowed = PACKAGES[package]
    tests = REPO / Path(folder).parent / "tests"
    modules = sorted(tests.rglob("*.py"))
    assert modules, f"no tests under {tests.relative_to(REPO)}"
    wrong = [
        f"{m.relative_to(REPO)}:{line} imports {top}"
        for m in modules
        for top, line in imported_packages(m).items()
        if top not in {package, TESTING} | allowed
    ]
    assert not wrong, (
        "tests against the layering (a test of two packages together goes to tests/):\n"
        + "\n".join(wrong)
    )


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from trainer.recipe import Recipe\n")
    assert imported_packages(module) == {"trainer": 4}
