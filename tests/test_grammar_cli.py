"""`akunu generate --json-schema FILE` and `--json-object` on a tiny model that can write JSON."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from tests.fakes import invoke
from tests.grammar_fixtures import json_model, json_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.fixture
def json_engine(fake_engine):
    fake_engine.loaded = dataclasses.replace(fake_engine.loaded, model=json_model(seed=2), tokenizer=json_tokenizer())
    return fake_engine


def test_json_schema_output_validates(json_engine, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    result = invoke("generate", "--raw", "weather:", "--json-schema", str(path), "--max-tokens", "80", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["finish_reason"] == "stop"
    jsonschema.validate(json.loads(data["text"]), SCHEMA)
    assert json_engine.streams[-1]["constraint"] is not None


def test_json_object_output_is_an_object(json_engine):
    result = invoke("generate", "--raw", "x", "--json-object", "--max-tokens", "200", "--temp", "1", "--seed", "3")
    assert result.exit_code == 0, result.output
    if json_engine.finals[-1].finish_reason == "stop":
        assert isinstance(json.loads(result.stdout), dict)
    else:
        assert result.stdout.startswith("{")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"$ref": "#/nowhere"}', "cannot be used"),
    ],
)
def test_a_bad_schema_file_is_one_clear_line(json_engine, tmp_path, content, message):
    path = tmp_path / "schema.json"
    path.write_text(content)
    result = invoke("generate", "--raw", "x", "--json-schema", str(path))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_missing_schema_file_exits_2_as_an_invalid_one_does(json_engine, tmp_path):
    result = invoke("generate", "--raw", "x", "--json-schema", str(tmp_path / "missing.json"))
    assert result.exit_code == 2 and "missing.json" in result.output and "Traceback" not in result.output


def test_json_schema_and_json_object_exclude_each_other(json_engine, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text("{}")
    result = invoke("generate", "x", "--json-schema", str(path), "--json-object")
    assert result.exit_code != 0 and "not both" in result.output
