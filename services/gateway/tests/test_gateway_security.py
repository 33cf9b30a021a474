"""The gateway's trust boundary, from the attacker's (or the careless deployer's) side:
secrets refused at start (empty, placeholder, short API, admin or metrics key; keys
configured with auth off; an open bind without auth), permission checked before
existence, a 404 that lists only what the key may use, /ready's details only for the
admin key, /metrics only for the metrics key while auth is on (naming keys by alias
only), and a 4 MiB `tools` body rendered off the event loop."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from pydantic import ValidationError
from test_gateway_proxy import ADMIN, ADMIN_KEY, METRICS, METRICS_KEY, chat

from gateway.body_pool import LARGE_BODY_BYTES
from gateway.counting import count_prompts
from gateway.keys import KeyEntry, KeysFile, hash_secret, save_keys
from gateway.settings import GatewaySettings
from gateway.tokens import CountingTokenizer
from gateway.validation import parse_chat
from lorastack.cli import main as lorastack_main

GOOD_ADMIN = "x9Qe-6pV3tLr0Zs7Wm2Nk8Bc4Yh1Jd5Gf0Aa3Uo"  # 40 characters
GOOD_KEY = "sk-Zq4vR8mW1xT6nB3kJ9cH5sD2fG7yL0pA"  # 37 characters: API keys need 32


def settings(tmp_path: Path, **values: Any) -> GatewaySettings:
    return GatewaySettings(home=tmp_path, **values)


@pytest.mark.parametrize(
    ("admin_key", "why"),
    [
        ("", "admin_key is set but empty"),
        ("   ", "admin_key is set but empty"),
        ("REPLACE_ME", "admin_key is the placeholder 'REPLACE_ME'"),
        ("changeme", "admin_key is the placeholder"),
        ("<replace_me-with-a-real-key-of-40-chars>", "placeholder"),
        ("s3cret-but-short", "admin_key has 16 characters, fewer than 32"),
    ],
)
def test_a_weak_admin_key_is_refused_at_start(tmp_path: Path, admin_key: str, why: str) -> None:
    with pytest.raises(ValidationError, match=why) as e:
        settings(tmp_path, admin_key=admin_key)
    assert "secrets.token_urlsafe(32)" in str(e.value)  # says how to make a good one


def test_an_unset_or_strong_admin_key_starts(tmp_path: Path) -> None:
    assert settings(tmp_path).admin_key is None  # the admin views are off
    assert settings(tmp_path, admin_key=GOOD_ADMIN).admin_key is not None


@pytest.mark.parametrize(
    "keys", ['["REPLACE_ME"]', "changeme", f'["{GOOD_KEY}", ""]', "team=CHANGE_ME"]
)
def test_a_placeholder_or_empty_api_key_is_refused_at_start(tmp_path: Path, keys: str) -> None:
    with pytest.raises(ValidationError, match=r"api_keys\[\d\] is (the placeholder|set but empty)"):
        settings(tmp_path, api_keys=keys)


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        ('["k3Y9pQ2z"]', r"api_keys\[1\] has 8 characters, fewer than 32"),
        ("team=k3Y9pQ2z", r"api_keys\[1\] has 8 characters, fewer than 32"),  # the key, not ALIAS=
        (f'["{GOOD_KEY}", "{"x7" * 15}q"]', r"api_keys\[2\] has 31 characters, fewer than 32"),
    ],
)
def test_a_short_api_key_is_refused_at_start(tmp_path: Path, keys: str, why: str) -> None:
    with pytest.raises(ValidationError, match=why) as e:
        settings(tmp_path, api_keys=keys)
    message = e.value.errors()[0]["msg"]  # what the command prints (pydantic's repr adds input)
    assert "secrets.token_urlsafe(32)" in message  # says how to make a good one
    assert "k3Y9pQ2z" not in message  # and never echoes the key
    assert settings(tmp_path, api_keys=f'["{"x7" * 16}"]').auth_required  # 32: enough


def test_the_gateway_does_not_start_with_a_short_key_in_either_list(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's key (8 characters) in LORASTACK_API_KEYS, then in the plain keys file:
    exit 2 and a message naming the key's place and the minimum, before anything binds."""
    for name in ("LORASTACK_API_KEYS", "LORASTACK_API_KEYS_FILE", "LORASTACK_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORASTACK_API_KEYS", '["k3Y9pQ2z"]')
    assert lorastack_main(["gateway", "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert "api_keys[1] has 8 characters, fewer than 32" in err, err
    assert "k3Y9pQ2z" not in err and "Traceback" not in err
    monkeypatch.delenv("LORASTACK_API_KEYS")
    listed = tmp_path / "api-keys.txt"
    listed.write_text(f"# the team's keys\n{GOOD_KEY}\nci=k3Y9pQ2z\n")
    monkeypatch.setenv("LORASTACK_API_KEYS_FILE", str(listed))
    assert lorastack_main(["gateway", "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert f"{listed}: key 2 of api_keys_file has 8 characters, fewer than 32" in err, err
    assert "k3Y9pQ2z" not in err and "Traceback" not in err


def test_keys_configured_mean_auth_on_and_auth_off_with_keys_is_refused(tmp_path: Path) -> None:
    assert settings(tmp_path, api_keys=GOOD_KEY).auth_required  # no AUTH_ENABLED needed
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{GOOD_KEY}-from-file\n")
    assert settings(tmp_path, api_keys_file=keys).auth_required
    for values in ({"api_keys": GOOD_KEY}, {"api_keys_file": keys}):
        with pytest.raises(ValidationError, match="auth_enabled is false but API keys"):
            settings(tmp_path, auth_enabled=False, **values)
    assert not settings(tmp_path).auth_required  # no keys: off, on loopback


def test_keys_without_auth_enabled_are_enforced(make_gateway, fake) -> None:
    """Today's bug: keys set without AUTH_ENABLED were silently ignored (an open gateway)."""
    url, _ = fake
    with make_gateway([url], api_keys=[GOOD_KEY]) as gw:
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat()).status_code == 401
        ok = httpx.post(
            f"{gw}/v1/chat/completions",
            json=chat(),
            headers={"Authorization": f"Bearer {GOOD_KEY}"},
        )
        assert ok.status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.internal"])
def test_a_non_loopback_bind_without_auth_is_refused(tmp_path: Path, host: str) -> None:
    with pytest.raises(ValidationError, match="LORASTACK_GATEWAY_ALLOW_UNAUTHENTICATED=true"):
        settings(tmp_path, host=host)
    settings(tmp_path, host=host, gateway_allow_unauthenticated=True)  # on purpose: allowed
    settings(tmp_path, host=host, api_keys=GOOD_KEY)  # with auth: allowed


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_a_loopback_bind_without_auth_starts(tmp_path: Path, host: str) -> None:
    settings(tmp_path, host=host)


def test_the_command_says_what_to_change_without_a_traceback(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("LORASTACK_API_KEYS", "LORASTACK_AUTH_ENABLED", "LORASTACK_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORASTACK_ADMIN_KEY", "REPLACE_ME")
    assert lorastack_main(["gateway", "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert "admin_key is the placeholder" in err and "Traceback" not in err
    monkeypatch.delenv("LORASTACK_ADMIN_KEY")
    assert lorastack_main(["gateway", "--host", "0.0.0.0"]) == 2  # refused before it binds
    err = capsys.readouterr().err
    assert "auth is off" in err and "Traceback" not in err


def write_keys(path: Path, **models: list[str]) -> dict[str, str]:
    """A keys file with one key per name, allowed `models`; name -> secret."""
    secrets = {name: f"sk-{name}-secret" for name in models}
    entries = [
        KeyEntry(name=name, sha256=hash_secret(secrets[name]), models=allowed)
        for name, allowed in models.items()
    ]
    save_keys(path, KeysFile(keys=entries))
    return secrets


def test_permission_is_checked_before_existence(make_gateway, fake, tmp_path: Path) -> None:
    url, state = fake
    state.models.append({"id": "secret-adapter", "parent": "smollm2", "root": "/a"})
    keys = write_keys(tmp_path / "keys.yaml", narrow=["smollm2", "ghost"], other=["nothing"])
    with make_gateway([url], keys_file=tmp_path / "keys.yaml") as gw:

        def ask(secret: str, model: str, path: str = "/v1/chat/completions") -> httpx.Response:
            headers = {"Authorization": f"Bearer {secret}"}
            if path.startswith("/v1/models/"):
                return httpx.get(f"{gw}{path}{model}", headers=headers)
            return httpx.post(f"{gw}{path}", json=chat(model=model), headers=headers)

        for path in ("/v1/chat/completions", "/tokenize", "/v1/models/"):
            # a model that exists and one that does not: the same status and words
            there = ask(keys["other"], "secret-adapter", path)
            absent = ask(keys["other"], "no-such-model", path)
            assert there.status_code == absent.status_code == 403, (path, there.text)
            assert there.json()["error"]["message"].replace("secret-adapter", "M") == (
                absent.json()["error"]["message"].replace("no-such-model", "M")
            )
            # a 404 for an allowed model lists only the key's models, never the others
            missing = ask(keys["narrow"], "ghost", path)
            assert missing.status_code == 404, (path, missing.text)
            assert "secret-adapter" not in missing.text and "smollm2" in missing.text


def test_ready_says_only_ready_without_the_admin_key(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url], admin_key=ADMIN_KEY) as gw:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
            r = httpx.get(f"{gw}/ready", headers=headers)
            assert r.status_code == 200 and r.json() == {"ready": True}, r.text
            assert url not in r.text and "smollm2" not in r.text
        full = httpx.get(f"{gw}/ready", headers=ADMIN).json()
        assert full["backends"] == {url: "up"} and full["models"] == ["smollm2"]
    with make_gateway([url]) as gw:  # no admin key: no one sees the details
        assert httpx.get(f"{gw}/ready", headers=ADMIN).json() == {"ready": True}


def test_metrics_name_keys_by_alias_never_by_the_secret(make_gateway, fake) -> None:
    url, _ = fake
    secret, unnamed = "sk-team-a-" + "0123456789" * 4, "sk-unnamed-" + "9876543210" * 4
    keys = [f"team-a={secret}", unnamed]
    with make_gateway([url], api_keys=keys, metrics_key=METRICS_KEY) as gw:
        for s in (secret, unnamed):
            headers = {"Authorization": f"Bearer {s}"}
            assert httpx.post(f"{gw}/v1/chat/completions", json=chat(), headers=headers).is_success
        text = httpx.get(f"{gw}/metrics", headers=METRICS).text
    assert 'lorastack_gateway_key_requests_total{key="team-a"} 1.0' in text
    assert 'lorastack_gateway_key_requests_total{key="key-2"} 1.0' in text
    for s in (secret, unnamed):
        assert s not in text and hashlib.sha256(s.encode()).hexdigest()[:12] not in text


def test_an_unauthenticated_scrape_gets_401_and_no_key_names(make_gateway, fake) -> None:
    """The issue's scrape: /metrics on the API port named every key and backend to anyone.
    While clients need keys it answers only the metrics key (what Prometheus sends): not no
    key, a wrong one, a client's key nor the admin key; without a metrics key set, no one."""
    url, _ = fake
    secret = "sk-team-a-" + "0123456789" * 4
    refused = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {secret}"},  # a client's key
        ADMIN,  # the admin views' key is not the scrape's
        {"Authorization": METRICS_KEY},  # no scheme
    ]

    def leaks(text: str) -> bool:
        return any(s in text for s in ("team-a", url, "lorastack_gateway_", "127.0.0.1"))

    keys = {"api_keys": [f"team-a={secret}"], "admin_key": ADMIN_KEY}
    with make_gateway([url], metrics_key=METRICS_KEY, **keys) as gw:
        headers = {"Authorization": f"Bearer {secret}"}
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat(), headers=headers).is_success
        for headers in refused:
            r = httpx.get(f"{gw}/metrics", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            assert not leaks(r.text), r.text
            assert "Authorization: Bearer LORASTACK_METRICS_KEY" in r.json()["error"]["message"]
        scraped = httpx.get(f"{gw}/metrics", headers=METRICS)
        assert scraped.status_code == 200
        assert 'lorastack_gateway_key_requests_total{key="team-a"} 1.0' in scraped.text
        assert f'backend="{url}"' in scraped.text
    with make_gateway([url], **keys) as gw:  # keys, and no metrics key: no one scrapes
        for headers in [*refused, METRICS]:
            r = httpx.get(f"{gw}/metrics", headers=headers)
            assert r.status_code == 401 and not leaks(r.text), r.text
            assert "set LORASTACK_METRICS_KEY" in r.json()["error"]["message"]
    with make_gateway([url]) as gw:  # auth off, on loopback: as open as its API
        assert httpx.get(f"{gw}/metrics").status_code == 200


@pytest.mark.parametrize("metrics_key", ["", "REPLACE_ME", "too-short-for-a-scrape-key"])
def test_a_weak_metrics_key_is_refused_at_start(tmp_path: Path, metrics_key: str) -> None:
    with pytest.raises(ValidationError, match="metrics_key") as e:
        settings(tmp_path, metrics_key=metrics_key)
    assert "secrets.token_urlsafe(32)" in e.value.errors()[0]["msg"]


class LoopWitness:
    """The real tokenizer, whose rendering waits until the event loop has run another task:
    rendered on the loop, it would wait for itself (the test fails after `wait_s`)."""

    def __init__(self, real: CountingTokenizer) -> None:
        self.real = real
        self.loop_ran = threading.Event()

    def inputs(self, req: Any) -> Any:
        assert self.loop_ran.wait(timeout=60), "the event loop was blocked while rendering"
        return self.real.inputs(req)

    def count(self, inputs: Any, special: bool) -> list[int]:
        return self.real.count(inputs, special)

    def upper_bound(self, inputs: Any, special: bool) -> list[int]:
        return self.real.upper_bound(inputs, special)


def test_a_4_mib_tools_body_is_rendered_off_the_event_loop(embedded_model: Path) -> None:
    """The message is one word; the 4 MiB are in `tools`: before, only message text
    decided, so this body was rendered on the loop and stalled every other stream."""
    from transformers import AutoTokenizer

    tool = {
        "type": "function",
        "function": {"name": "f", "description": "d" * 4096, "parameters": {"type": "object"}},
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool] * 1024}
    raw_size = len(str(body).encode())
    assert raw_size > 4 * 1024 * 1024 > LARGE_BODY_BYTES
    witness = LoopWitness(CountingTokenizer(AutoTokenizer.from_pretrained(embedded_model), "m"))
    req = parse_chat(body, 8)

    async def main() -> list[int]:
        tok = cast(CountingTokenizer, witness)
        args = (tok, req, 16, 8192, "max_tokens")
        counting = asyncio.create_task(count_prompts(*args, exact_first=False, body_bytes=raw_size))
        await asyncio.sleep(0)  # counting starts; then another stream's turn on the loop
        witness.loop_ran.set()
        _inputs, counts, _later = await counting
        return counts

    counts = asyncio.run(main())
    assert len(counts) == 1 and counts[0] > 0
