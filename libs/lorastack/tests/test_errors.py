"""`field_errors`: a pydantic error worded as the fields it names, for every service's messages."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from lorastack.errors import field_errors


class Lora(BaseModel):
    r: int = Field(8, gt=0)

    @field_validator("r")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError("r must be even")
        return v


class Run(BaseModel):
    lora: Lora = Field(default_factory=Lora)
    steps: list[int] = Field(default_factory=list)
    lr: float = 1e-4
    warmup: float = 0.0

    @model_validator(mode="after")
    def _warmup_below_lr(self) -> Run:
        if self.warmup > self.lr:
            raise ValueError("warmup must not exceed lr")
        return self


def _errors(**data: object) -> ValidationError:
    with pytest.raises(ValidationError) as e:
        Run.model_validate(data)
    return e.value


def test_each_entry_names_its_dotted_field_and_the_message() -> None:
    e = _errors(lora={"r": 0}, steps=[1, "x"])
    assert field_errors(e) == [
        ("lora.r", "Input should be greater than 0"),
        ("steps.1", "Input should be a valid integer, unable to parse string as an integer"),
    ]


def test_a_validator_s_own_message_loses_pydantic_s_prefix() -> None:
    assert field_errors(_errors(lora={"r": 3})) == [("lora.r", "r must be even")]


def test_an_entry_about_the_whole_object_is_named_by_whole() -> None:
    e = _errors(lr=0.1, warmup=0.5)
    assert field_errors(e, "config") == [("config", "warmup must not exceed lr")]
    assert field_errors(e) == [("", "warmup must not exceed lr")]
