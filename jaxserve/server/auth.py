"""`--api-key`: every request must carry `Authorization: Bearer KEY` (the scheme in any case), except
probes and scrapes: paths starting /health, /ready or /metrics, as SGLang 0.5.23 (srt/utils/auth.py)
lets them through so that Kubernetes probes and Prometheus need no secret.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware would wrap streamed responses and hide the
client's disconnect from them).
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server.errors import error_body

OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")  # by prefix, as SGLang: /health_generate too


class APIKeyMiddleware:
    """Answers 401 (OpenAI's error shape) when the bearer token is missing or wrong."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PATH_PREFIXES):
            await self.app(scope, receive, send)
            return
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # compare_digest even for a wrong scheme: the time taken does not tell which part was wrong
        if not (hmac.compare_digest(token, self._expected) and scheme.lower() == b"bearer"):
            body = error_body("invalid or missing API key (send 'Authorization: Bearer KEY')", 401, code="invalid_api_key")
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)
