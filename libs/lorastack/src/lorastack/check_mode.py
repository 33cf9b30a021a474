"""`--check`: a service's command builds what its start builds (its settings class, its
config file) and stops there, so that a deployment is known to start before it runs: a
rendered Kubernetes container run with `--check` in its own environment and files.

Owns the scan every `--check` shares and its report line: every secret setting (keys,
store credentials, the password inside a URL such as the gateway's Redis URL) is held to
`lorastack.secrets.secret_problem`, and no setting at all may still hold the REPLACE_ME of
an example file (a store endpoint left as shipped). This is stricter than a start's own
validators in one place: a store credential that is a known placeholder ("test") is
refused, which a store on loopback may use but a deployment may not. What a service
checks besides (a run config against its processes, where /admin listens) is the
service's; nothing here opens a connection.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, SecretStr

from lorastack.errors import ConfigError
from lorastack.secrets import secret_problem

MARKER = "replace_me"  # what the example files of deploy/ ship in place of a value


def secret_values(settings: BaseModel) -> dict[str, str]:
    """{setting name: value} of every secret the settings hold; a URL's password (a
    password inside `redis://:PASSWORD@host`) stands for the URL."""
    found: dict[str, str] = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        values = value if isinstance(value, list) else [value]
        secrets = [v.get_secret_value() for v in values if isinstance(v, SecretStr)]
        for n, secret in enumerate(secrets, 1):
            key = f"{name}[{n}]" if isinstance(value, list) else name
            if "://" in secret:
                password = urlsplit(secret).password
                if password is not None:
                    found[f"{key}'s password"] = password
            else:
                found[key] = secret
    return found


def placeholder_problems(settings: BaseModel) -> list[str]:
    """Why each secret may not be used, and each plain setting still holding REPLACE_ME."""
    problems = [
        why
        for name, value in secret_values(settings).items()
        if (why := secret_problem(value, name))
    ]
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if not isinstance(value, SecretStr) and MARKER in str(value).lower():
            problems.append(f"{name} is still the example's placeholder ({str(value)[:40]!r})")
    return problems


def run_check(service: str, settings: BaseModel, **facts: Any) -> int:
    """Refuse a placeholder anywhere in `settings`, else print one line saying what was
    checked (`facts`: what the service found, e.g. world_size=4) and return 0.

    Raises:
        ConfigError: every problem found, one a line.
    """
    problems = placeholder_problems(settings)
    if problems:
        raise ConfigError(
            f"{service}: " + "; ".join(problems),
            "set each value in the deployment's secrets or settings (deploy/k8s/"
            "secrets.example/README.md says which file holds it)",
        )
    said = ", ".join(f"{key} {value}" for key, value in facts.items())
    count = len(secret_values(settings))
    print(f"check passed: {service}, {count} secret(s) usable" + (f", {said}" if said else ""))
    return 0
