"""ragfast.http: URL checks and the JSON client's retries and one-line errors."""
from __future__ import annotations

import json

import httpx
import pytest

from ragfast.errors import ConfigError, ModelError
from ragfast.http import check_url, get_json, is_url, post_json


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
