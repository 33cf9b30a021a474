"""The demo task: turn a written date into an ISO 8601 date.

`make_demo(n, seed)` returns `n` distinct conversations (system prompt, user asks in
one of several phrasings, assistant answers `YYYY-MM-DD`), deterministic from the
seed. A 135M model gets ~0% exact match before training and learns it in minutes.
"""

from __future__ import annotations

import calendar
import random

from lorastack.chat_data import Conversation, Message

SYSTEM = "You convert dates to ISO 8601 (YYYY-MM-DD). Answer with the date only."

_ORDINALS = [
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
    "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth",
    "seventeenth", "eighteenth", "nineteenth", "twentieth", "twenty-first", "twenty-second",
    "twenty-third", "twenty-fourth", "twenty-fifth", "twenty-sixth", "twenty-seventh",
    "twenty-eighth", "twenty-ninth", "thirtieth", "thirty-first",
]  # fmt: skip
_SUFFIX = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}

_DATE_FORMS = [
    lambda d, m, y: f"the {_ORDINALS[d - 1]} of {m}, {y}",
    lambda d, m, y: f"{m} {d}, {y}",
    lambda d, m, y: f"{d} {m} {y}",
    lambda d, m, y: f"{m} {d}{_SUFFIX.get(d, 'th')}, {y}",
    lambda d, m, y: f"{d}{_SUFFIX.get(d, 'th')} of {m} {y}",
]
_ASKS = [
    "Convert to ISO 8601: {date}",
    "What is {date} in ISO format?",
    "Write {date} as YYYY-MM-DD.",
    "ISO date for {date}, please.",
    "Please give me {date} as an ISO 8601 date.",
]


def make_demo(n: int = 200, seed: int = 0) -> list[Conversation]:
    """`n` distinct date conversations; the same (n, seed) gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Conversation] = []
    while len(out) < n:
        year = rng.randint(1900, 2099)
        month = rng.randint(1, 12)
        day = rng.randint(1, calendar.monthrange(year, month)[1])
        written = rng.choice(_DATE_FORMS)(day, calendar.month_name[month], year)
        question = rng.choice(_ASKS).format(date=written)
        if question in seen:
            continue
        seen.add(question)
        out.append(
            Conversation(
                messages=[
                    Message(role="system", content=SYSTEM),
                    Message(role="user", content=question),
                    Message(role="assistant", content=f"{year:04d}-{month:02d}-{day:02d}"),
                ]
            )
        )
    return out
