"""docs/architecture.md names modules as they are in the code, so the page cannot drift.

Every inline code span of the page that is a dotted name under one of the project's
packages (`gateway.routing`, `trainer.recipe.Recipe.setup`) must be a module of the source
tree, or a name defined at the top of one (a class, function or assignment), optionally
followed by a name defined in that class. And the other way: every module of the tree is
named on the page (its list "Every module"), so a module added, moved or removed changes
the map with it. Read from the files (ast), nothing imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
SRC_ROOTS = [
    p for layer in ("libs", "services", "apps", "tools") for p in REPO.glob(f"{layer}/*/src")
]
DOTTED = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def package_dirs() -> dict[str, Path]:
    """Top-level package name -> its folder, over every src root."""
    return {
        d.name: d for root in SRC_ROOTS for d in root.iterdir() if (d / "__init__.py").is_file()
    }


def module_file(package: Path, parts: list[str]) -> Path | None:
    """The file of module `package.parts...`, or None."""
    base = package.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def defined_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body defines: classes, functions, assigned names."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def resolves(name: str, packages: dict[str, Path]) -> bool:
    """Whether dotted `name` is a module of the tree, or a module's name (and member)."""
    top, *rest = name.split(".")
    for cut in range(len(rest), -1, -1):
        file = module_file(packages[top], rest[:cut])
        if file is None:
            continue
        attrs = rest[cut:]
        if not attrs:
            return True
        if len(attrs) > 2:
            return False
        names = defined_names(ast.parse(file.read_text()).body)
        node = names.get(attrs[0])
        if node is None:
            return False
        return len(attrs) == 1 or (
            isinstance(node, ast.ClassDef) and attrs[1] in defined_names(node.body)
        )
    return False


def test_every_module_the_architecture_page_names_exists() -> None:
    packages = package_dirs()
    named = {m for m in DOTTED.findall(PAGE.read_text()) if m.split(".")[0] in packages}
    assert len(named) > 50, "the page names the modules of a request and of a training run"
    missing = sorted(m for m in named if not resolves(m, packages))
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"


def tree_modules(packages: dict[str, Path]) -> set[str]:
    """Every module of the source tree, dotted (`trainer.loop.live`); packages' __init__
    files are their package, not a module of their own."""
    return {
        ".".join((top, *f.relative_to(folder).with_suffix("").parts))
        for top, folder in packages.items()
        for f in folder.rglob("*.py")
        if f.name != "__init__.py"
    }


def unlisted(page: str, packages: dict[str, Path]) -> list[str]:
    """The modules of the tree that `page` does not name."""
    named = set(DOTTED.findall(page))
    return sorted(tree_modules(packages) - named)


def test_every_module_of_the_tree_is_on_the_architecture_page() -> None:
    missing = unlisted(PAGE.read_text(), package_dirs())
    assert not missing, (
        f"docs/architecture.md does not name {missing}: add each to its package's list under"
        ' "Every module" (what it owns, one line) and, where a newcomer would look for it,'
        ' to the "Where to change what" table'
    )


def test_a_module_left_off_the_page_is_caught() -> None:
    packages = package_dirs()
    page = PAGE.read_text()
    assert "trainer.setup_steps" in tree_modules(packages)
    assert "trainer.setup_steps" in unlisted(page.replace("`trainer.setup_steps`", ""), packages)


def test_a_name_the_code_does_not_have_is_caught() -> None:
    packages = package_dirs()
    assert resolves("trainer.recipe.Recipe.setup", packages)
    assert resolves("lorastack.store.labels", packages)
    assert not resolves("trainer.recipe.Recipe.parts", packages)
    assert not resolves("gateway.no_such_module", packages)
    assert not resolves("trainer.loop.no_such_name", packages)
