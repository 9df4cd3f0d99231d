"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, serving repos from a folder
(<root>/<org>/<name>/<files>) at one commit: the routes huggingface_hub calls to list a repo
and download its files, and the hub's error codes for an unknown repo or revision. Point
HF_ENDPOINT at `url` (read by huggingface_hub at import: use it in a subprocess)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "c" * 40


class HubStandIn:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []  # "GET /path", in order
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> list[str]:
        base = self.root / repo
        return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._route(head=False)

            def do_HEAD(self) -> None:
                self._route(head=True)

            def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(code)
                for key, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(key, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, code: str, message: str, head: bool) -> None:
                self._send(404, json.dumps({"error": message}).encode(),
                           {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
                           head)

            def _route(self, head: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
                file = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if api:
                    repo, revision = api[1], api[3]
                elif file:
                    repo, revision = file[1], file[2]
                else:
                    return self._error("EntryNotFound", f"no route {path}", head)
                if not (hub.root / repo).is_dir():
                    return self._error("RepoNotFound", "Repository not found", head)
                if revision not in ("main", COMMIT):
                    return self._error("RevisionNotFound", "Invalid rev id", head)
                if api and api[2] == "revision":
                    body = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in hub.files(repo)]}
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                if api:
                    body = [{"type": "file", "path": f, "size": (hub.root / repo / f).stat().st_size,
                             "oid": hashlib.sha1(f.encode()).hexdigest()} for f in hub.files(repo)]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                target = hub.root / repo / file[3]
                if not target.is_file():
                    return self._error("EntryNotFound", "Entry not found", head)
                data = target.read_bytes()
                self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'},
                           head)

        return Handler
