"""Run-config hooks: `on_complete` and `on_failure`, the commands that end a paid run
(stop the rental, notify someone) once its results are safe.

Owns when a hook may run and what it gets: only after the results are published to a
store off this host and read back from there, every file's sha256 checked (`on_complete`:
the adapter, the data and test records and the last checkpoint; `on_failure`: the
support memo and the last checkpoint, if any); never with a `file://` store unless the
hook says `allow_local_store: true`. The environment it gets (`hook_env`) names the run,
the artifact refs and the cost; its output goes to the run log and to
RUN_DIR/hooks/EVENT.log; a hook that fails or times out is reported and changes nothing
that was published. The recipe (trainer.recipe) calls `after_success` and
trainer.publish.failure calls `after_failure`; this module never trains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from lorastack.errors import ConfigError, LorastackError
from lorastack.manifest import Manifest
from lorastack.store import ArtifactStore
from trainer.config import HookConfig, RunConfig
from trainer.errors import CostCapReached, HookNotRun, TrainingInterrupted
from trainer.loop.budget import Meter
from trainer.state import RunPlan

LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def refuse_local_store(config: RunConfig, store_url: str) -> None:
    """ConfigError when a hook would run with the results only on this host."""
    for event, hook in (("on_complete", config.on_complete), ("on_failure", config.on_failure)):
        if hook is None or hook.allow_local_store or not store_url.startswith("file://"):
            continue
        raise ConfigError(
            f"{event} needs a store off this host, but the store is {store_url}, a folder on "
            "this host: a hook that stops the host could take the only copy of the results "
            "with it",
            "set LORASTACK_STORE_URL=s3://BUCKET/PREFIX (a store that outlives this host), or, "
            f"when that folder is a mount that outlives it, set {event}.allow_local_store: true",
        )


def store_warning(store_url: str, endpoint: str | None) -> str | None:
    """A line for an S3 store whose endpoint is this host's loopback (a local MinIO)."""
    host = urlparse(endpoint or "").hostname or ""
    if store_url.startswith("s3://") and host in LOOPBACK:
        return (
            f"hooks: the S3 endpoint {endpoint} is on this host; the results count as off the "
            "host only when that server's data outlives it"
        )
    return None


def verify_all(
    store: ArtifactStore, refs: dict[str, Manifest], event: str, say: Callable[[str], None]
) -> None:
    """Read every artifact back from the store and check each file; HookNotRun when one
    cannot be (the message says which and why)."""
    for m in refs.values():
        try:
            store.verify_remote(m)
        except LorastackError as e:
            raise not_run(event, f"{m.ref} could not be verified in {store.url}: {e}") from e
        say(f"{event}: verified {m.ref} in {store.url} (every file's sha256)")


def not_run(event: str, why: str) -> HookNotRun:
    """The HookNotRun error for a hook that could not run, with what to do next."""
    return HookNotRun(
        f"{event} hook not run: {why}",
        "the results are still in the run folder; once the store answers again, run the "
        "same command with --resume auto: it publishes what is missing, verifies it and "
        "runs the hook",
    )


def hook_env(
    event: str,
    *,
    run: str,
    run_dir: Path,
    store_url: str,
    status: str,
    steps: int,
    hours: float,
    cost: float,
    currency: str,
    refs: dict[str, Manifest],
    error: str = "",
) -> dict[str, str]:
    """The variables a hook gets (on top of the trainer's own environment)."""
    env = {
        "LORASTACK_EVENT": event,
        "LORASTACK_RUN": run,
        "LORASTACK_RUN_DIR": str(run_dir),
        "LORASTACK_STORE_URL": store_url,
        "LORASTACK_STATUS": status,  # complete | cost_cap | failed
        "LORASTACK_STEPS": str(steps),
        "LORASTACK_BILLED_HOURS": f"{hours:.6f}",
        "LORASTACK_COST": f"{cost:.6f}",
        f"LORASTACK_COST_{currency}": f"{cost:.6f}",
        "LORASTACK_CURRENCY": currency,
    }
    for what, m in refs.items():
        env[f"LORASTACK_{what.upper()}_REF"] = m.ref
        env[f"LORASTACK_{what.upper()}_DIGEST"] = m.digest
    if error:
        env["LORASTACK_ERROR"] = error.splitlines()[0][:500]
    return env


@dataclass
class HookOutcome:
    """How a hook's command ended: exit code, seconds and its log."""

    event: str
    exit_code: int | None  # None: killed at the timeout
    seconds: float
    log: Path

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def describe(self) -> str:
        """One line on how the hook ended: its exit code or timeout, and where its output is."""
        if self.exit_code is None:
            what = f"timed out after {self.seconds:.1f} s and was killed"
        else:
            what = f"exited {self.exit_code} after {self.seconds:.1f} s"
        return f"{self.event} hook {what} (output: {self.log})"


