"""API-key files map keys to tenants; malformed files fail at startup with the line that is wrong."""
from __future__ import annotations

import pytest

from strata.server.api.auth import Auth


def test_read_keys(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# key tenant\nsk-a acme\n\nsk-b globex  # second tenant\n")
    assert Auth.read_keys(path) == {"sk-a": "acme", "sk-b": "globex"}


def test_a_bom_and_a_hash_inside_a_key_are_read_as_written(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("\ufeffsk-first acme\nsk-#2 globex # comment\n", encoding="utf-8")
    assert Auth.read_keys(path) == {"sk-first": "acme", "sk-#2": "globex"}


@pytest.mark.parametrize("text,needle", [("sk-a\n", ":1:"), ("sk-a acme extra\n", ":1:"), ("ok t\nsk-a a|b\n", ":2:"),
                                         ("# only comments\n", "no API keys"),
                                         ("dup acme\nok t\ndup globex\n", ":3: the key of line 1 again"),
                                         ("sk-é acme\n", ":1: an API key must be printable ASCII")])
def test_read_keys_rejects_malformed(tmp_path, text, needle):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        Auth.read_keys(path)
