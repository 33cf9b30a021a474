"""Every shell block of the docs runs as written, or says why not and is checked as far as it can.

The blocks without a marker (tests/docs_pages.py) of one page run in one bash session, in
the page's order as a reader follows it, in a folder that looks like a fresh checkout (the
repository's top-level entries linked in, nothing of a run written back), with a
LORASTACK_HOME and a HOME of their own and `.venv/bin` on PATH. Each command must exit 0
(EXPECTED_RC says where another code is the verdict), and in a ```console block the output
lines the page shows after a `$ ` command must appear in its output, in that order (`...`
stands for lines left out). The embedded base model's conversion is lent from the test
cache (`lorastack model import-default` finds it done, as a second run would), so the
command still publishes it but takes seconds.

A marked block is checked without running: `make` targets exist in the Makefile; `docker
compose` profiles and services exist in compose.yaml and the `/config/...` files it names
exist in deploy/config/ and parse against their model; `kubectl -k/-f` paths exist;
`torchrun ... -m lorastack.cli ...` is a `lorastack` command like any other (subcommands and
flags: tests/test_docs_commands.py); every config file a `lorastack` line names (a path of
the repository, or one the docs copied out of it) parses against its model (run config,
serve config), and `lorastack serve|up` with one runs `lorastack serve CONFIG --check`.
URLs, ports and endpoints are tests/test_docs_names.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from docs_pages import (
    MARKER,
    NEEDS,
    REPO,
    Block,
    Command,
    blocks,
    commands,
    pages,
    shell_blocks,
    split_commands,
)

# Commands whose documented verdict may be another exit code than 0, and why.
EXPECTED_RC = {
    "lorastack doctor": {0, 1},  # 1: a check failed in this environment (its verdict)
}
DONE = "@@docs-test-done"


def test_every_fence_says_its_language() -> None:
    bare = [b.where for p in pages() for b in blocks(p) if not b.lang]
    assert not bare, f"a fence without a language (```sh, ```text, ```yaml ...): {bare}"


def test_every_marker_is_one_the_test_knows() -> None:
    problems = []
    for page in pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if "docs-test" not in line:
                continue
            marker = MARKER.fullmatch(line.strip())
            block = next((b for b in blocks(page) if b.line == number + 1), None)
            where = f"{page.relative_to(REPO)}:{number}"
            if marker is None or block is None:
                problems.append(f"{where}: a docs-test marker belongs on the line above a fence")
                continue
            needs = block.needs
            if marker[1] != "synopsis" and (not needs or set(needs) - set(NEEDS)):
                problems.append(
                    f"{where}: {marker[1]!r}: say 'synopsis' or 'needs' {sorted(NEEDS)}"
                )
    assert not problems, "\n".join(problems)


def runnable() -> list[tuple[str, list[Block]]]:
    """(page, its blocks without a marker) for each page that has any."""
    out: dict[str, list[Block]] = {}
    for block in shell_blocks():
        if block.runs:
            out.setdefault(str(block.page.relative_to(REPO)), []).append(block)
    return list(out.items())


def test_the_docs_have_blocks_that_run() -> None:
    assert "README.md" in dict(runnable()), "the README's path runs (its first part at least)"


def checkout(root: Path) -> Path:
    """A folder that reads like the repository's root: its entries linked in."""
    work = root / "checkout"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {".git", ".cache"}:
            (work / entry.name).symlink_to(entry)
    return work


def lend_the_conversion(home: Path, embedded_model: Path) -> None:
    """The folder `lorastack model import-default` converts the GGUF into, as a first run
    leaves it (lorastack.base_model.import_default), hard-linked from the test cache."""
    from lorastack.base_model import find_default_gguf
    from lorastack.manifest import sha256_file

    out = home / "models" / f"smollm2-135m-instruct-{sha256_file(find_default_gguf())[:12]}"
    out.mkdir(parents=True)
    for f in embedded_model.iterdir():
        os.link(f, out / f.name)


def script(cmds: list[Command]) -> str:
    lines = []
    for i, c in enumerate(cmds):
        lines += [c.text, f'printf "\\n{DONE} {i} %s\\n" "$?"']
    return "\n".join(lines) + "\n"


def shows(output: str, expected: tuple[str, ...]) -> str | None:
    """None when `expected` (`...` = lines left out) appear in `output` in order, else the
    first line that does not."""
    got = [" ".join(line.split()) for line in output.splitlines()]
    at = 0
    for want in expected:
        want = " ".join(want.split())
        if want in ("...", "…"):
            continue
        while at < len(got) and got[at] != want:
            at += 1
        if at == len(got):
            return want
        at += 1
    return None


