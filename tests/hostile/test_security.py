"""Hostile-input catalogue, security part (issue 21): what an attacker on the network, another local
user, a web page in the user's browser or a misbehaving scoring service can send, and what Relax
answers. ``CONTROL_TABLE`` is walked by ``test_control_endpoint``; the cases that need a setup of
their own are the tests named in ``CATALOGUE``, so that the whole reads as one table.

| item                                   | input                                   | expected                      | tested by |
|----------------------------------------|-----------------------------------------|-------------------------------|-----------|
| embedded Ray, its agents, the bus       | ``relax run`` of the tiny preset        | every listener on loopback    | test_an_embedded_run_listens_on_loopback_alone |
| weight group store                      | ``WeightSender(host=127.0.0.1)``        | listens on 127.0.0.1 alone    | tests/runtime/test_weight_group.py::test_the_store_listens_on_the_sender_s_address_alone |
| control.json                            | a live control server                   | mode 0600, holds a secret     | test_control_file_is_private_and_holds_the_secret |
| control endpoint                        | ``CONTROL_TABLE`` rows                  | 401/415/400/404, not scaled   | test_control_endpoint |
| control client hang-up                  | a request cut off mid-body              | no traceback on stderr        | test_a_client_hanging_up_prints_nothing |
| ``relax scale`` client                  | a live server, the CLI                  | sends the secret, exit 0      | test_relax_scale_sends_the_secret |
| remote reward redirect                  | 307 to a second loopback server         | error names Location; token never reaches it | test_remote_reward_never_follows_a_redirect |
| remote reward trickle                   | a body sent a byte at a time            | fails within timeout_s + slack | test_remote_reward_deadline_covers_a_trickled_body |
| remote reward failing service           | always 500, 16-sample batch             | <= max_failures_per_batch requests | test_remote_reward_failure_budget_per_batch |
| Megatron checkpoint                     | a pickle that runs code on load         | refused by weights_only       | tests/backends/test_megatron_trainer.py (megatron lane) and test_megatron_loads_checkpoints_weights_only |
"""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from relax.contracts import RewardSample
from relax.registry import get_registry
from relax.runtime.driver.control import CONTROL_FILE, ControlServer
from relax_plugins.rewards.remote import RemoteRewardError

CATALOGUE = [
    "test_an_embedded_run_listens_on_loopback_alone",
    "tests/runtime/test_weight_group.py::test_the_store_listens_on_the_sender_s_address_alone",
    "test_control_file_is_private_and_holds_the_secret",
    "test_control_endpoint",
    "test_a_client_hanging_up_prints_nothing",
    "test_relax_scale_sends_the_secret",
    "test_remote_reward_never_follows_a_redirect",
    "test_remote_reward_deadline_covers_a_trickled_body",
    "test_remote_reward_failure_budget_per_batch",
    "test_megatron_loads_checkpoints_weights_only",
]


# -- the control endpoint ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ControlCase:
    """One request to a live control server and what it must get."""

    name: str
    method: str
    path: str
    secret: str | None
    """``"right"``, ``"wrong"`` or None (no Authorization header)."""
    content_type: str | None
    body: bytes | None
    status: int
    words: tuple[str, ...]
    scaled: list[dict] = field(default_factory=list)
    """What reached the controller's scale(): nothing unless the request was valid."""


