"""The dashboard's access token: with ``--auth DIR`` the HTTP endpoints answer only to it.

CURVE keys protect the ZeroMQ port; a browser and Prometheus speak HTTP, so
with ``--auth DIR`` the server also requires ``DIR/http.token``: a random
secret it creates on first use (mode 0600, like a secret key) and reads on
every later start, so scrape configs and bookmarks keep working across
restarts. A client presents it as ``Authorization: Bearer TOKEN``
(Prometheus: ``authorization: {credentials_file: DIR/http.token}``), or a
browser opens ``/?token=TOKEN`` once and gets it as an HttpOnly,
SameSite=Strict cookie that the page's own requests then carry. Without
``--auth`` the endpoints stay loopback-only (or ``--insecure``) and open.
"""

from __future__ import annotations

import hmac
import os
import secrets
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from urllib.parse import parse_qs

from diloco.transport.zmq.auth import too_open

#: The token file's name inside the ``--auth`` directory.
TOKEN_FILE = "http.token"
#: The cookie a browser keeps the token in after ``/?token=...``.
COOKIE = "diloco_token"


class TokenError(Exception):
    """The token file cannot be used (too open, empty, unreadable)."""


def load_or_create_token(auth_dir: str | os.PathLike) -> tuple[str, Path, bool]:
    """(token, its file, whether it was just created) for ``auth_dir``."""
    path = Path(auth_dir) / TOKEN_FILE
    created = False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TokenError(f"{path}: cannot create the dashboard token: {exc.strerror}") from None
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        created = True
    problem = too_open(path, "the dashboard token")  # the rule for secret keys
    if problem:
        raise TokenError(problem)
    token = path.read_text().strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        raise TokenError(f"{path}: expected one token of at least 16 characters and no spaces (delete the file "
                         f"to have a new one made)")
    return token, path, created


def presented_token(environ: dict) -> tuple[str | None, bool]:
    """(the token a request carries, whether it came in the query string) from a WSGI environ."""
    auth = environ.get("HTTP_AUTHORIZATION", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip(), False
    query = parse_qs(environ.get("QUERY_STRING", ""))
    if query.get("token"):
        return query["token"][0], True
    try:
        cookie = SimpleCookie(environ.get("HTTP_COOKIE", ""))
    except CookieError:
        return None, False
    morsel = cookie.get(COOKIE)
    return (morsel.value if morsel is not None else None), False


def token_matches(presented: str | None, token: str) -> bool:
    # Constant time: how long the check takes says nothing about how much of a guess was right.
    return presented is not None and hmac.compare_digest(presented.encode(), token.encode())


def set_cookie_header(token: str) -> tuple[str, str]:
    return "Set-Cookie", f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