def run_hook(
    event: str,
    hook: HookConfig,
    env: dict[str, str],
    log_dir: Path,
    say: Callable[[str], None],
) -> HookOutcome:
    """Run `hook.command` with `sh -c`, each output line into the run log and the hook's
    log file; kill its process group at `hook.timeout_s`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{event}.log"
    say(f"{event}: running {hook.command!r} (timeout {hook.timeout_s:g} s)")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["/bin/sh", "-c", hook.command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: a timeout kills its children too
        text=True,
        errors="replace",
    )

    def pump() -> None:
        assert proc.stdout is not None
        with log.open("w", encoding="utf-8") as fh:
            for line in proc.stdout:
                fh.write(line)
                say(f"[{event}] {line.rstrip()}")

    reader = threading.Thread(target=pump, name=f"hook-{event}", daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=hook.timeout_s)
    except subprocess.TimeoutExpired:
        with_suppressed_kill(proc.pid)
        proc.wait()
        code = None
    reader.join(timeout=5)
    outcome = HookOutcome(event, code, time.monotonic() - t0, log)
    say(outcome.describe())
    return outcome


def with_suppressed_kill(pgid: int) -> None:
    """SIGKILL a process group that may have exited already."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _last_checkpoint(output: str, store: ArtifactStore) -> Manifest | None:
    name = f"{output}/checkpoints"
    steps = [int(v) for v in store.versions(name) if v.isdigit()]
    return store.manifest(name, str(max(steps))) if steps else None


def _env(
    plan: RunPlan,
    store: ArtifactStore,
    step: int,
    meter: Meter,
    event: str,
    status: str,
    refs: dict[str, Manifest],
    error: str = "",
) -> dict[str, str]:
    return hook_env(
        event,
        run=plan.config.output,
        run_dir=plan.run_dir,
        store_url=store.url,
        status=status,
        steps=step,
        hours=meter.hours() * plan.settings.world_size,
        cost=meter.cost(),
        currency=plan.config.currency,
        refs=refs,
        error=error,
    )


def after_success(
    plan: RunPlan,
    store: ArtifactStore,
    step: int,
    meter: Meter,
    published: dict[str, Manifest | None],
    base_env: dict[str, str],
    say: Callable[[str], None],
) -> HookOutcome | None:
    """Verify the run's results off the host (`published`: the adapter, data and test
    manifests of its TrainResult), then run on_complete (None: no hook)."""
    hook = plan.config.on_complete
    if hook is None or plan.mode != "train" or not plan.settings.is_main:
        return None
    refs = {what: m for what, m in published.items() if m is not None}
    assert set(refs) == {"adapter", "data", "test"}, published
    try:
        ckpt = _last_checkpoint(plan.config.output, store)
    except LorastackError as e:
        raise not_run("on_complete", f"the checkpoints in {store.url} cannot be read: {e}") from e
    if ckpt is None:
        raise not_run("on_complete", f"no checkpoint of {plan.config.output} in {store.url}")
    refs["checkpoint"] = ckpt
    warning = store_warning(store.url, plan.settings.s3_endpoint_url)
    if warning:
        say(warning)
    verify_all(store, refs, "on_complete", say)
    outcome = run_hook(
        "on_complete",
        hook,
        {**base_env, **_env(plan, store, step, meter, "on_complete", "complete", refs)},
        plan.run_dir / "hooks",
        say,
    )
    if not outcome.ok:
        say(f"WARNING: {outcome.describe()}; the published results are safe: {refs['adapter'].ref}")
    return outcome


def after_failure(
    plan: RunPlan,
    store: ArtifactStore | None,
    step: int,
    meter: Meter,
    error: LorastackError,
    memo: Manifest | None,
    base_env: dict[str, str],
    say: Callable[[str], None],
) -> None:
    """Verify the support memo (published by trainer.publish.failure into `store`, None: the
    run failed before its store opened) and the last checkpoint off the host, then run
    on_failure; a memo that is not there means no hook, said why."""
    cfg = plan.config
    if plan.mode != "train" or not plan.settings.is_main:
        return
    if cfg.on_complete is not None:
        say(f"on_complete hook not run: the run did not complete ({type(error).__name__})")
    if cfg.on_failure is None:
        return
    if isinstance(error, TrainingInterrupted):
        say("on_failure hook not run: the run was stopped by a signal (--resume continues it)")
        return
    if memo is None or store is None:
        say(
            "on_failure hook not run: the support memo is not in a store off this host "
            "(the store was not reached; see the warning above)"
        )
        return
    status = "cost_cap" if isinstance(error, CostCapReached) else "failed"
    refs = {"support": memo}
    try:
        ckpt = _last_checkpoint(cfg.output, store)
        if ckpt is not None:
            refs["checkpoint"] = ckpt
        verify_all(store, refs, "on_failure", say)
    except LorastackError as e:
        say(f"on_failure hook not run: the support memo is not verified off this host: {e}")
        return
    env = {**base_env, **_env(plan, store, step, meter, "on_failure", status, refs, error.message)}
    outcome = run_hook("on_failure", cfg.on_failure, env, plan.run_dir / "hooks", say)
    if not outcome.ok:
        say(f"WARNING: {outcome.describe()}")
