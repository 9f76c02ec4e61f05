"""A local stand-in for the Hugging Face Hub's HTTP API: the routes huggingface_hub's `create_repo` and `upload_folder`
call (repo creation, README metadata validation, preupload answering "regular" for every file, a commit whose files
come inline), serving from a thread; point HF_ENDPOINT at `url`. It keeps what it was sent."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubStandIn:
    def __init__(self):
        self.created: list[dict] = []  # the create_repo payloads
        self.files: dict[str, dict[str, bytes]] = {}  # repo id -> path -> content, as committed
        self.tokens: list[str] = []  # the Authorization headers received
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.tokens.append(self.headers.get("Authorization", ""))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    payload = json.loads(body)
                    hub.created.append(payload)
                    repo = f"{payload['organization']}/{payload['name']}"
                    hub.files.setdefault(repo, {})
                    return self._reply(200, {"url": f"{hub.url}/{repo}", "name": repo})
                if path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
                if not match or match[1] not in hub.files:
                    return self._reply(404, {"error": f"no route {path} here"})
                repo = match[1]
                if match[2] == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]})
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        value = item["value"]
                        assert value["encoding"] == "base64"
                        hub.files[repo][value["path"]] = base64.b64decode(value["content"])
                    elif item["key"] != "header":
                        return self._reply(400, {"error": f"{item['key']} is not served here"})
                return self._reply(200, {
                    "commitUrl": f"{hub.url}/{repo}/commit/{'0' * 40}", "commitOid": "0" * 40,
                    "pullRequestUrl": None,
                })

        return Handler
