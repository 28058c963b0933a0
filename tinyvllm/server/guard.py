"""What every HTTP request passes before a route sees it: a pure ASGI middleware, so that a
request refused here has had nothing read or parsed on its behalf.

    1. the API key (/v1 routes, with --api-key): compared in constant time with the header's raw
       bytes, so a key holding non-ASCII characters matches when sent as UTF-8 -> 401
    2. the body's size: a Content-Length above --max-body-bytes is refused unread; a body sent
       without one (chunked) is read only up to the limit                       -> 413
    3. the JSON nesting depth of the body: at most MAX_JSON_DEPTH levels (Python's parser recurses
       once per level: a body of 100k "[" would end in a RecursionError, a 500)  -> 400

The body, once read here, is handed to the app as one message; after it the app's receive() is
the client's own again (http.disconnect when it hangs up)."""
from __future__ import annotations

import hmac
import re

from fastapi.responses import JSONResponse

from tinyvllm.server import responses as R

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

# A JSON string (the unrolled form: fast on megabytes of text) or one bracket.
_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def key_matches(authorization: bytes, api_key: str) -> bool:
    """`Authorization: Bearer KEY`, compared as UTF-8 bytes in constant time."""
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode("utf-8"))


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays/objects more than `limit` deep (brackets inside strings
    do not count). Bodies with few brackets at all, nearly every one, are not scanned."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for token in _JSON_TOKENS.finditer(body):
        c = token.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(R.error_body(message, code=code), status_code=status)


class RequestGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int,
                 max_json_depth: int = MAX_JSON_DEPTH):
        self.app, self.api_key = app, api_key
        self.max_body_bytes, self.max_json_depth = max_body_bytes, max_json_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._check_headers(scope)
        if refusal is None and scope["method"] in BODY_METHODS:
            body, refusal = await self._read_body(receive)
            if body is None and refusal is None:      # the client hung up mid-body
                return
            if refusal is None and json_depth_exceeds(body, self.max_json_depth):
                refusal = _error(400, f"request body: JSON nested more than {self.max_json_depth} "
                                      "levels deep", "json_too_deep")
            receive = _replay(body, receive)
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def _check_headers(self, scope) -> JSONResponse | None:
        path, headers = scope["path"], scope["headers"]
        if self.api_key is not None and scope["method"] != "OPTIONS" and \
                (path == "/v1" or path.startswith("/v1/")):
            given = next((v for k, v in headers if k == b"authorization"), b"")
            if not key_matches(given, self.api_key):
                return _error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              "invalid_api_key")
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None:
            if not length.strip().isdigit():
                return _error(400, "invalid Content-Length header")
            if int(length) > self.max_body_bytes:
                return self._too_large(int(length))
        return None

    def _too_large(self, size: int | None) -> JSONResponse:
        what = f"{size} bytes" if size is not None else "more bytes than that"
        return _error(413, f"request body is {what}; this server accepts at most "
                           f"{self.max_body_bytes} (--max-body-bytes)", "request_too_large")

    async def _read_body(self, receive) -> tuple[bytes | None, JSONResponse | None]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", self._too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
