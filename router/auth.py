"""Client auth of the router (when API keys are configured): `Authorization: Bearer <key>` on /v1/*,
/generate and /admin/*. `auth_error` is the check itself (the plain-ASGI hot path, router/asgi.py,
calls it on the raw header); `authorized` is the same check for a FastAPI route (router/app.py,
router/embeddings.py), answering 401 with the error model."""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse

from common.http import error_body
from router.config import RouterConfig


def auth_error(cfg: RouterConfig, authorization: str) -> str | None:
    """Why a request with this Authorization header is refused (401), or None when it may pass."""
    if not cfg.api_keys:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return "missing API key: send 'Authorization: Bearer <key>'"
    key = key.strip()
    if not any(hmac.compare_digest(key.encode(), k.encode()) for k in cfg.api_keys):
        return "invalid API key"
    return None


def authorized(cfg: RouterConfig, request: Request) -> JSONResponse | None:
    """None when the route's request may pass, else its 401 answer."""
    denied = auth_error(cfg, request.headers.get("authorization", ""))
    return None if denied is None else JSONResponse(error_body(denied, 401), status_code=401)
