"""A rendered compose service as a process on this host: what Docker would give it, and no more.

`docker-compose config` renders the services (command, entrypoint, environment, volumes,
extra_hosts); the image adds its Dockerfile's ENV, ENTRYPOINT and CMD. Outside Docker a
process sees the host's file system and network, so the only changes are the ones the
container's namespaces made for it:

- volumes: a container path that is a volume's target (`/config`, `/data/lorastack`) becomes
  the bind source (re-rooted from the folder it was rendered in to this checkout) or a folder
  per named volume under the work dir, wherever it appears in an argument or an env value;
- service names are host names on compose's network: `minio:9000` -> `127.0.0.1:PORT`, and
  `host.docker.internal` (extra_hosts: host-gateway) -> `127.0.0.1`;
- a container's ports are its own: each (service, container port) gets a host port (the same
  number, or a free one where the rendered ones could clash), in the `*_PORT` values, `-p N`
  arguments and healthchecks of that service and in every `service:PORT` that names it;
- `0.0.0.0` (every interface of the container's own network) binds `127.0.0.1`;
- the working directory and HOME are a folder per service (the image's WORKDIR).

Everything else (env values, arguments) is passed exactly as rendered.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Image:
    """What a Dockerfile gives its containers: ENV, ENTRYPOINT and CMD (exec form)."""

    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Process:
    """A service's process: its argv, environment (the image's and compose's, mapped) and cwd."""

    service: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass(frozen=True)
class Layout:
    """Where the container paths and ports of a render land on this host."""

    repo: Path  # this checkout
    render_root: Path  # the checkout the YAML was rendered in (bind sources are under it)
    work: Path  # named volumes, per-service homes
    ports: dict[str, dict[int, int]]  # service -> container port -> host port
    # service -> container path -> host folder, in place of the volume's own (a mounted config
    # folder whose files name container paths, copied with them mapped: walk.py)
    mounts: dict[str, dict[str, Path]] = field(default_factory=dict)


def parse_image(dockerfile: str) -> Image:
    """ENV (both forms, with continuation lines), ENTRYPOINT and CMD of a Dockerfile; the
    last of each wins, as in a build."""
    text = re.sub(r"\\\n", " ", dockerfile)
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    cmd: list[str] = []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":  # a stage starts: what an image keeps is its last stage's
            env, entrypoint, cmd = {}, [], []
        elif word == "ENV":
            parts = shlex.split(rest)
            if parts and "=" not in parts[0]:  # ENV KEY value
                env[parts[0]] = " ".join(parts[1:])
            else:
                env.update(p.split("=", 1) for p in parts)  # type: ignore[arg-type]
        elif word in ("ENTRYPOINT", "CMD"):
            form = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
            if word == "ENTRYPOINT":
                entrypoint, cmd = form, []  # a new ENTRYPOINT clears an inherited CMD
            else:
                cmd = form
    return Image(env, entrypoint, cmd)


def _strings(service: dict[str, Any]) -> list[str]:
    """Every argument and env value of a service, its healthcheck's too."""
    out: list[str] = []
    for key in ("command", "entrypoint"):
        v = service.get(key) or []
        out += [v] if isinstance(v, str) else list(v)
    out += [str(v) for v in (service.get("environment") or {}).values()]
    out += [str(v) for v in (service.get("healthcheck") or {}).get("test") or []]
    return out


