"""The tool-calling demo task: pick the right function (weather or calculator) and fill
its arguments from the question.

`make_tool_demo(n, seed)` returns `n` distinct conversations in the OpenAI fine-tuning
format, deterministic from the seed. Each offers both functions in `tools`, and goes:
user asks -> assistant calls -> tool answers -> assistant answers in words -> user asks
again -> assistant calls (the last message: the target that eval scores as "right
function, valid arguments"). Training supervises both calls and the worded answer; the
tool result is context. Which function the second question needs is drawn independently
of the first, so copying the first call is wrong half the time.
"""

from __future__ import annotations

import json
import random
from typing import Any

from lorastack.chat_data import Conversation
from lorastack.chat_tools import dump_arguments

SYSTEM = "You answer with the tools you are given: call one when a question needs it."

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Apply an arithmetic operation to two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "operation": {
                        "type": "string",
                        "enum": ["add", "subtract", "multiply", "divide"],
                    },
                    "a": {"type": "number"},
                    "b": {"type": "number"},
                },
                "required": ["operation", "a", "b"],
            },
        },
    },
]

_CITIES = [
    "Oslo", "Paris", "Lima", "Tokyo", "Nairobi", "Berlin", "Quito", "Hanoi", "Dublin",
    "Cairo", "Perth", "Toronto", "Seoul", "Madrid", "Accra", "Lisbon", "Denver", "Riga",
]  # fmt: skip
_WEATHER_ASKS = [
    "What's the weather in {city} in {unit}?",
    "How warm is it in {city}? Give me {unit}.",
    "Tell me the temperature in {city}, in {unit} please.",
    "Weather for {city} ({unit})?",
]
_OPS = {"add": ("plus", "+"), "subtract": ("minus", "-"), "multiply": ("times", "*"),
        "divide": ("divided by", "/")}  # fmt: skip
_CALC_ASKS = [
    "What is {a} {word} {b}?",
    "Compute {a} {symbol} {b}.",
    "Can you work out {a} {word} {b}?",
    "{a} {symbol} {b} = ?",
]


def _weather(rng: random.Random) -> tuple[str, str, dict[str, Any], dict[str, Any], str]:
    city, unit = rng.choice(_CITIES), rng.choice(["celsius", "fahrenheit"])
    temp = rng.randint(-10, 35) if unit == "celsius" else rng.randint(14, 95)
    ask = rng.choice(_WEATHER_ASKS).format(city=city, unit=unit)
    result = {"city": city, "temperature": temp, "unit": unit}
    answer = f"It is {temp} degrees {unit} in {city}."
    return ask, "get_weather", {"city": city, "unit": unit}, result, answer


def _calc(rng: random.Random) -> tuple[str, str, dict[str, Any], dict[str, Any], str]:
    op = rng.choice(list(_OPS))
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    word, symbol = _OPS[op]
    ask = rng.choice(_CALC_ASKS).format(a=a, b=b, word=word, symbol=symbol)
    value = {"add": a + b, "subtract": a - b, "multiply": a * b, "divide": round(a / b, 4)}[op]
    answer = f"{a} {word} {b} is {value}."
    return ask, "calculate", {"operation": op, "a": a, "b": b}, {"result": value}, answer


def _call(rng: random.Random, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call_id = f"call_{rng.getrandbits(48):012x}"
    fn = {"name": name, "arguments": dump_arguments(arguments)}
    return {"id": call_id, "type": "function", "function": fn}


def make_tool_demo(n: int = 200, seed: int = 0) -> list[Conversation]:
    """`n` distinct tool-calling conversations; the same (n, seed) gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Conversation] = []
    while len(out) < n:
        ask1, name1, args1, result1, answer1 = rng.choice((_weather, _calc))(rng)
        ask2, name2, args2, _, _ = rng.choice((_weather, _calc))(rng)
        key = f"{ask1}\n{ask2}"
        if key in seen or ask1 == ask2:
            continue
        seen.add(key)
        first, second = _call(rng, name1, args1), _call(rng, name2, args2)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": ask1},
            {"role": "assistant", "content": None, "tool_calls": [first]},
            {"role": "tool", "tool_call_id": first["id"], "content": json.dumps(result1)},
            {"role": "assistant", "content": answer1},
            {"role": "user", "content": ask2},
            {"role": "assistant", "content": None, "tool_calls": [second]},
        ]
        out.append(Conversation.model_validate({"tools": TOOLS, "messages": messages}))
    return out
