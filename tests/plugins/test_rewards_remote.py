"""The remote reward against a real scoring server on loopback (stdlib http.server, port 0)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax.contracts import RewardSample
from relax.registry import get_registry
from relax_plugins.rewards.remote import RemoteRewardError


class ScoringServer:
    """Scores 1.0 when the response equals the label. ``plan`` lists what the next requests get:
    ``"ok"``, an HTTP status to fail with, or ``("slow", seconds)`` before answering."""

    def __init__(self) -> None:
        self.plan: list = []
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                owner.headers.append(dict(self.headers))
                action = owner.plan.pop(0) if owner.plan else "ok"
                if isinstance(action, tuple):
                    time.sleep(action[1])
                elif isinstance(action, int):
                    self.send_response(action)
                    self.end_headers()
                    self.wfile.write(b"overloaded, try later" if action == 503 else b"bad request: no samples")
                    return
                scores = [1.0 if s["response"] == s["label"] else 0.0 for s in body["samples"]]
                payload = json.dumps({"scores": scores}).encode()
                if action == "short":
                    payload = json.dumps({"scores": scores[:1]}).encode()
                elif action == "html":
                    payload = b"<html>gateway</html>"
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    srv = ScoringServer()
    yield srv
    srv.close()


def reward(**options):
    registry = get_registry()
    return registry.load("rewards", "remote")(registry.build_config("rewards", "remote", options))


BATCH = [RewardSample("1+1=", "2", "2", {"sample_id": "0:0:0"}), RewardSample("1+2=", "4", "3", {"sample_id": "0:1:0"}),
         RewardSample("2+2=", "4", "4", {"sample_id": "0:2:0"})]


def test_scores_come_from_the_service_in_order(server):
    assert reward(url=server.url).score(BATCH) == [1.0, 0.0, 1.0]
    sent = server.requests[0]["samples"]
    assert [s["response"] for s in sent] == ["2", "4", "4"] and sent[1]["metadata"] == {"sample_id": "0:1:0"}


def test_batches_are_split_by_batch_size(server):
    assert reward(url=server.url, batch_size=2).score(BATCH) == [1.0, 0.0, 1.0]
    assert [len(r["samples"]) for r in server.requests] == [2, 1]


def test_an_overloaded_service_is_retried_with_backoff(server):
    server.plan = [503, 503, "ok"]
    started = time.monotonic()
    assert reward(url=server.url, retries=3, backoff_s=0.1).score(BATCH) == [1.0, 0.0, 1.0]
    assert len(server.requests) == 3
    assert time.monotonic() - started >= 0.3  # waited 0.1 then 0.2


def test_a_slow_answer_times_out_and_is_retried(server):
    server.plan = [("slow", 1.0), "ok"]
    started = time.monotonic()
    assert reward(url=server.url, timeout_s=0.3, retries=1, backoff_s=0.0).score(BATCH) == [1.0, 0.0, 1.0]
    assert len(server.requests) == 2 and time.monotonic() - started < 1.0


def test_giving_up_says_why(server):
    server.plan = [("slow", 1.0), ("slow", 1.0)]
    with pytest.raises(RemoteRewardError, match=r"failed after 2 attempt\(s\); last: no complete answer within timeout_s=0.2"):
        reward(url=server.url, timeout_s=0.2, retries=1, backoff_s=0.0).score(BATCH)


def test_a_client_error_is_not_retried_and_quotes_the_service(server):
    server.plan = [400]
    with pytest.raises(RemoteRewardError, match="answered HTTP 400 Bad Request: bad request: no samples"):
        reward(url=server.url, retries=3, backoff_s=0.0).score(BATCH)
    assert len(server.requests) == 1


def test_an_unreachable_service():
    srv = ScoringServer()
    url = srv.url
    srv.close()  # nothing listens there now
    with pytest.raises(RemoteRewardError, match=r"failed after 2 attempt\(s\); last: .*(refused|Connection)"):
        reward(url=url, retries=1, backoff_s=0.0).score(BATCH)


def test_bearer_token_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("RELAX_TEST_SCORER_TOKEN", "s3cret")
    reward(url=server.url, token_env="RELAX_TEST_SCORER_TOKEN", headers={"X-Run": "t"}).score(BATCH[:1])
    assert server.headers[0]["Authorization"] == "Bearer s3cret" and server.headers[0]["X-Run"] == "t"
    monkeypatch.delenv("RELAX_TEST_SCORER_TOKEN")
    with pytest.raises(RemoteRewardError, match="RELAX_TEST_SCORER_TOKEN .* is not set"):
        reward(url=server.url, token_env="RELAX_TEST_SCORER_TOKEN")


def test_a_url_must_be_http():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="must start with http"):
        get_registry().build_config("rewards", "remote", {"url": "ftp://host/score"})


@pytest.mark.parametrize(("action", "message"), [
    ("short", "returned 1 scores for 3 samples"),
    ("html", "answered with something that is not JSON: b'<html>gateway</html>'"),
])
def test_an_unusable_answer_is_a_clear_error(server, action, message):
    server.plan = [action]
    with pytest.raises(RemoteRewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        reward(url=server.url).score(BATCH)
