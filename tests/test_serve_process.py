"""`paged-serve` as a real process on a tiny exported Llama, driven over raw sockets where the finding is about the
connection itself (issue 37): a 50 MB body refused before it is read whole while /health answers; 300 half-open
connections
(silent, partial headers, idle keep-alive) dropped after the timeouts; a slow body gets a 408 and a dropped upload
is one log line, never a traceback; a foreign Host refused on a loopback bind; the API key from PAGEDKIT_API_KEY;
the KV pool printed at start. Every check is an ordering (what came before what), never a speed bound."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from test_serve_helpers import ServeCommand, tiny_served_model

KEY = "sk-process-37"
AUTH = {"Authorization": f"Bearer {KEY}"}
MB = 2 ** 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_served_model(tmp_path_factory.mktemp("proc") / "tiny-llama")
    log = tmp_path_factory.mktemp("proc-log") / "server.log"
    cmd = ServeCommand(model, "--header-timeout", "1", "--keep-alive-timeout", "1", "--body-timeout", "2",
                       "--log-level", "info", env={"PAGEDKIT_API_KEY": KEY}, log=log)
    with cmd as url:
        yield cmd, url


def _head(port: int, method: str, path: str, length: int | None = None, host: str = "127.0.0.1",
          chunked: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Authorization: Bearer {KEY}"]
    lines += ["Transfer-Encoding: chunked"] if chunked else [f"Content-Length: {length}"] if length is not None else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket, timeout: float = 30) -> tuple[int, dict, bytes]:
    """One HTTP response read off a socket (Content-Length framed): status, headers, body."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_kv_pool_printed_and_api_key_from_the_environment(server):
    cmd, url = server
    out = cmd.output()
    assert "paged-serve: KV cache: full " in out and "sized by available RAM x 0.25" in out, out
    assert "API key required" in out, out
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 401
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200, r.text


def test_a_50mb_body_is_refused_before_it_is_read_whole(server):
    cmd, url = server
    total = 50 * MB
    # declared: the 413 comes back after the headers and 1 MiB of body
    with socket.create_connection(("127.0.0.1", cmd.port)) as sock:
        sock.sendall(_head(cmd.port, "POST", "/v1/completions", total) + b'{"prompt": "' + b"hello " * (MB // 6))
        status, headers, body = _response(sock)
        assert status == 413 and headers["connection"] == "close", (status, headers)
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert _closed_by_server(sock, 30)
    # chunked (no length announced): refused once 8 MiB came, /health answering while the body streams in
    with socket.create_connection(("127.0.0.1", cmd.port)) as sock:
        start = b'{"prompt": "'
        sock.sendall(_head(cmd.port, "POST", "/v1/completions", chunked=True) + b"%x\r\n%s\r\n" % (len(start), start))
        piece = b"hello " * (MB // 6)
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sent, answered = 0, False
        while sent < total and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
            if not answered:
                assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"  # mid-upload
                answered = True
            select.select([sock], [], [], 0.05)
        status, headers, body = _response(sock)
    assert status == 413 and sent < total, (status, sent)
    assert httpx.get(f"{url}/health").json()["pending_requests"] == 0


def test_half_open_connections_are_dropped_after_the_timeouts(server):
    cmd, url = server
    socks = []
    for i in range(300):
        sock = socket.create_connection(("127.0.0.1", cmd.port))
        if i % 3 == 1:  # a request line and part of its headers, never the rest
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: app")
        elif i % 3 == 2:  # one request, then idle on the kept-alive connection
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{cmd.port}\r\n\r\n".encode())
            assert _response(sock)[0] == 200
        socks.append(sock)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # the server answers with 300 held
    deadline = time.monotonic() + 60
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        readable, _, _ = select.select(open_, [], [], 0.5)
        for sock in readable:
            if _closed_by_server(sock, 1):
                open_.remove(sock)
    kinds = sorted({socks.index(s) % 3 for s in open_})
    for sock in socks:
        sock.close()
    assert not open_, f"{len(open_)} connections still open (kinds {kinds}: 0 silent, 1 partial headers, 2 idle)"
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_slow_body_is_a_408_and_a_dropped_upload_one_log_line(server):
    cmd, url = server
    with socket.create_connection(("127.0.0.1", cmd.port)) as sock:
        sock.sendall(_head(cmd.port, "POST", "/v1/completions", 500) + b'{"prompt": "hel')
        status, headers, body = _response(sock)
        assert status == 408 and headers["connection"] == "close", (status, body)
        assert json.loads(body)["error"]["code"] == "request_timeout"
    with socket.create_connection(("127.0.0.1", cmd.port)) as sock:
        sock.sendall(_head(cmd.port, "POST", "/v1/chat/completions", 1000) + b'{"messages": [')
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while "went away during the request body" not in cmd.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = cmd.output()
    lines = [line for line in out.splitlines() if "/v1/chat/completions" in line]
    assert len(lines) == 1 and "went away during the request body (14 bytes came)" in lines[0], out
    assert "Traceback" not in out and "ERROR" not in out, out


def test_a_foreign_host_is_refused_on_a_loopback_bind(server):
    cmd, url = server
    for host, status in (("evil.example", 400), ("localhost", 200), ("127.0.0.1", 200)):
        with socket.create_connection(("127.0.0.1", cmd.port)) as sock:
            sock.sendall(_head(cmd.port, "GET", "/v1/models", host=host))
            got, _, body = _response(sock)
            assert got == status, (host, body)
            if status == 400:
                assert json.loads(body)["error"]["code"] == "invalid_host"
