"""Keys as data: the keys file (names, models, limits, budgets, sha256 at rest), live
reload, `lorastack gateway keys add/list/revoke`, and usage per key name in /metrics,
through the official `openai` client against the fake vLLM."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import httpx
import openai
import pytest
from test_gateway_limits import admit
from test_gateway_proxy import METRICS, METRICS_KEY, metric, wait_for

from gateway.auth import Authenticator
from gateway.errors import BudgetExhausted, ModelNotAllowed, RateLimited, Unauthorized
from gateway.keys import KeyEntry, KeysFile, hash_secret, load_keys, period_end, save_keys
from lorastack.cli import main as lorastack_main
from lorastack.errors import ConfigError
from lorastack.secrets import API_KEY_MIN_CHARS

ENV_KEY = "sk-env-" + "0123456789abcdef" * 2  # API keys: at least 32 characters


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, sec: int = 0) -> float:
    return dt.datetime(year, month, day, hour, minute, sec, tzinfo=dt.UTC).timestamp()


@pytest.mark.parametrize(
    ("now", "period", "end"),
    [
        (utc(2026, 12, 1, 15, 30), "hour", utc(2026, 12, 1, 16)),
        (utc(2026, 12, 1, 15, 30), "day", utc(2026, 12, 2)),
        (utc(2026, 12, 1, 15, 30), "week", utc(2026, 12, 7)),  # a Tuesday -> next Monday
        (utc(2026, 12, 7, 0, 0), "week", utc(2026, 12, 14)),
        (utc(2026, 12, 31, 23, 59), "month", utc(2027, 1, 1)),
        (utc(2028, 2, 10), "month", utc(2028, 3, 1)),
    ],
)
def test_budget_periods_end_on_utc_calendar_boundaries(now, period, end) -> None:
    assert period_end(now, period) == end


def write(path: Path, *entries: KeyEntry) -> None:
    save_keys(path, KeysFile(keys=list(entries)))


def test_keys_file_errors_name_the_entry(tmp_path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - name: a\n    sha256: nothex\n")
    with pytest.raises(ConfigError, match=r"keys.0.sha256"):
        load_keys(path)
    h = hash_secret("s")
    path.write_text(json.dumps({"keys": [{"name": "a", "sha256": h}, {"name": "a", "sha256": h}]}))
    with pytest.raises(ConfigError, match="two keys share the name"):
        load_keys(path)
    path.write_text("keys: [")
    with pytest.raises(ConfigError, match=r"keys\.yaml"):
        load_keys(path)


def test_budget_model_check_refund_reset_and_reload(tmp_path) -> None:
    path = tmp_path / "keys.json"
    write(
        path,
        KeyEntry(
            name="alice",
            sha256=hash_secret("sk-a"),
            models=["m1"],
            budget_tokens=100,
            budget_period="hour",
        ),
        KeyEntry(name="bob", sha256=hash_secret("sk-b"), requests_per_min=1),
    )
    assert json.loads(path.read_text())["keys"][0]["name"] == "alice"  # JSON stays JSON
    assert "sk-a" not in path.read_text()
    now, wall = [0.0], [utc(2026, 12, 1, 15, 30)]
    auth = Authenticator(
        True, [ENV_KEY], keys_file=path, clock=lambda: now[0], wall=lambda: wall[0]
    )
    alice = auth.authenticate("Bearer sk-a")
    assert alice.name == "alice" and auth.authenticate(f"Bearer {ENV_KEY}").name.startswith("key-")
    auth.check_model(alice, "m1")
    with pytest.raises(ModelNotAllowed, match="may use: m1"):
        auth.check_model(alice, "m2")
    held = admit(auth, alice, 60)
    with pytest.raises(BudgetExhausted) as e:
        admit(auth, alice, 50)  # 60 + 50 > 100
    assert "has 40 of its 100 tokens for this hour left" in e.value.message
    assert "resets at 2026-12-01T16:00:00Z (in 1800 s)" in e.value.hint
    assert e.value.status == 429 and e.value.headers()["Retry-After"] == "1800"
    auth.refund(held, 30)  # the request used 30 of the 60 it reserved
    admit(auth, alice, 70)
    with pytest.raises(BudgetExhausted, match="has used its 100 tokens"):
        admit(auth, alice, 1)
    wall[0] = utc(2026, 12, 1, 16, 0, 1)  # the next hour: a fresh budget
    admit(auth, alice, 100)
    bob = auth.authenticate("Bearer sk-b")
    admit(auth, bob, 0)
    with pytest.raises(RateLimited, match="1 requests per minute"):
        admit(auth, bob, 0)
    # a reload: bob revoked, alice's budget and use kept, a new key works
    write(
        path,
        KeyEntry(name="alice", sha256=hash_secret("sk-a"), budget_tokens=100, budget_period="hour"),
        KeyEntry(name="carol", sha256=hash_secret("sk-c")),
    )
    now[0] = 2.0  # past the mtime check interval
    with pytest.raises(Unauthorized):
        auth.authenticate("Bearer sk-b")
    assert auth.authenticate("Bearer sk-c").name == "carol"
    alice = auth.authenticate("Bearer sk-a")
    auth.check_model(alice, "m2")  # no model list now: every model
    with pytest.raises(BudgetExhausted):
        admit(auth, alice, 1)
    # a broken file keeps the keys in force
    path.write_text("keys: [")
    now[0] = 4.0
    assert auth.authenticate("Bearer sk-c").name == "carol"


def test_a_same_length_rotation_within_one_mtime_tick_is_seen(tmp_path) -> None:
    """The secret rotated in place (same inode, same size: a sha256 is always 64 hex
    digits) and the old mtime kept, as a coarse file clock or a bind mount leaves it: the
    revoked secret is refused at once and the new one works."""
    path = tmp_path / "keys.yaml"
    old, new = "sk-rotated-before-0123456789abcdef", "sk-rotated-after-00123456789abcdef"
    write(path, KeyEntry(name="team", sha256=hash_secret(old)))
    before = path.stat()
    now = [0.0]
    auth = Authenticator(True, [], keys_file=path, clock=lambda: now[0])
    assert auth.authenticate(f"Bearer {old}").name == "team"
    path.write_text(path.read_text().replace(hash_secret(old), hash_secret(new)))  # in place
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    now[0] = 2.0  # past the reload check interval
    with pytest.raises(Unauthorized, match="invalid API key"):
        auth.authenticate(f"Bearer {old}")
    assert auth.authenticate(f"Bearer {new}").name == "team"


def keys_cli(path: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = lorastack_main(["gateway", "keys", *args, "--file", str(path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_two_named_keys_through_the_openai_client(make_gateway, fake, tmp_path, capsys) -> None:
    url, state = fake
    state.models.append({"id": "sql", "parent": "smollm2", "root": "/adapters/sql"})
    path = tmp_path / "keys.yaml"
    out = keys_cli(
        path, "add", "alice", "--models", "smollm2", "--budget-tokens", "300", capsys=capsys
    )
    alice_secret = out.strip().splitlines()[-1]
    out = keys_cli(
        path, "add", "bob", "--models", "sql", "--requests-per-min", "100", capsys=capsys
    )
    bob_secret = out.strip().splitlines()[-1]
    assert alice_secret.startswith("sk-") and alice_secret not in path.read_text()
    assert len(alice_secret) >= API_KEY_MIN_CHARS  # strong by construction
    listing = keys_cli(path, "list", capsys=capsys)
    assert "alice" in listing and "300/day" in listing and alice_secret not in listing
    assert lorastack_main(["gateway", "keys", "add", "bob", "--file", str(path)]) != 0
    capsys.readouterr()

    with make_gateway(
        [url], auth_enabled=True, api_keys=[ENV_KEY], keys_file=path, metrics_key=METRICS_KEY
    ) as gw:

        def client(secret: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{gw}/v1", api_key=secret, max_retries=0)

        alice, bob = client(alice_secret), client(bob_secret)
        msgs = [{"role": "user", "content": "Say hello."}]
        assert [m.id for m in alice.models.list()] == ["smollm2"]
        assert [m.id for m in bob.models.list()] == ["sql"]
        assert alice.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20).choices
        with pytest.raises(openai.PermissionDeniedError) as denied:
            alice.chat.completions.create(model="sql", messages=msgs)
        assert "may not use the model `sql`" in str(denied.value)
        with pytest.raises(openai.PermissionDeniedError):
            bob.chat.completions.create(model="smollm2", messages=msgs)
        for _ in range(3):
            assert bob.chat.completions.create(model="sql", messages=msgs, max_tokens=50).choices
        # alice spends her 300 tokens a day; bob (no budget) is not affected
        ok, err = 0, None
        for _ in range(40):
            try:
                alice.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20)
                ok += 1
            except openai.RateLimitError as e:
                err = e
                break
        assert err is not None and ok >= 2
        assert "token budget exhausted" in str(err) and "resets at" in str(err)
        assert int(err.response.headers["retry-after"]) <= 86400
        assert bob.chat.completions.create(model="sql", messages=msgs).choices
        # the env list keeps working beside the file
        assert client(ENV_KEY).chat.completions.create(model="smollm2", messages=msgs).choices

        text = httpx.get(f"{gw}/metrics", headers=METRICS).text
        assert alice_secret not in text and bob_secret not in text
        assert metric(gw, "lorastack_gateway_key_requests_total", key="alice") == 1 + ok
        assert metric(gw, "lorastack_gateway_key_requests_total", key="bob") == 4
        # the fake reports 10 prompt tokens and 6 completion tokens per answer
        assert metric(gw, "lorastack_gateway_key_prompt_tokens_total", key="bob") == 40
        assert metric(gw, "lorastack_gateway_key_completion_tokens_total", key="bob") == 24
        assert metric(gw, "lorastack_gateway_key_completion_tokens_total", key="alice") == 6 * (
            1 + ok
        )
        rej = "lorastack_gateway_key_rejections_total"
        assert metric(gw, rej, key="alice", reason="budget_exhausted") == 1
        assert metric(gw, rej, key="alice", reason="model_not_allowed") == 1
        assert metric(gw, rej, key="bob", reason="model_not_allowed") == 1

        # live reload: revoke bob, add carol; no restart
        keys_cli(path, "revoke", "bob", capsys=capsys)
        carol_secret = keys_cli(path, "add", "carol", capsys=capsys).strip().splitlines()[-1]

        def bob_gone() -> bool:
            try:
                bob.models.list()
                return False
            except openai.AuthenticationError:
                return True

        wait_for(bob_gone)
        assert client(carol_secret).chat.completions.create(model="sql", messages=msgs).choices
