"""API keys map to tenants (request caches are scoped by tenant); one admin token guards the admin routes."""
from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from strata.server.api.errors import APIError

DEFAULT_TENANT = "default"


def _bearer(request: Request) -> bytes | None:
    """The bearer token as bytes: headers may carry any byte, and comparing bytes never raises on non-ASCII."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token.encode("latin-1") if scheme.lower() == "bearer" and token else None


@dataclass(slots=True)
class Auth:
    keys: dict[str, str] | None = None     # API key -> tenant; None = auth off, everyone is "default"
    admin_token: str | None = None         # None = admin routes disabled
    public_metrics: bool = False           # /metrics and /status open even with API keys

    @staticmethod
    def read_keys(path: str | Path) -> dict[str, str]:
        """Lines "<api-key> <tenant>"; blank lines, lines starting with # and " # ..." after a line are comments (a
        key may hold '#'). A key listed twice is an error, not the last line winning: it would move a caller into
        another tenant's cache. Keys must be printable ASCII, what an HTTP header carries."""
        keys: dict[str, str] = {}
        lines: dict[str, int] = {}
        for n, line in enumerate(Path(path).read_text("utf-8-sig").splitlines(), 1):   # -sig: a BOM is not a key
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or "|" in parts[1]:
                raise ValueError(f"{path}:{n}: expected '<api-key> <tenant>' (tenant without '|')")
            key, tenant = parts
            if not (key.isascii() and key.isprintable()):
                raise ValueError(f"{path}:{n}: an API key must be printable ASCII (HTTP clients send no other)")
            if key in keys:
                raise ValueError(f"{path}:{n}: the key of line {lines[key]} again (tenant {tenant!r}, was "
                                 f"{keys[key]!r}): each key names one tenant")
            keys[key], lines[key] = tenant, n
        if not keys:
            raise ValueError(f"{path}: no API keys")
        return keys

    def tenant(self, request: Request) -> str:
        """The caller's tenant; 401 when keys are configured and the bearer token is missing or unknown."""
        if self.keys is None:
            return DEFAULT_TENANT
        token = _bearer(request)
        if token is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        tenant = next((t for k, t in self.keys.items() if hmac.compare_digest(k.encode(), token)), None)
        if tenant is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return tenant

    def check_admin(self, request: Request) -> None:
        """401 without a token, 403 with a wrong one or when the server runs without --admin-token."""
        if self.admin_token is None:
            raise APIError(403, "admin routes are disabled: start the server with --admin-token", code="forbidden")
        token = _bearer(request)
        if token is None:
            raise APIError(401, "admin route: send 'Authorization: Bearer <admin-token>'", code="invalid_api_key")
        if not hmac.compare_digest(token, self.admin_token.encode()):
            raise APIError(403, "wrong admin token", code="forbidden")

    def check_ops(self, request: Request) -> None:
        """Metrics and status data are the admin's once API keys are on (they show traffic and tenants' questions),
        unless the server runs with --public-metrics; without keys they are open, as every route is."""
        if self.keys is not None and not self.public_metrics:
            self.check_admin(request)
