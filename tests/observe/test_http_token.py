"""With ``--auth DIR`` the dashboard, /api/status and /metrics answer only to DIR/http.token."""

from __future__ import annotations

import os
import stat
import urllib.error
import urllib.request
from wsgiref.util import setup_testing_defaults

import pytest

from diloco.observe.http import make_app
from diloco.observe.token import TOKEN_FILE, TokenError, load_or_create_token

TOKEN = "s3cret-token-0123456789abcdef"


class FakeObservatory:
    """What the app reads: a snapshot, and what the Prometheus registry collects from it."""

    def snapshot(self) -> dict:
        return {"phase": "RUNNING"}

    def __getattr__(self, name):  # anything else the registry asks for: nothing to report
        raise AttributeError(name)


def _get(app, path="/", query="", headers=None):
    environ = {"PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": "GET", **(headers or {})}
    setup_testing_defaults(environ)
    seen = {}

    def start_response(status, response_headers):
        seen["status"], seen["headers"] = status, dict(response_headers)

    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body


@pytest.fixture
def app(monkeypatch):
    monkeypatch.setattr("diloco.observe.http.make_registry", lambda observatory: None)
    monkeypatch.setattr("diloco.observe.http.make_wsgi_app",
                        lambda registry: lambda environ, sr: (sr("200 OK", [("Content-Type", "text/plain")]),
                                                              [b"metrics\n"])[1])
    return make_app(FakeObservatory(), TOKEN)


@pytest.mark.parametrize("path", ["/", "/api/status", "/metrics", "/nowhere"])
@pytest.mark.parametrize("headers, query", [
    ({}, ""),                                                         # nothing presented
    ({"HTTP_AUTHORIZATION": "Bearer wrong"}, ""),                     # a wrong token
    ({"HTTP_AUTHORIZATION": f"Basic {TOKEN}"}, ""),                   # not a bearer token
    ({}, "token=" + TOKEN[:-1]),                                      # a prefix of it
    ({"HTTP_COOKIE": "diloco_token=nope"}, ""),                       # a wrong cookie
    ({"HTTP_COOKIE": "diloco_token=\"unterminated"}, ""),             # a malformed cookie
])
def test_without_the_token_every_path_is_refused_with_401(app, path, headers, query):
    status, hdrs, body = _get(app, path, query, headers)
    assert status.startswith("401") and hdrs["WWW-Authenticate"] == 'Bearer realm="diloco"'
    assert b"needs its token" in body and TOKEN.encode() not in body


def test_the_token_opens_every_path_as_a_bearer_header_or_a_cookie(app):
    for headers in ({"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}, {"HTTP_COOKIE": f"other=1; diloco_token={TOKEN}"}):
        assert _get(app, "/api/status", headers=headers)[2] == b'{"phase":"RUNNING"}'
        assert _get(app, "/metrics", headers=headers)[2] == b"metrics\n"
        status, _, page = _get(app, "/", headers=headers)
        assert status.startswith("200") and b"<html" in page.lower()


def test_a_browser_opening_the_token_url_gets_a_cookie_and_a_clean_address(app):
    status, hdrs, _ = _get(app, "/", "token=" + TOKEN)
    assert status.startswith("303") and hdrs["Location"] == "/"
    assert hdrs["Set-Cookie"] == f"diloco_token={TOKEN}; Path=/; HttpOnly; SameSite=Strict"


def test_without_a_token_the_app_is_open_as_before(monkeypatch):
    monkeypatch.setattr("diloco.observe.http.make_registry", lambda observatory: None)
    monkeypatch.setattr("diloco.observe.http.make_wsgi_app", lambda registry: None)
    status, _, body = _get(make_app(FakeObservatory()), "/api/status")
    assert status.startswith("200") and body == b'{"phase":"RUNNING"}'


def test_the_token_file_is_made_once_owner_only_and_checked_like_a_secret_key(tmp_path):
    token, path, created = load_or_create_token(tmp_path)
    assert created and path == tmp_path / TOKEN_FILE and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_token(tmp_path) == (token, path, False)      # the same token on every restart
    os.chmod(path, 0o644)
    with pytest.raises(TokenError, match=r"permissions 0644 are too open: .* \(chmod 600 "):
        load_or_create_token(tmp_path)
    os.chmod(path, 0o600)
    path.write_text("short\n")
    with pytest.raises(TokenError, match="at least 16 characters"):
        load_or_create_token(tmp_path)
    with pytest.raises(TokenError, match="cannot create the dashboard token"):
        load_or_create_token(tmp_path / "missing-dir")


@pytest.mark.slow
def test_a_server_with_auth_serves_its_dashboard_only_for_the_token(tmp_path):
    """A real ``diloco server --auth DIR --http 127.0.0.1:0``: 401 without, 200 with the token."""
    import re
    import subprocess
    import sys
    import time

    from diloco.transport.zmq.auth import generate_keypair

    auth = tmp_path / "auth"
    (auth / "workers").mkdir(parents=True)
    generate_keypair("server", auth)
    generate_keypair("k1", tmp_path)
    (auth / "workers" / "k1.key").write_bytes((tmp_path / "k1.key").read_bytes())
    proc = subprocess.Popen([sys.executable, "-u", "-m", "diloco", "server", "--bind", "tcp://127.0.0.1:0",
                             "--auth", str(auth), "--http", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, address, deadline = [], None, time.monotonic() + 60
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"dashboard (http://127\.0\.0\.1:\d+)/ \(read-only, for the token in (\S+):", line)
            address = m and m.group(1)
        assert address, "".join(lines)
        assert any(f"dashboard token created: {auth / TOKEN_FILE} (mode 0600)" in ln for ln in lines), lines
        token = (auth / TOKEN_FILE).read_text().strip()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{address}/api/status", timeout=10)
        assert refused.value.code == 401
        req = urllib.request.Request(f"{address}/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and b"diloco_" in r.read()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
