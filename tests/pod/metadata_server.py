"""One pod host's GCE metadata server, run inside the host's network namespace on its own
loopback (the host's processes find it by GCE_METADATA_HOST, as on a TPU VM they find
169.254.169.254; that address is never used here). Stdlib only.

It answers, with the Metadata-Flavor rule of the real one (403 without ``Metadata-Flavor:
Google``):
  - ``/computeMetadata/v1/instance/attributes/KEY``: the ``attributes`` of the state file
    (``agent-worker-number``, ``worker-network-endpoints``, the start-up script's keys), 404
    for a key not there;
  - ``/computeMetadata/v1/instance/service-accounts/default/token``: a new access token for
    this host that the pod's bucket takes for ``token_ttl`` seconds (bucket_emulator's
    ``make_token``), as ``{"access_token", "expires_in", "token_type"}``.
The state file (JSON: ``{"attributes": {...}, "token_ttl": S}``) is read at every request, so
the test changes what the host sees by rewriting it. Every token handed out is counted in
``STATE.tokens`` (one line each). Run: ``metadata_server.py STATE ADDRESS:PORT SECRET HOST``;
prints "ready" once listening."""

import http.server
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from bucket_emulator import make_token  # noqa: E402

ATTRIBUTES = "/computeMetadata/v1/instance/attributes/"
TOKEN = "/computeMetadata/v1/instance/service-accounts/default/token"


def main():
    state_path, address, secret, host = sys.argv[1:5]
    ip, port = address.rsplit(":", 1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            with open(state_path) as f:
                state = json.load(f)
            path = self.path.split("?", 1)[0]
            if self.headers.get("Metadata-Flavor") != "Google":
                return self.send_error(403, "Missing Metadata-Flavor:Google header")
            if path == TOKEN:
                ttl = state["token_ttl"]
                body = json.dumps({"access_token": make_token(secret, host, ttl),
                                   "expires_in": ttl, "token_type": "Bearer"})
                with open(state_path + ".tokens", "a") as f:
                    f.write("token\n")
                return self.answer(body, "application/json")
            if path.startswith(ATTRIBUTES) and path[len(ATTRIBUTES):] in state["attributes"]:
                return self.answer(state["attributes"][path[len(ATTRIBUTES):]], "text/plain")
            self.send_error(404)

        def answer(self, text, kind):
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((ip, int(port)), Handler)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
