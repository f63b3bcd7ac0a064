"""API-key files map keys to tenants; malformed files fail at startup with the line that is wrong."""
from __future__ import annotations

import pytest

from strata.server.api.auth import Auth


def test_read_keys(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# key tenant\nsk-a acme\n\nsk-b globex  # second tenant\n")
    assert Auth.read_keys(path) == {"sk-a": "acme", "sk-b": "globex"}


@pytest.mark.parametrize("text,needle", [("sk-a\n", ":1:"), ("sk-a acme extra\n", ":1:"), ("ok t\nsk-a a|b\n", ":2:"),
                                         ("# only comments\n", "no API keys")])
def test_read_keys_rejects_malformed(tmp_path, text, needle):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        Auth.read_keys(path)
