"""ragfast.infra.http: URL checks and the JSON client's retries and one-line errors."""
from __future__ import annotations

import json

import httpx
import pytest

from ragfast.errors import ConfigError, ModelError, RagfastError
from ragfast.infra.http import check_url, get_json, is_url, post_json


def test_is_url_and_check_url():
    assert is_url("http://a:1") and is_url("https://a")
    assert not is_url("localhost:1") and not is_url("/models/x") and not is_url(None)
    assert check_url("http://a:1", "retriever URL") == "http://a:1"
    with pytest.raises(ConfigError, match="retriever URL must start with http:// or https://"):
        check_url("localhost:1", "retriever URL")


def _client(answers):
    """A client whose transport plays ``answers`` (status, body) in order, recording the requests."""
    seen = []

    def handle(request):
        seen.append((request.method, str(request.url), request.content))
        status, body = answers[min(len(seen), len(answers)) - 1]
        if status is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(status, text=body) if isinstance(body, str) else httpx.Response(status, json=body)

    return httpx.Client(transport=httpx.MockTransport(handle)), seen


def test_5xx_and_connection_errors_are_retried(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    client, seen = _client([(None, None), (503, "busy"), (200, {"ok": 1})])
    assert post_json(client, "http://s/x", {"a": 1}, retries=2, error=ModelError) == {"ok": 1}
    assert len(seen) == 3 and seen[0][0] == "POST" and json.loads(seen[0][2]) == {"a": 1}
    client, seen = _client([(500, "no"), (200, {"data": []})])
    assert get_json(client, "http://s/models", retries=1) == {"data": []}
    assert [m for m, _, _ in seen] == ["GET", "GET"]


def test_final_errors_are_one_line(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    client, seen = _client([(404, "not\nfound\n here")])
    with pytest.raises(ModelError, match=r"^http://s/x answered 404: not found here$"):
        post_json(client, "http://s/x", {}, retries=3, error=ModelError)
    assert len(seen) == 1  # a 4xx answer is final
    client, _ = _client([(200, "<html>")])
    with pytest.raises(ModelError, match="did not answer JSON"):
        get_json(client, "http://s/x", error=ModelError)
    client, seen = _client([(None, None)])
    with pytest.raises(ModelError, match=r"cannot reach http://s/x after 3 attempts"):
        get_json(client, "http://s/x", retries=2, error=ModelError)
    assert len(seen) == 3


def test_408_and_429_are_retried_and_every_error_says_whether_a_retry_might_pass(monkeypatch):
    from ragfast.errors import is_transient

    monkeypatch.setattr("time.sleep", lambda s: None)
    client, seen = _client([(429, "slow down"), (408, "timed out"), (200, {"ok": 1})])
    assert post_json(client, "http://s/x", {}, retries=2, error=ModelError) == {"ok": 1} and len(seen) == 3

    def final(answers, retries=1):
        client, _ = _client(answers)
        with pytest.raises(ModelError) as exc:
            post_json(client, "http://s/x", {}, retries=retries, error=ModelError)
        return exc.value

    # the server refuses this input: a retry cannot pass
    refused = final([(400, "maximum context length is 4096 tokens")])
    assert not is_transient(refused) and "answered 400" in str(refused)
    assert not is_transient(final([(422, "bad")])) and not is_transient(final([(200, "<html>")]))
    # retries spent on a failure a later retry might pass
    for answers in ([(503, "busy")], [(429, "slow")], [(408, "late")], [(None, None)]):
        assert is_transient(final(answers)), answers


def test_wait_until_up_returns_on_200_and_fails_in_one_line_otherwise():
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ragfast.infra.http import wait_until_up

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # 200 on /health only, as a server that is up but has no /v1/models
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        wait_until_up(url, lambda: True, 10)
        with pytest.raises(ConfigError, match=r"^srv did not answer .*/v1/models within 0 s; see x\.log$"):
            wait_until_up(url, lambda: True, 0, path="/v1/models", what="srv", poll_s=0.01, error=ConfigError,
                          see="; see x.log")
    finally:
        srv.shutdown()
    with socket.socket() as sk:  # a port nobody listens on, and a process that has exited
        sk.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sk.getsockname()[1]}"
    with pytest.raises(RagfastError, match="^llama-server exited before it answered"):
        wait_until_up(closed, lambda: False, 60, what="llama-server")
