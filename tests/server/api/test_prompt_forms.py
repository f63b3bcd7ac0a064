"""The completions endpoint's four prompt forms read as one list of prompts; anything else, or an empty one, is a
400 naming `prompt`."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from strata.server.api.errors import invalid
from strata.server.api.protocol import MAX_PROMPTS, CompletionRequest

BODY = {"model": "m"}


@pytest.mark.parametrize("prompt,prompts", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_each_form_is_a_list_of_prompts(prompt, prompts):
    assert CompletionRequest.model_validate(BODY | {"prompt": prompt}).prompt == prompts


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []], ["a", 1], [1, "a"], [-1], [True], [1.0], [[1], "a"], 3,
                                    None, ["x"] * (MAX_PROMPTS + 1)])
def test_malformed_or_empty_prompts_are_refused_naming_prompt(prompt):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(BODY | {"prompt": prompt})
    err = invalid(info.value)
    assert (err.status, err.param) == (400, "prompt")


def test_the_published_schema_lists_the_four_forms():
    forms = CompletionRequest.model_json_schema()["properties"]["prompt"]["anyOf"]
    assert [f["type"] for f in forms] == ["string", "array", "array", "array"]
