"""A local HTTP server that replays scripted LLM API responses in each provider's wire format.

The real SDK clients talk to it as they would to the provider: point Anthropic's `base_url`
at `server.url` (the SDK appends `/v1/messages`) and OpenAI's at `server.url + "/v1"` (the
SDK appends `/chat/completions`). Each request takes the next entry of the script, whatever
its path; the provider's format is chosen by the path. A script that runs out answers 418,
which no client retries, so a test that makes more calls than it scripted fails loudly.

Requests are recorded with their JSON bodies, but never with an API key: the `x-api-key`,
`authorization` and `api-key` headers are dropped, and only which one came (and, when the
server was given the expected key, whether it matched) is kept.

A `raw` entry sends any bytes with any status and content type (a truncated JSON body, an
HTML page from a proxy), and `answer(None)` a completion whose message content is null.

    server = ReplayServer([error(429, headers={"retry-after": "0.1"}), answer("hi")]).start()
    ...
    server.stop()
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

AUTH_HEADERS = ("x-api-key", "authorization", "api-key")


@dataclass(frozen=True)
class Entry:
    """One scripted response. Build them with `answer`, `error`, `delay` and `reset`."""
    kind: str  # "answer", "error", "raw" or "reset"
    text: str | None = ""
    input_tokens: int = 10
    output_tokens: int = 5
    status: int = 200
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds before responding (longer than the client's timeout: a timeout)


def answer(text: str | None, input_tokens: int = 10, output_tokens: int = 5, delay: float = 0.0) -> Entry:
    """A successful completion whose text is `text` (a malformed answer is just unexpected text;
    None: the message content is null, or for Anthropic there is no content block)."""
    return Entry("answer", text=text, input_tokens=input_tokens, output_tokens=output_tokens, delay=delay)


def error(status: int, message: str = "", headers: dict[str, str] | None = None) -> Entry:
    """An error status with the provider's error JSON, e.g. error(429, headers={"retry-after": "0.1"})."""
    return Entry("error", status=status, message=message or f"replayed error {status}", headers=headers or {})


def delay(seconds: float, text: str = "too late") -> Entry:
    """An answer that comes only after `seconds`: longer than the client's timeout, it times out."""
    return answer(text, delay=seconds)


def raw(body: str, status: int = 200, content_type: str = "application/json") -> Entry:
    """Exactly these bytes as the response body, e.g. raw('{"id": "msg_', ) or raw("<html>", content_type="text/html")."""
    return Entry("raw", text=body, status=status, headers={"content-type": content_type})


def reset() -> Entry:
    """Read the request, then reset the connection without sending a response."""
    return Entry("reset")


# The error types each API sends with a status (the Anthropic names from its errors page).
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 529: "overloaded_error"}
OPENAI_ERRORS = {400: "invalid_request_error", 401: "invalid_request_error", 429: "rate_limit_exceeded",
                 500: "server_error", 503: "server_error"}


def anthropic_body(entry: Entry, request: dict) -> dict:
    if entry.kind == "error":
        kind = ANTHROPIC_ERRORS.get(entry.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": entry.message},
                "request_id": "req_replay"}
    content = [] if entry.text is None else [{"type": "text", "text": entry.text}]
    return {"id": "msg_replay", "type": "message", "role": "assistant", "model": request.get("model", ""),
            "content": content, "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": entry.input_tokens, "output_tokens": entry.output_tokens}}


def openai_body(entry: Entry, request: dict) -> dict:
    if entry.kind == "error":
        code = OPENAI_ERRORS.get(entry.status, "server_error")
        return {"error": {"message": entry.message, "type": code, "param": None, "code": code}}
    return {"id": "chatcmpl-replay", "object": "chat.completion", "created": int(time.time()),
            "model": request.get("model", ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": entry.text, "refusal": None},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": entry.input_tokens, "completion_tokens": entry.output_tokens,
                      "total_tokens": entry.input_tokens + entry.output_tokens}}


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]  # lower-cased names, auth headers removed
    auth_header: str | None  # which auth header came: "x-api-key", "authorization" or None
    auth_ok: bool | None  # whether it carried the expected key (None: the server was given none)
    body: dict
    at: float


class ReplayServer:
    def __init__(self, script: list[Entry], api_key: str | None = None):
        self.script = list(script)
        self.api_key = api_key
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None, "start() the server first"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ReplayServer":
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "ReplayServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _take(self, recorded: Recorded) -> Entry | None:
        with self._lock:
            self.requests.append(recorded)
            return self.script.pop(0) if self.script else None

    def _auth(self, headers: dict[str, str]) -> tuple[str | None, bool | None]:
        name = next((h for h in AUTH_HEADERS if h in headers), None)
        if name is None or self.api_key is None:
            return name, None
        value = headers[name]
        return name, value in (self.api_key, f"Bearer {self.api_key}")


def _handler(server: ReplayServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args) -> None:  # quiet; the test reads server.requests
            pass

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k.lower(): v for k, v in self.headers.items()}
            auth_header, auth_ok = server._auth(headers)
            kept = {k: v for k, v in headers.items() if k not in AUTH_HEADERS}
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = {"_unparsed": raw.decode(errors="replace")}
            entry = server._take(Recorded(self.path, kept, auth_header, auth_ok, body, time.time()))
            if self.path.endswith("/messages"):
                shape = anthropic_body
            elif self.path.endswith("/chat/completions"):
                shape = openai_body
            else:
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            if entry is None:
                return self._send(418, shape(error(418, "replay script exhausted"), body))
            if entry.delay:
                time.sleep(entry.delay)
            if entry.kind == "raw":
                return self._send_bytes(entry.status, entry.text.encode(), entry.headers["content-type"])
            if entry.kind == "reset":
                # SO_LINGER 0: close() sends a TCP RST instead of an orderly FIN.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True
                return
            self._send(entry.status, shape(entry, body), entry.headers)

        def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
            self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

        def _send_bytes(self, status: int, data: bytes, content_type: str,
                        headers: dict[str, str] | None = None) -> None:
            try:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (timed out) before the answer came
                self.close_connection = True

    return Handler
