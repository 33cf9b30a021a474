"""Every name the docs use is one the code has: variables, config keys, endpoints, ports,
metrics, alerts, paths and make targets, read off the pages (tests/docs_pages.py) and held
to the code, the manifests and the Makefile.

- `LORASTACK_*`: a field of a settings class (prefix + name, or its alias), or a name the
  code sets for a child (a hook's environment).
- config keys: a ```yaml block of a serve or run config validates against its model (the
  run config with a dataset added); `key=value` overrides name a run config field and take
  that value; `key: value` spans name a field of a config or settings model.
- endpoints: `GET|POST|DELETE /path` and URLs name a route of the service on that port
  (8080 the gateway, 8001 the supervisor, 8000 vLLM: the fake vLLM's routes); a bare
  `/v1/...`, `/admin/...` span a route of any of them.
- ports: every `HOST:PORT` is a default of a settings class or a port of compose.yaml, the
  manifests or Prometheus's config.
- metrics: `lorastack_{gateway,inference,trainer}_*` names (also `_suffix` after a full name,
  and the bare names of a paragraph that opens with `lorastack_gateway_*`) are exported; an
  alert the docs name is in deploy/prometheus/rules.yml, whose queries name exported metrics.
- paths: a span that starts with a top-level entry of the repository exists (or is one the
  reader makes, as .gitignore says); a bare `module.py` is a file of the repository; a
  relative Markdown link exists.
- `make X` names a Makefile target.
- defaults: "`name` (N ...)" or "`name`, N s" of a setting states its default.

test_a_name_the_code_does_not_have_is_caught breaks each kind once and expects the finding.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from dashboard_queries import family, metric_names
from docs_pages import REPO, blocks, pages
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings

SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def prose(text: str) -> str:
    """A page's text without its fenced blocks."""
    out, inside = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            out.append("")
            continue
        out.append("" if inside else line)
    return "\n".join(out)