def container_ports(services: dict[str, Any], images: dict[str, Image]) -> dict[str, set[int]]:
    """The ports each service listens on in its container: published targets, `*_PORT`
    values (image and compose env), healthcheck URLs, `-p N`, and every `name:PORT` by which
    another service reaches it."""
    ports: dict[str, set[int]] = {name: set() for name in services}
    every = [s for svc in services.values() for s in _strings(svc)]
    for name, svc in services.items():
        own = ports[name]
        for p in svc.get("ports") or []:
            own.add(
                int(p["target"] if isinstance(p, dict) else str(p).split(":")[-1].split("/")[0])
            )
        env = images.get(name, Image()).env | {
            k: str(v) for k, v in (svc.get("environment") or {}).items()
        }
        own |= {int(v) for k, v in env.items() if k.endswith("_PORT") and v.isdigit()}
        for s in (svc.get("healthcheck") or {}).get("test") or []:
            own |= {int(m) for m in re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", str(s))}
        argv = [
            str(a) for a in (svc.get("command") or []) if not isinstance(svc.get("command"), str)
        ]
        own |= {
            int(b) for a, b in itertools.pairwise(argv) if a in ("-p", "--port") and b.isdigit()
        }
        for s in every:
            own |= {int(m) for m in re.findall(rf"(?<![\w.-]){re.escape(name)}:(\d+)", s)}
    return ports


def volume_paths(service: dict[str, Any], layout: Layout, name: str = "") -> dict[str, Path]:
    """Container path -> host path of each volume of the service `name`."""
    out: dict[str, Path] = {}
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            src, target = str(v.get("source", "")), str(v["target"])
        else:
            src, target = [*str(v).split(":"), ""][:2]
        if src.startswith("/"):  # a bind mount, rendered absolute under the render's checkout
            path = Path(src)
            try:
                path = layout.repo / path.relative_to(layout.render_root)
            except ValueError:
                pass
        else:
            path = layout.work / "volumes" / src
        out[target] = layout.mounts.get(name, {}).get(target, path)
    return out


def map_text(text: str, name: str, service: dict[str, Any], layout: Layout) -> str:
    """One argument or env value of service `name` as the host sees it (module docstring)."""
    for target, path in sorted(
        volume_paths(service, layout, name).items(), key=lambda t: -len(t[0])
    ):
        text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?![\w.-])", str(path), text)
    for other, ports in layout.ports.items():
        for port, host in ports.items():
            text = re.sub(
                rf"(?<![\w.-]){re.escape(other)}:{port}(?!\d)", f"{LOOPBACK}:{host}", text
            )
    for port, host in layout.ports.get(name, {}).items():
        text = re.sub(rf"(?:127\.0\.0\.1|localhost):{port}(?!\d)", f"{LOOPBACK}:{host}", text)
    hosts = service.get("extra_hosts") or {}
    if isinstance(hosts, list):
        hosts = dict(h.split(":", 1) for h in hosts)
    for host, where in hosts.items():
        if where == "host-gateway":
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", LOOPBACK, text)
    return LOOPBACK if text == "0.0.0.0" else text


def process_for(
    name: str,
    services: dict[str, Any],
    images: dict[str, Image],
    layout: Layout,
    args: list[str] | None = None,
) -> Process:
    """`docker compose run NAME ARGS...` (or `up`, without args) as a process: the entrypoint
    (compose's, else the image's) followed by ARGS, else compose's command, else the image's
    CMD; the image's ENV under compose's environment; everything mapped (module docstring)."""
    svc = services[name]
    image = images.get(name, Image())

    def listed(key: str) -> list[str] | None:
        v = svc.get(key)
        if v is None:
            return None
        return shlex.split(v) if isinstance(v, str) else [str(a) for a in v]

    entrypoint = listed("entrypoint")
    if entrypoint is None:
        entrypoint = image.entrypoint
    command = args if args is not None else listed("command")
    if command is None:
        command = image.cmd if svc.get("entrypoint") is None else []
    argv = [map_text(a, name, svc, layout) for a in [*entrypoint, *command]]
    ports = layout.ports.get(name, {})
    env: dict[str, str] = {}
    for k, v in (
        image.env | {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    ).items():
        if k.endswith("_PORT") and v.isdigit() and int(v) in ports:
            v = str(ports[int(v)])
        env[k] = map_text(v, name, svc, layout)
    for i, (a, b) in enumerate(itertools.pairwise(argv)):
        if a in ("-p", "--port") and b.isdigit() and int(b) in ports:
            argv[i + 1] = str(ports[int(b)])
    return Process(name, argv, env, layout.work / "home" / name)


def healthcheck_for(name: str, services: dict[str, Any], layout: Layout) -> list[str] | None:
    """The service's healthcheck test (CMD form) as a host command, mapped; None without one."""
    test = (services[name].get("healthcheck") or {}).get("test")
    if not test or test[0] not in ("CMD", "CMD-SHELL"):
        return None
    svc = services[name]
    argv = [map_text(str(a), name, svc, layout) for a in test[1:]]
    return argv if test[0] == "CMD" else ["/bin/sh", "-c", " ".join(argv)]