CONTROL_TABLE = [
    ControlCase("post-without-secret", "POST", "/scale", None, "application/json", b'{"rollout": 3}', 401,
                ("Authorization: Bearer", CONTROL_FILE)),
    ControlCase("post-wrong-secret", "POST", "/scale", "wrong", "application/json", b'{"rollout": 3}', 401,
                ("wrong secret",)),
    ControlCase("cross-origin-text-plain", "POST", "/scale", None, "text/plain", b'{"rollout": 3}', 401, ()),
    ControlCase("text-plain-with-secret", "POST", "/scale", "right", "text/plain", b'{"rollout": 3}', 415,
                ("application/json", "text/plain")),
    ControlCase("form-with-secret", "POST", "/scale", "right", "application/x-www-form-urlencoded", b"rollout=3",
                415, ("application/json",)),
    ControlCase("status-without-secret", "GET", "/status", None, None, None, 401, ("Bearer",)),
    ControlCase("status-with-secret", "GET", "/status", "right", None, None, 200, ("replicas",)),
    ControlCase("garbage-body", "POST", "/scale", "right", "application/json", b"\xff\xfe{{{", 400, ("JSON",)),
    ControlCase("empty-body", "POST", "/scale", "right", "application/json", b"", 400, ("Content-Length",)),
    ControlCase("json-list", "POST", "/scale", "right", "application/json", b"[1, 2]", 400, ("JSON object",)),
    ControlCase("unknown-role", "POST", "/scale", "right", "application/json", b'{"actor": 2}', 400,
                ("only the rollout role", "actor")),
    ControlCase("negative-count", "POST", "/scale", "right", "application/json", b'{"rollout": -1}', 400,
                ("rollout=-1", "0 or more")),
    ControlCase("string-count", "POST", "/scale", "right", "application/json", b'{"rollout": "2"}', 400,
                ("whole number",)),
    ControlCase("bool-count", "POST", "/scale", "right", "application/json", b'{"rollout": true}', 400,
                ("whole number",)),
    ControlCase("unknown-path", "POST", "/exec", "right", "application/json", b"{}", 404, ("/exec",)),
    ControlCase("valid-scale", "POST", "/scale", "right", "application/json", b'{"rollout": 2}', 200,
                ("before",), [{"rollout": 2}]),
]


class FakeController:
    """The controller's two callables, recording what reached them."""

    def __init__(self) -> None:
        self.scaled: list[dict] = []

    def status(self) -> dict:
        return {"replicas": 1}

    def scale(self, request: dict) -> dict:
        self.scaled.append(request)
        return {"rollout": {"before": 1, "after": request["rollout"]}, "replicas": []}


@pytest.fixture
def control(tmp_path):
    fake = FakeController()
    server = ControlServer(tmp_path, fake.status, fake.scale)
    yield server, fake
    server.close()


def send(server: ControlServer, case: ControlCase) -> tuple[int, dict]:
    host, port = server.server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=10)
    headers = {}
    if case.content_type is not None:
        headers["Content-Type"] = case.content_type
    if case.secret is not None:
        headers["Authorization"] = f"Bearer {server.secret if case.secret == 'right' else 'not-' + server.secret}"
    connection.request(case.method, case.path, body=case.body, headers=headers)
    response = connection.getresponse()
    answer = json.loads(response.read() or b"{}")
    connection.close()
    return response.status, answer


@pytest.mark.parametrize("case", CONTROL_TABLE, ids=lambda c: c.name)
def test_control_endpoint(control, case: ControlCase) -> None:
    server, fake = control
    status, answer = send(server, case)
    assert status == case.status, answer
    text = json.dumps(answer)
    for word in case.words:
        assert word in text, (word, answer)
    assert fake.scaled == case.scaled  # a refused request never reaches the controller


def test_control_file_is_private_and_holds_the_secret(control) -> None:
    server, _ = control
    assert stat.S_IMODE(server.file.stat().st_mode) == 0o600
    found = json.loads(server.file.read_text())
    assert found["secret"] == server.secret and len(server.secret) >= 32 and found["url"] == server.url


def test_a_stale_control_file_is_replaced_private(tmp_path) -> None:
    stale = tmp_path / CONTROL_FILE
    stale.write_text('{"url": "http://127.0.0.1:1", "secret": "old"}')
    stale.chmod(0o644)
    fake = FakeController()
    server = ControlServer(tmp_path, fake.status, fake.scale)
    try:
        assert stat.S_IMODE(stale.stat().st_mode) == 0o600 and json.loads(stale.read_text())["secret"] != "old"
    finally:
        server.close()