def text_of(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def rel(page: Path) -> str:
    return str(page.relative_to(REPO))


# --- what the code has


def settings_classes() -> list[type[BaseSettings]]:
    from gateway.settings import GatewaySettings
    from inference.settings import InferenceSettings
    from lorastack.settings import CommonSettings
    from merger.settings import MergerSettings
    from trainer.settings import TrainerSettings

    return [CommonSettings, GatewaySettings, InferenceSettings, TrainerSettings, MergerSettings]


def source_files() -> Iterator[Path]:
    for layer in ("libs", "services", "apps", "tools"):
        yield from REPO.glob(f"{layer}/*/src/**/*.py")


@cache
def env_names() -> frozenset[str]:
    names: set[str] = set()
    for cls in settings_classes():
        prefix = str(cls.model_config.get("env_prefix", ""))
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            choices = getattr(alias, "choices", None)
            if choices:
                names |= {str(c) for c in choices}
            else:
                names.add(f"{prefix}{name}".upper())
    for f in source_files():  # what the code sets for a child
        names |= set(re.findall(r"\"(LORASTACK_[A-Z0-9_]+)\"", f.read_text()))
    return frozenset(names | set(hook_variables()))


def hook_variables() -> dict[str, str]:
    """A hook's environment, with every artifact it is told of (trainer.publish.hooks: the
    adapter, data, test and checkpoint of a complete run, the support memo of a failed one)
    and the default currency."""
    from types import SimpleNamespace

    from trainer.publish.hooks import hook_env

    refs: Any = {
        w: SimpleNamespace(ref="", digest="")
        for w in ("adapter", "data", "test", "checkpoint", "support")
    }
    return hook_env(
        "on_complete", run="r", run_dir=Path("r"), store_url="", status="complete", steps=1,
        hours=0.0, cost=0.0, currency="USD", refs=refs, error="e",
    )  # fmt: skip


def config_models() -> list[type[BaseModel]]:
    from evaluation.eval_config import EvalConfig
    from gateway.keys import KeyEntry
    from trainer.config import RunConfig

    return [RunConfig, EvalConfig, KeyEntry, *settings_classes()]


def field_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        yield prefix + name
        for kind in [field.annotation, *getattr(field.annotation, "__args__", ())]:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                yield from field_paths(kind, f"{prefix}{name}.")


@cache
def config_keys() -> frozenset[str]:
    paths = {p for m in config_models() for p in field_paths(m)}
    return frozenset(paths | {p.rsplit(".", 1)[-1] for p in paths})


def route_table() -> dict[str, set[tuple[str, str]]]:
    """(method, path template) by service."""
    from gateway.main import PROXIED, create_app
    from gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(backends=["http://127.0.0.1:9"]))
    gateway = {(m, r.path) for r in app.routes for m in getattr(r, "methods", None) or ()}
    gateway |= {("POST", path) for path in PROXIED}
    supervisor = set()
    tree = ast.parse((REPO / "services/inference/src/inference/main.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if isinstance(target, ast.Name) and target.id == "app" and node.args:
                path = node.args[0]
                if node.func.attr in ("get", "post", "delete") and isinstance(path, ast.Constant):
                    supervisor.add((node.func.attr.upper(), str(path.value)))
    vllm: set[tuple[str, str]] = set()
    for name in ("fake_vllm.py", "fake_routes.py"):
        src = (REPO / "libs/testing/src/lorastack_testing" / name).read_text()
        vllm |= set(re.findall(r"\(\"(GET|POST|DELETE)\", \"(/[^\"]*)\"\)", src))
    return {"gateway": gateway, "supervisor": supervisor, "vllm": vllm}


ROUTES = route_table()
SERVICE_OF_PORT = {8080: "gateway", 8001: "supervisor", 8000: "vllm"}


def route_matches(path: str, template: str) -> bool:
    pattern = re.sub(r"\\\{[^}]*:path\\\}", ".+", re.escape(template))
    pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", pattern)
    return re.fullmatch(pattern, path) is not None


def has_route(path: str, method: str | None, services: list[str]) -> bool:
    """Whether a route has `path`, or starts with it (`/admin/*`, an API's base URL `/v1`)."""
    path = path.split("?")[0].rstrip(".,;:)") or "/"
    prefix = path.removesuffix("*").rstrip("/") + "/"  # a group of routes: `/admin/*`, `/v1`
    return any(
        (method is None or m == method) and (route_matches(path, t) or t.startswith(prefix))
        for s in services
        for m, t in ROUTES[s]
    )


@cache
def known_ports() -> frozenset[int]:
    ports: set[int] = set()
    for cls in settings_classes():
        for name, field in cls.model_fields.items():
            if name.endswith("port") and isinstance(field.default, int):
                ports.add(field.default)
    files = [REPO / "compose.yaml", *REPO.glob("deploy/**/*.y*ml")]
    for f in files:
        text = f.read_text()
        ports |= {int(p) for p in re.findall(r"(?<![\w.])(?:[\w-]+)?:(\d{4,5})\b", text)}
        ports |= {int(p) for p in re.findall(r"[pP]ort:\s*\"?(\d{2,5})\b", text)}
        ports |= {int(p) for p in re.findall(r"\"(\d{4,5}):\d{4,5}\"", text)}
    return frozenset(ports)


@cache
def exported_metrics() -> frozenset[str]:
    from dashboard_queries import trainer_metric_names

    names = set(trainer_metric_names())
    for f in source_files():
        names |= set(
            re.findall(r"\"(lorastack_(?:gateway|inference|trainer)_[a-z0-9_]+)\"", f.read_text())
        )
    adapter = (REPO / "deploy/k8s/monitoring/prometheus-adapter-values.yaml").read_text()
    names |= set(re.findall(r"as: (lorastack_[a-z_]+)", adapter))  # External metrics it serves
    out = set(names)
    for n in names:
        base = n.removesuffix("_total")
        out |= {base, base + "_total", base + "_bucket", base + "_sum", base + "_count"}
    return frozenset(out)


def vllm_metrics() -> set[str]:
    from test_dashboard import exported_by_vllm

    return exported_by_vllm()


def alert_rules() -> dict[str, str]:
    rules = yaml.safe_load((REPO / "deploy/prometheus/rules.yml").read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


@cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


@cache
def setting_defaults() -> dict[str, Any]:
    """Setting name (field and env var) -> its default, for the numeric ones."""
    out: dict[str, Any] = {}
    for cls in settings_classes():
        prefix = str(cls.model_config.get("env_prefix", ""))
        for name, field in cls.model_fields.items():
            if isinstance(field.default, int | float) and not isinstance(field.default, bool):
                for key in (name, f"{prefix}{name}".upper()):
                    if out.get(key, field.default) != field.default:
                        out[key] = None  # two classes, two defaults: no one value to check
                    else:
                        out[key] = field.default
    return out


# --- the checks, each a function of (page, its text) -> findings


def check_env(page: Path, text: str) -> list[str]:
    found = set(re.findall(r"\b(LORASTACK_[A-Z0-9_]*[A-Z0-9])\b(?![<*])", text))
    return [f"no variable {n}" for n in sorted(found - env_names())]


def check_yaml_blocks(page: Path, text: str) -> list[str]:
    from inference.settings import InferenceSettings
    from trainer.config import build_config

    problems = []
    for block in blocks(page):
        if block.lang != "yaml":
            continue
        data = yaml.safe_load("\n".join(line for _, line in block.lines))
        keys = set(data) if isinstance(data, dict) else set()
        if keys & {"scrape_configs", "services"}:  # Prometheus's, compose's
            continue
        try:
            if keys and keys <= set(InferenceSettings.model_fields):
                InferenceSettings.model_validate(data)
            elif keys and keys <= set(config_keys()):
                build_config({"dataset": {"path": "chats.jsonl"}, **data})
            else:
                problems.append(f"{block.where}: keys of no config: {sorted(keys)}")
        except (ValidationError, ValueError) as e:
            problems.append(f"{block.where}: {e}")
    return problems


# `key: value` spans of other schemas the prose quotes (a request body, compose, k8s, a
# manifest's fields)
FOREIGN_KEYS = {
    "components", "images", "chat_format", "tool_call_parser", "name", "arguments", "content",
    "data", "param", "finish_reason", "internal", "cap_drop", "restart", "app", "warn",
    "authorization",
}  # fmt: skip


def check_config_spans(page: Path, text: str) -> list[str]:
    """`key=value` overrides (a span of nothing else, or of a `lorastack` command) name a run
    config field; `key: value` spans name a field of a config or settings model."""
    problems = []
    for span in SPAN.findall(prose(text)):
        items = span.split()
        overrides = items[1:] if span.startswith("lorastack ") else items
        if "(" in span or "==" in span or ", " in span or not overrides:
            continue  # a call, a pin, a request's parameters
        if span.startswith("lorastack ") or all("=" in i for i in overrides):
            for item in overrides:
                m = re.fullmatch(r"([a-z_]+(?:\.[a-z_]+)*)=[^A-Z\s]+", item)
                if m and m[1] not in config_keys():
                    problems.append(f"`{span}`: no config key {m[1]!r}")
        m = re.fullmatch(r"([a-z_]+): .+", span)
        if m and m[1] not in config_keys() and m[1] not in FOREIGN_KEYS:
            problems.append(f"`{span}`: no config key {m[1]!r}")
    return problems


def check_endpoints(page: Path, text: str) -> list[str]:
    problems = []
    for method, path in re.findall(r"\b(GET|POST|DELETE) (/[\w/{}.:@*-]*)", text):
        if not has_route(path, method, list(ROUTES)):
            problems.append(f"no route {method} {path}")
    for port, path in re.findall(r"https?://[\w.-]+:(\d+)(/[\w/{}.:@-]*)?", text):
        service = SERVICE_OF_PORT.get(int(port))
        if service and path and not has_route(path, None, [service]):
            problems.append(f"{service} (port {port}) has no route {path}")
    firsts = {t.split("/")[1] for routes in ROUTES.values() for _, t in routes}
    for span in SPAN.findall(prose(text)):
        m = re.fullmatch(r"(/[\w/{}.:@*-]+)(?: .*)?", span)
        if m and m[1].split("/")[1] in firsts and not has_route(m[1], None, list(ROUTES)):
            problems.append(f"no route {m[1]}")
    return problems


def check_ports(page: Path, text: str) -> list[str]:
    found = re.findall(r"(?:localhost|127\.0\.0\.1|0\.0\.0\.0|HOST|[a-z-]+):(\d{4,5})\b", text)
    found += re.findall(r"\bports? (\d{4,5})\b", text)
    chosen = {int(p) for p in re.findall(r"--port (\d+)", text)}  # the page starts one there
    return [
        f"port {p} is no default or manifest's"
        for p in found
        if int(p) not in known_ports() | chosen
    ]


def metric_mentions(text: str) -> Iterator[str]:
    for paragraph in re.split(r"\n\s*\n", text):
        last = ""
        for m in re.finditer(r"`(_?[a-z0-9_:|]+)(\{[^`]*\})?`|\b(lorastack_[a-z0-9_]+)", paragraph):
            name = m[1] or m[3]
            if not name:
                continue
            if re.match(r"lorastack_(gateway|inference|trainer)_[a-z0-9]", name):
                last = re.match(r"lorastack_[a-z]+", name)[0]  # type: ignore[index]
                yield from alternatives(name)
            elif name.startswith("_") and last:
                yield from alternatives(last + name)
            elif "`lorastack_gateway_*`" in paragraph and re.fullmatch(
                r"[a-z0-9]+(_[a-z0-9]+)+(\|[a-z0-9_]+)*", name
            ):
                yield from alternatives("lorastack_gateway_" + name)


def alternatives(name: str) -> list[str]:
    """`backend_requests_running|waiting` -> both names (the alternative replaces the last
    word, or as many words as it has)."""
    first, *alts = name.split("|")
    out = [first]
    for alt in alts:
        words = first.split("_")
        out.append("_".join([*words[: len(words) - len(alt.split("_"))], alt]))
    return out


def check_metrics(page: Path, text: str) -> list[str]:
    problems = [f"no metric {n}" for n in metric_mentions(text) if n not in exported_metrics()]
    vllm = {n for n in re.findall(r"\b(vllm:[a-z_]+)", text)}
    problems += [f"vLLM exports no {n}" for n in sorted(vllm - vllm_metrics())]
    alerts = re.findall(r"alerts?\b[^`]{0,40}`([A-Z][A-Za-z]+)`", text)
    problems += [f"no alert {a}" for a in alerts if a not in alert_rules()]
    return problems


def ignored(path: str) -> bool:
    done = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, check=False)
    return done.returncode == 0


@cache
def repo_files() -> tuple[str, ...]:
    """Every file of the checkout git knows of, tracked or not (not the ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return tuple(listed.stdout.splitlines())


def check_paths(page: Path, text: str) -> list[str]:
    """A path of the repository exists (from the root, or from the page's folder); a bare
    `name.py` is a file of the repository; a relative link exists."""
    problems = []
    tops = {p.name for p in REPO.iterdir() if p.name != ".git"}
    for span in SPAN.findall(text):
        for word in span.split():
            word = word.strip("(),;:'\"").split(":")[0]
            if re.search(r"[<>{}$]|\.\.\.|[A-Z]{3,}", word) or word.startswith("http"):
                continue
            if "/" in word and word.split("/")[0] in tops | {"tests", "src"}:
                here = [*REPO.glob(word.rstrip("/")), *page.parent.glob(word.rstrip("/"))]
                if not (here or ignored(word)):
                    problems.append(f"no {word}")
            elif re.fullmatch(r"[a-z_0-9]+\.py", word) and not any(
                f.endswith("/" + word) for f in repo_files()
            ):
                problems.append(f"no {word}")
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if not target.startswith("http") and not (page.parent / target).exists():
            problems.append(f"a link to {target}, which does not exist")
    return problems


def check_make(page: Path, text: str) -> list[str]:
    problems = []
    for run in re.findall(r"`make ([^`]+)`", text):
        words = [w for w in run.split() if "=" not in w and not w.startswith("-")]
        problems += [f"make has no target {w!r}" for w in words if w not in make_targets()]
    return problems


def check_defaults(page: Path, text: str) -> list[str]:
    """ "`name` (N", "`name`, N s", "`name` N" of a numeric setting: N is its default, unless
    the sentence says the value is another's (a manifest's, "sets", "e.g.")."""
    problems = []
    flat = re.sub(r"\s+", " ", prose(text))
    pattern = (
        r"`([A-Za-z_]+)`(?:,| \(| )(?:default )?(\d+(?:\.\d+)?)(?= ?(?:s\b|%|\)|,|;|:| by default))"
    )
    for m in re.finditer(pattern, flat):
        name, value = m[1], float(m[2])
        default = setting_defaults().get(name)
        before = flat[max(0, m.start() - 60) : m.start()]
        if default is None or re.search(r"\b(sets?|e\.g\.|manifest)\b", before):
            continue
        if float(default) != value:
            problems.append(f"`{name}` shown as {m[2]}, its default is {default}")
    return problems


CHECKS: dict[str, Callable[[Path, str], list[str]]] = {
    "variables": check_env,
    "yaml blocks": check_yaml_blocks,
    "config keys": check_config_spans,
    "endpoints": check_endpoints,
    "ports": check_ports,
    "metrics": check_metrics,
    "paths": check_paths,
    "make targets": check_make,
    "defaults": check_defaults,
}


def test_the_pages_name_enough_to_check() -> None:
    """The extraction finds what the pages name (a regex gone wrong finds nothing)."""
    texts = [text_of(p) for p in pages()]
    assert sum(len(set(re.findall(r"\bLORASTACK_[A-Z0-9_]+", t))) for t in texts) > 50
    assert sum(len(list(metric_mentions(t))) for t in texts) > 50
    assert sum(len(re.findall(r"\b(?:GET|POST|DELETE) /", t)) for t in texts) > 10
    assert len(config_keys()) > 100 and len(ROUTES["supervisor"]) > 5


@pytest.mark.parametrize("kind", list(CHECKS))
def test_every_name_the_docs_use_is_the_codes(kind: str) -> None:
    problems = [f"{rel(p)}: {x}" for p in pages() for x in CHECKS[kind](p, text_of(p))]
    assert not problems, "\n".join(problems)


def test_the_alert_rules_query_exported_metrics() -> None:
    exported = exported_metrics() | vllm_metrics()
    for alert, expr in alert_rules().items():
        gone = {n for n in metric_names(expr) if n not in exported and family(n) not in exported}
        assert not gone, f"alert {alert} queries what nothing exports: {gone}"


BROKEN = {  # a line a doc might hold, the check that must catch it
    "variables": "set `LORASTACK_GATEWAY_TIMEOUT_S=5`",
    "config keys": "override `lora.rank=8` on the command line",
    "endpoints": "`POST /admin/adapter` loads one; or http://127.0.0.1:8080/v1/chat",
    "ports": "the supervisor answers on 127.0.0.1:8002",
    "metrics": "watch `lorastack_gateway_requests_total` and the alert `ModelIsSlow`",
    "paths": "edit `deploy/config/serving.yaml`",
    "make targets": "run `make docs`",
    "defaults": "it waits `kv_admit_wait_s` (7 s) at most",
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_name_the_code_does_not_have_is_caught(kind: str, tmp_path: Path) -> None:
    page = REPO / "docs" / "scratch-not-a-page.md"  # read from the text given, never written
    found = CHECKS[kind](page, BROKEN[kind])
    assert found, f"{kind}: {BROKEN[kind]!r} passed"
