"""The server's front door (tinyvllm/server/guard.py and the error handlers): the API key and
the body size are checked before the body is read, JSON depth is bounded, keys are compared as
UTF-8 bytes, error bodies hold no traceback or file path, and the OpenAPI pages are off."""
from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_server import LiveServer  # noqa: E402

KEY = "clé-ключ-🔑"                       # not ASCII: must match when sent as UTF-8
AUTH = {"Authorization": b"Bearer " + KEY.encode("utf-8")}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    from tinyvllm.server.launch import ServeOptions, build_server
    app, engine_loop = build_server(ServeOptions(
        model=str(tiny_model_dir), api_key=KEY, served_model_names=("tiny",), log_requests=False,
        max_body_bytes=MAX_BODY, engine_options=dict(device="cpu", max_model_len=256)))
    with LiveServer(app) as live:
        live.app, live.engine = app, engine_loop.engine
        live.host, live.port = "127.0.0.1", int(live.url.rsplit(":", 1)[1])
        yield live


@pytest.fixture
def client(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60, trust_env=False) as c:
        yield c


def raw_request(server, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send exactly these bytes and read the whole response (the server closes or answers)."""
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or not _complete(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2] or b"null")


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def post_head(length: int, auth: bool = True, path: str = "/v1/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json",
             f"Content-Length: {length}"]
    head = ("\r\n".join(lines) + "\r\n").encode()
    if auth:
        head += b"Authorization: Bearer " + KEY.encode("utf-8") + b"\r\n"
    return head + b"\r\n"


def test_non_ascii_api_key_matches_as_utf8_bytes(client):
    assert client.get("/v1/models", headers=AUTH).status_code == 200
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    for wrong in (b"Bearer " + KEY.encode("utf-8")[:-1], b"Bearer " + KEY.encode("latin-1", "replace"),
                  KEY.encode("utf-8"), b""):
        r = client.get("/v1/models", headers={"Authorization": wrong})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_api_key_is_checked_before_the_body_is_read(guarded):
    # a huge Content-Length and no body at all: the answer comes without the server waiting for it
    status, body = raw_request(guarded, post_head(10 * MAX_BODY, auth=False))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_content_length_over_the_limit_is_refused_unread(guarded):
    status, body = raw_request(guarded, post_head(MAX_BODY + 1))
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and str(MAX_BODY) in body["error"]["message"]
    status, body = raw_request(guarded, post_head(10**15))        # a petabyte: refused as quickly
    assert status == 413


def test_chunked_body_is_cut_off_at_the_limit(client):
    def chunks(total):
        piece = b" " * 4096
        yield b'{"prompt": "Hi", "max_tokens": 2' + b"}"[:0]
        for _ in range(total // len(piece)):
            yield piece
        yield b"}"
    r = client.post("/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                    content=chunks(2 * MAX_BODY))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client.post("/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                    content=chunks(MAX_BODY // 2))
    assert r.status_code == 200, r.text          # under the limit, chunked works as ever


@pytest.mark.parametrize("depth", [65, 20_000])
def test_deep_json_is_a_400(client, depth):
    body = b'{"prompt": "Hi", "logit_bias": ' + b"[" * depth + b"]" * depth + b"}"
    r = client.post("/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                    content=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", r.text


def test_brackets_inside_strings_do_not_count(client):
    r = client.post("/v1/completions", headers=AUTH,
                    json={"prompt": "[" * 100 + "\\\"{" * 20, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_json_depth_scanner():
    from tinyvllm.server.guard import json_depth_exceeds
    assert not json_depth_exceeds(b'{"a": [[1], {"b": [2]}]}', 4)
    assert json_depth_exceeds(b'{"a": [[1], {"b": [[2]]}]}', 4)
    assert not json_depth_exceeds(b'{"a": "[[[[[[\\"[[[[["}', 1)


def test_openapi_pages_are_off_unless_enabled(client, guarded):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404
    from fastapi.testclient import TestClient

    from tinyvllm.server.app import ServerSettings, build_app
    from tinyvllm.server.engine_loop import EngineLoop
    app = build_app(EngineLoop(guarded.engine), ServerSettings(model_names=("tiny",), enable_docs=True))
    with_docs = TestClient(app)                  # no lifespan: the engine loop is not started
    assert with_docs.get("/openapi.json").json()["info"]["title"] == "tinyvllm"
    assert with_docs.get("/docs").status_code == 200


def test_unexpected_errors_give_a_json_500_without_traceback_or_path(guarded, monkeypatch):
    from fastapi.testclient import TestClient

    from tinyvllm.server.app import ServerSettings, build_app
    from tinyvllm.server.engine_loop import EngineLoop

    def broken(*args, **kwargs):
        raise FileNotFoundError(2, "No such file", "/srv/models/secret/chat_template.jinja")

    monkeypatch.setattr(guarded.engine.tokenizer, "encode_chat", broken)
    app = build_app(EngineLoop(guarded.engine), ServerSettings(model_names=("tiny",)))
    r = TestClient(app, raise_server_exceptions=False).post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "Traceback" not in r.text and "/srv" not in r.text and "secret" not in r.text


def test_error_messages_lose_file_paths():
    from tinyvllm.server.responses import error_body
    message = error_body("/home/u/models/llama has no chat template; see /etc/x.json: bad")["error"]["message"]
    assert message == "<path> has no chat template; see <path>: bad"
    kept = "invalid sampling parameter top_k=2147483648: must be an integer in [-1, 2147483647]"
    assert error_body(kept)["error"]["message"] == kept


def test_serve_flags_reach_the_options(monkeypatch, tiny_model_dir, capsys):
    import tinyvllm.server.launch as launch
    from tinyvllm.cli import main
    seen = []
    monkeypatch.setattr(launch, "run_server", lambda options: seen.append(options) or 0)
    assert main(["serve", str(tiny_model_dir), "--device", "cpu", "--max-body-bytes", "1024",
                 "--enable-docs"]) == 0
    assert seen[0].max_body_bytes == 1024 and seen[0].enable_docs
    assert main(["serve", str(tiny_model_dir), "--device", "cpu"]) == 0
    assert seen[1].max_body_bytes == 16 * 2**20 and not seen[1].enable_docs
    for bad in ("0", "-5", "1e6"):
        assert main(["serve", str(tiny_model_dir), "--max-body-bytes", bad]) == 2
        err = capsys.readouterr().err
        assert "--max-body-bytes" in err and len(err.strip().splitlines()) == 1, err