def test_a_client_hanging_up_prints_nothing(tmp_path, capfd) -> None:
    """A request that announces a body and hangs up before sending it, and one that hangs up before
    its answer: the server stays up and prints no traceback."""
    fake = FakeController()
    server = ControlServer(tmp_path, fake.status, fake.scale)
    try:
        host, port = server.server.server_address[:2]
        for request in (f"POST /scale HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.secret}\r\n"
                        "Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{\"roll",
                        f"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.secret}\r\n\r\n"):
            sock = socket.create_connection((host, port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
            sock.sendall(request.encode())
            sock.close()
        time.sleep(0.5)
        status, _ = send(server, ControlCase("after", "GET", "/status", "right", None, None, 200, ()))
        assert status == 200
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
    assert fake.scaled == []


def test_relax_scale_sends_the_secret(control, capsys) -> None:
    from relax.cli import main

    server, fake = control
    assert main(["scale", str(server.file.parent), "rollout=2"]) == 0
    assert fake.scaled == [{"rollout": 2}] and "rollout replicas: 1 -> 2" in capsys.readouterr().out
    # Without the secret in control.json the client cannot call: it says so, nothing is scaled.
    server.file.write_text(json.dumps({"url": server.url, "pid": os.getpid()}))
    assert main(["scale", str(server.file.parent), "rollout=3"]) == 1
    assert "not a live run's control file" in capsys.readouterr().err and fake.scaled == [{"rollout": 2}]


# -- the remote reward ------------------------------------------------------------------------------

class Recorder:
    """A loopback HTTP server whose ``reply(handler)`` answers each POST; it records each request's
    headers."""

    def __init__(self, reply) -> None:
        self.headers: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.headers.append(dict(self.headers))
                try:
                    reply(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def scores_reply(handler: BaseHTTPRequestHandler, count: int = 1) -> None:
    payload = json.dumps({"scores": [1.0] * count}).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def remote(**options):
    registry = get_registry()
    return registry.load("rewards", "remote")(registry.build_config("rewards", "remote", options))


SAMPLE = [RewardSample("1+1=", "2", "2", {"sample_id": "0:0:0"})]


def test_remote_reward_never_follows_a_redirect(monkeypatch) -> None:
    elsewhere = Recorder(scores_reply)

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(307)
        handler.send_header("Location", elsewhere.url)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    first = Recorder(redirect)
    monkeypatch.setenv("RELAX_TEST_SCORER_TOKEN", "s3cret")
    try:
        reward = remote(url=first.url, token_env="RELAX_TEST_SCORER_TOKEN", headers={"X-Key": "k"}, retries=2,
                        backoff_s=0.0)
        with pytest.raises(RemoteRewardError, match="redirect") as err:
            reward.score(SAMPLE)
        assert elsewhere.url in str(err.value) and "options.url" in str(err.value)
        assert elsewhere.headers == []  # nothing at all reached the second host, let alone the token
        assert len(first.headers) == 1 and first.headers[0]["Authorization"] == "Bearer s3cret"  # not retried
    finally:
        first.close()
        elsewhere.close()


def test_remote_reward_deadline_covers_a_trickled_body() -> None:
    """Each byte comes well within timeout_s, the whole answer far past it."""

    def trickle(handler: BaseHTTPRequestHandler) -> None:
        payload = json.dumps({"scores": [1.0]}).encode() + b" " * 100
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        for i in range(len(payload)):
            handler.wfile.write(payload[i:i + 1])
            handler.wfile.flush()
            time.sleep(0.1)

    server = Recorder(trickle)
    try:
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match="no complete answer within timeout_s=1.0"):
            remote(url=server.url, timeout_s=1.0, retries=0).score(SAMPLE)
        assert time.monotonic() - started < 1.0 + 1.0
    finally:
        server.close()


def test_remote_reward_failure_budget_per_batch() -> None:
    """A 16-sample batch scored the way the reward runner does it (the batch, then sample by sample
    after a failure) against a service that always answers 500: at most max_failures_per_batch
    requests, and every sample is reported failed. The next batch gets a fresh budget."""
    from relax.runtime.worker.scoring import RewardEntry, RewardScorer

    def fail(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(500)
        handler.send_header("Content-Length", "4")
        handler.end_headers()
        handler.wfile.write(b"down")

    server = Recorder(fail)
    plugin = remote(url=server.url, retries=3, backoff_s=0.0, max_failures_per_batch=6)
    # max_error_frac 1: the batch may fail whole without stopping the run (what this test counts
    # is the requests; the threshold has its own test in test_failure_causes.py)
    scorer = RewardScorer([RewardEntry("remote", "remote", plugin, on_error="zero", max_error_frac=1.0)])
    try:
        batch = [RewardSample(f"p{i}", "r", "l", {"sample_id": f"0:{i}:0"}) for i in range(16)]
        report = scorer.score(batch)
        assert report.errors == {"remote": 16}
        assert len(server.headers) == 6
        second = [RewardSample(f"q{i}", "r", "l", {"sample_id": f"1:{i}:0"}) for i in range(16)]
        assert scorer.score(second).errors == {"remote": 16}
        assert len(server.headers) == 12
        with pytest.raises(RemoteRewardError, match="no request sent: this batch already had 6 failed"):
            plugin.score(second[3:4])  # a sample of the spent batch
        assert len(server.headers) == 12
    finally:
        scorer.close()
        server.close()


# -- the Megatron backend's checkpoints ---------------------------------------------------------------

def test_megatron_loads_checkpoints_weights_only() -> None:
    """Every ``torch.load`` of the Megatron trainer passes ``weights_only=True`` (its resume test
    runs in the megatron lane); a pickle that runs code on load is refused by such a load."""
    import ast

    import torch

    source = Path(__file__).parents[2] / "relax_plugins" / "trainer" / "megatron.py"
    calls = [node for node in ast.walk(ast.parse(source.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load"
             and getattr(node.func.value, "id", "") == "torch"]
    assert calls, "no torch.load in the Megatron trainer"
    for call in calls:
        flags = {k.arg: k.value for k in call.keywords}
        assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, \
            ast.unparse(call)

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    buffer = io.BytesIO()
    torch.save({"optimizer": Payload()}, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(buffer, weights_only=True)


# -- an embedded run ----------------------------------------------------------------------------------

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listeners(pids: set[int]) -> set[tuple[int, str, str, int]]:
    import psutil

    found = set()
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for c in process.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((pid, process.name(), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_an_embedded_run_listens_on_loopback_alone(tmp_path) -> None:
    """``relax run`` of the tiny preset (its own embedded Ray, as the CLI starts it): while it runs,
    every TCP listener of the driver and of every process it started (GCS, raylet, workers, the
    dashboard and runtime-env agents, the bus) is on loopback."""
    import psutil

    from relax import testing

    me = psutil.Process()
    before = {(ip, port) for _, _, ip, port in listeners({me.pid})}
    seen: set[tuple[int, str, str, int]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
            seen.update(s for s in listeners(pids) if s[0] != me.pid or (s[2], s[3]) not in before)
            done.wait(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code, rows, _ = testing.tiny_run(tmp_path, "loopback", "trainer.steps=3")
    finally:
        done.set()
        watcher.join()
    assert code == 0 and len(rows) == 3
    names = {name for _, name, _, _ in seen}
    assert {"gcs_server", "raylet"} <= names, names  # the watcher did see Ray's own processes
    exposed = sorted(s for s in seen if s[2] not in LOOPBACK)
    assert not exposed, f"listening beyond loopback: {exposed}"
