"""A Hugging Face Hub on loopback for tests: the HTTP shape huggingface_hub speaks to (``/api/models/<repo>/revision/
<rev>``, ``/<repo>/resolve/<rev>/<file>`` with HEAD, GET and ``Range``, the ``X-Error-Code`` headers), serving repos
from local folders; it counts the bytes it sends per repo and records every range of every file."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

TOKEN = "hf_loopback_test_token"


@dataclass
class Repo:
    """A repo served from ``folder``: ``gated`` answers 401 GatedRepo to a request without :data:`TOKEN`."""

    folder: Path
    gated: bool = False
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            h = hashlib.sha1(str(self.folder).encode())
            for p in sorted(self.folder.iterdir()):
                h.update(p.name.encode() + p.read_bytes())
            self.commit = h.hexdigest()


@dataclass
class Hub:
    """The served repos and what was sent: ``sent_bytes[repo]`` body bytes, ``ranges[(repo, file)]`` the
    ``(start, end)`` of every GET of a file (end inclusive), ``requests`` every (method, path, status)."""

    repos: dict[str, Repo]
    sent_bytes: dict[str, int] = field(default_factory=dict)
    ranges: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        log_message = staticmethod(lambda *args: None)  # quiet

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, repo: str | None = None):
            self.send_response(status)
            headers = dict(headers or {})
            headers.setdefault("Content-Length", len(body))
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.end_headers()
            with hub.lock:
                hub.requests.append((self.command, self.path, status))
                if repo and self.command != "HEAD":
                    hub.sent_bytes[repo] = hub.sent_bytes.get(repo, 0) + len(body)
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str, repo: str | None = None):
            self._send(status, json.dumps({"error": code}).encode(),
                       {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"}, repo)

        def _repo(self, repo_id: str) -> Repo | None:
            r = hub.repos.get(repo_id)
            if r is None:
                self._error(404, "RepoNotFound")
                return None
            if r.gated and self.headers.get("authorization") != f"Bearer {TOKEN}":
                self._error(401, "GatedRepo", repo_id)
                return None
            return r

        def do_GET(self):
            path = unquote(urlparse(self.path).path)
            m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$", path)
            if m:
                return self._info(m.group(1), m.group(2))
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if m:
                return self._file(m.group(1), m.group(2), m.group(3))
            self._error(404, "EntryNotFound")

        do_HEAD = do_GET

        def _info(self, repo_id: str, rev: str):
            r = hub.repos.get(repo_id)
            if r is None:
                return self._error(404, "RepoNotFound")
            if rev not in ("main", r.commit):
                return self._error(404, "RevisionNotFound", repo_id)
            siblings = [{"rfilename": p.name, "size": p.stat().st_size} for p in sorted(r.folder.iterdir())]
            body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": r.commit, "private": False,
                               "gated": "manual" if r.gated else False, "siblings": siblings}).encode()
            self._send(200, body, {"Content-Type": "application/json"}, repo_id)

        def _file(self, repo_id: str, rev: str, filename: str):
            r = self._repo(repo_id)
            if r is None:
                return
            if rev not in ("main", r.commit):
                return self._error(404, "RevisionNotFound", repo_id)
            p = r.folder / filename
            if not p.is_file():
                return self._error(404, "EntryNotFound", repo_id)
            data = p.read_bytes()
            etag = hashlib.sha256(data).hexdigest()
            headers = {"X-Repo-Commit": r.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            rng = self.headers.get("range")
            if self.command == "HEAD":
                return self._send(200, b"", {**headers, "Content-Length": len(data)}, repo_id)
            start, end, status = 0, len(data) - 1, 200
            if rng:
                a, b = re.match(r"bytes=(\d+)-(\d*)", rng).groups()
                start, end, status = int(a), min(int(b) if b else len(data) - 1, len(data) - 1), 206
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            with hub.lock:
                hub.ranges.setdefault((repo_id, filename), []).append((start, end))
            self._send(status, data[start:end + 1], headers, repo_id)

    return Handler


def serve(repos: dict[str, Repo]):
    """Start the server on 127.0.0.1 (a free port) in a daemon thread; returns (Hub, server)."""
    hub = Hub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    return hub, server