@pytest.mark.parametrize("page,runs", runnable(), ids=[page for page, _ in runnable()])
def test_the_shell_blocks_of_a_page_run_as_written(
    page: str, runs: list[Block], tmp_path: Path, embedded_model: Path
) -> None:
    problems = run_session([c for b in runs for c in commands(b)], tmp_path, embedded_model)
    assert not problems, "\n".join(problems)


def run_session(cmds: list[Command], tmp_path: Path, embedded_model: Path | None) -> list[str]:
    """Run `cmds` in one bash session as the module docstring says; what went wrong."""
    home = tmp_path / "lorastack-home"
    if embedded_model is not None:
        lend_the_conversion(home, embedded_model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")}
    env |= {
        "LORASTACK_HOME": str(home),
        "HOME": str(tmp_path / "user"),
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
    }
    (tmp_path / "user").mkdir()
    done = subprocess.run(
        ["bash", "-c", script(cmds)],
        cwd=checkout(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    parts = re.split(rf"\n{DONE} (\d+) (\d+)\n", "\n" + done.stdout)
    outputs = {int(parts[i]): (parts[i - 1], int(parts[i + 1])) for i in range(1, len(parts), 3)}
    problems = []
    for i, c in enumerate(cmds):
        if i not in outputs:
            return [*problems, f"{c.where}: `{c.text}` did not end\n{done.stderr[-3000:]}"]
        out, rc = outputs[i]
        if rc not in EXPECTED_RC.get(" ".join(c.words), {0}):
            problems.append(f"{c.where}: `{c.text}` exit {rc}\n{out[-3000:]}\n{done.stderr}")
        if (missing := shows(out, c.output)) is not None:
            problems.append(f"{c.where}: `{c.text}` did not print {missing!r}:\n{out}")
    if "Traceback" in done.stderr:
        problems.append(done.stderr)
    return problems


# --- what a marked block can be checked for without running it


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, flags=re.M))


def compose_file() -> dict[str, dict[str, dict[str, object]]]:
    data: dict[str, dict[str, dict[str, object]]] = yaml.safe_load(
        (REPO / "compose.yaml").read_text()
    )
    return data


def config_loader(subcommand: list[str], path: Path) -> str:
    """What parses the config file a command names ('' when the command takes none)."""
    if subcommand[:1] in (["serve"], ["up"]) or path.name.startswith("serve"):
        return "serve"
    if subcommand[:1] in (["train"], ["data"]):
        return "run"
    return ""


def parse_config(kind: str, path: Path) -> None:
    if kind == "serve":
        from inference.settings import load_serve_config

        load_serve_config(path)
    elif kind == "run":
        from trainer.config import load_config

        load_config(path)


def lorastack_words(words: list[str]) -> list[str] | None:
    """The words after `lorastack` (or `python -m lorastack.cli`, torchrun's form)."""
    for i, word in enumerate(words):
        if Path(word).name == "lorastack":
            return words[i + 1 :]
        if word == "lorastack.cli" and i and words[i - 1] == "-m":
            return words[i + 1 :]
    return None


@cache
def copied() -> dict[str, Path]:
    """Files the docs copy out of the repository into the reader's folder (`cp SRC .`), by
    the name a later command gives them."""
    out = {}
    for block in shell_blocks():
        for c in commands(block):
            for words in split_commands(c.words):
                if words[0] == "cp" and words[-1] == "." and len(words) == 3:
                    out[Path(words[1]).name] = REPO / words[1]
    return out


def config_paths(words: list[str]) -> list[Path]:
    """The config files a command names that the repository ships: a repository path, a
    file the docs copied out of it, and in a container /config/..., which compose mounts
    from deploy/config."""
    out = []
    for word in words:
        if not re.search(r"\.ya?ml$", word) or re.search(r"[A-Z$<]", word):
            continue
        if word.startswith("/config/"):
            out.append(REPO / "deploy/config" / word.removeprefix("/config/"))
        elif "/" in word:
            out.append(REPO / word)
        elif word in copied():
            out.append(copied()[word])
    return out


# docker compose's options that take a value (the global ones and run/exec's)
COMPOSE_VALUED = {"--profile", "-f", "--file", "-p", "--project-name", "--env-file", "-e",
                  "--env", "-u", "--user", "-w", "--workdir", "--name", "-v", "--volume"}  # fmt: skip


def positionals(words: list[str]) -> list[str]:
    """The words of a docker compose command that are no option or an option's value."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in COMPOSE_VALUED:
            skip = True
        elif not word.startswith("-"):
            out.append(word)
    return out


def check_command(c: Command, block: Block) -> list[str]:
    problems: list[str] = []
    for words in split_commands(c.words):
        tool = Path(words[0]).name
        if tool == "make":
            missing = [w for w in words[1:] if "=" not in w and w not in make_targets()]
            problems += [f"make has no target {w!r}" for w in missing]
        if words[:2] == ["docker", "compose"]:
            compose = compose_file()
            profiles = {p for s in compose["services"].values() for p in s.get("profiles", [])}  # type: ignore[attr-defined]
            for i, w in enumerate(words):
                if w == "--profile" and words[i + 1] not in profiles:
                    problems.append(f"compose.yaml has no profile {words[i + 1]!r}")
            verb, *rest = positionals(words[2:]) or [""]
            if verb in {"run", "exec", "logs", "up", "build"}:
                named = rest[:1] if verb in {"run", "exec"} else rest
                problems += [
                    f"compose.yaml has no service {s!r}"
                    for s in named
                    if s not in compose["services"]
                ]
        if tool == "kubectl":
            for i, w in enumerate(words):
                if w in ("-k", "-f") and not (REPO / words[i + 1]).exists():
                    problems.append(f"no {words[i + 1]}")
        rest = lorastack_words(words)
        if rest is None:
            continue
        for path in config_paths(rest):
            if not path.is_file():
                problems.append(f"no config {path.relative_to(REPO)}")
                continue
            try:
                parse_config(config_loader(rest, path), path)
            except Exception as e:  # the message is the finding
                problems.append(f"{path.relative_to(REPO)} does not parse: {e}")
    return [f"{c.where}: `{c.text}`: {p}" for p in problems]


def test_every_shell_command_is_checked_as_far_as_it_can_be() -> None:
    problems: list[str] = []
    checked = 0
    for block in shell_blocks():
        for c in commands(block):
            problems += check_command(c, block)
            checked += 1
    assert checked > 60, checked
    assert not problems, "\n".join(problems)


def check_runs() -> list[tuple[str, list[str]]]:
    """`lorastack serve|up|gateway` lines of marked blocks with a config the repository
    ships: (where, the `--check` command that checks what a start would build)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for block in shell_blocks():
        for c in commands(block):
            rest = lorastack_words(c.words)
            if not rest or rest[0] not in ("serve", "up"):
                continue
            paths = [p for p in config_paths(rest) if p.is_file()]
            if paths:
                argv = ["serve", str(paths[0]), "--check"]
                out.setdefault(" ".join(argv), (c.where, argv))
    return list(out.values())


@pytest.mark.parametrize("where,argv", check_runs(), ids=[w for w, _ in check_runs()])
def test_a_serve_config_the_docs_start_passes_check(
    where: str, argv: list[str], tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")}
    env["LORASTACK_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{where}: {done.stdout}{done.stderr}"


def test_the_serve_config_the_readme_ships_is_the_one_the_demo_writes(tmp_path: Path) -> None:
    """apps/lorastack/serve.yaml is `lorastack demo`'s serve.yaml on the CPU, but for the
    adapter: the README's path lists it (LoRA on), the demo loads it at runtime."""
    from lorastack_app.pipeline import write_serve_config

    write_serve_config(tmp_path / "serve.yaml", "cpu")
    shipped = yaml.safe_load((REPO / "apps/lorastack/serve.yaml").read_text())
    assert shipped.pop("adapters") == ["date-iso/adapter"]
    demo = yaml.safe_load((tmp_path / "serve.yaml").read_text())
    assert demo.pop("enable_lora") is True
    assert shipped == demo


BROKEN = [  # (a command a doc might show, what must catch it)
    ("false", "run"),
    ("echo ready", "run: prints"),
    ("make docs", "check"),
    ("docker compose --profile training run --rm trainer lorastack doctor", "check"),
    ("docker compose --profile train run --rm train lorastack doctor", "check"),
    ("kubectl apply -k deploy/k8s/overlays/no-such", "check"),
    ("lorastack serve deploy/config/train.yaml", "check"),
    ("lorastack train deploy/config/no-such.yaml", "check"),
]


@pytest.mark.parametrize("text,how", BROKEN, ids=[t for t, _ in BROKEN])
def test_a_command_that_fails_or_names_what_is_not_there_is_caught(
    text: str, how: str, tmp_path: Path
) -> None:
    command = Command("scratch.md:1", text, ("ready!",) if how == "run: prints" else ())
    if how.startswith("run"):
        assert run_session([command], tmp_path, None)
    else:
        block = Block(REPO / "scratch.md", 1, "sh", ((2, text),), "needs docker")
        assert check_command(command, block), text
