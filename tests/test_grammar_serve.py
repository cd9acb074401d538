"""Structured output through `akunu serve` and the official openai client, on a tiny model that can write JSON."""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.grammar_fixtures import json_model, json_tokenizer


class Color(str, Enum):
    red = "red"
    blue = "blue"


class Item(BaseModel):
    name: str = Field(max_length=4)
    color: Color
    tags: list[Annotated[str, Field(max_length=3)]] = Field(max_length=2)
    note: str | None = Field(default=None, max_length=3)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=2)
    priority: Literal["low", "high"]


@pytest.fixture
def client(fake_engine, serve):
    fake_engine.loaded = dataclasses.replace(fake_engine.loaded, model=json_model(seed=1), tokenizer=json_tokenizer())
    return serve("--max-tokens", "300").client().with_options(timeout=300)  # random weights: a loaded machine is slow


def test_parse_gives_the_pydantic_object(client):
    for temperature in (0.0, 1.0):
        completion = client.beta.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "an order"}],
            response_format=Order,
            temperature=temperature,
            seed=5,
        )
        message = completion.choices[0].message
        assert isinstance(message.parsed, Order), message.content
        assert completion.choices[0].finish_reason == "stop"


def test_json_object_gives_a_json_object(client):
    completion = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "{"}],
        response_format={"type": "json_object"},
        max_tokens=300,
    )
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].message.content), dict)
    else:
        assert completion.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        "json",
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(client, response_format):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], response_format=response_format
        )
    assert caught.value.body["param"] == "response_format"


def test_a_schema_keyword_that_cannot_be_enforced_is_a_400_without_strict_too(client):
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}
    for strict in ({}, {"strict": False}, {"strict": True}):
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **strict}}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], response_format=response_format
            )
        assert caught.value.body["param"] == "response_format" and '"not"' in caught.value.body["message"]
