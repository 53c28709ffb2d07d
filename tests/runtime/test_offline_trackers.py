"""Offline means offline, and secrets stay secret, shown on one real run.

``relax run`` of the tiny preset with TensorBoard, wandb (offline) and MLflow (file store), scored
also by the ``remote`` reward against a judge service on loopback that needs a key, runs inside a
network namespace of its own with only loopback, under ``strace -f``, with an empty ``$HOME``:

- no process of the run (the driver, Ray's, wandb's Go service) tries any address off loopback:
  every ``connect``/``sendto``/``sendmsg`` to an AF_INET/AF_INET6 address is to 127.0.0.0/8 or ::1;
- nothing is written to ``$HOME`` but Ray's token (``~/.ray/auth_token``, docs/security.md);
- the judge got the key, from ``${oc.env:JUDGE_KEY}`` and from ``headers_env``, and no file of
  the run folder (``spec.yaml``, ``plan.json``, the tracker files) holds it.

It needs root (``unshare -n``) and strace; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SECRET = "s3cr3t-judge-key-7f3a9c"
OTHER = "other-judge-key-51bd02"
JUDGE = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(sys.argv[2], "a") as seen:
                seen.write(json.dumps([self.headers.get("X-Api-Key"), self.headers.get("X-Other-Key")]) + "\\n")
            answer = json.dumps({"scores": [0.5] * len(body["samples"])}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Judge)
    open(sys.argv[1], "w").write(str(server.server_address[1]))
    server.serve_forever()
''')
#: A ``connect``/``sendto``/``sendmsg`` line of strace with an IPv4 or IPv6 address.
_INET = re.compile(r'(connect|sendto|sendmsg)\(.*?sa_family=AF_INET6?,.*?'
                   r'(?:sin_addr=inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"|sin6_addr=inet_pton\(AF_INET6, "([^"]+)")')


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a network namespace (unshare -n)"
    for tool in ("unshare", "ip", "strace"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs {tool}"
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return "unshare -n is not allowed here (a container without CAP_SYS_ADMIN)"
    return None


def off_loopback(trace: str) -> list[str]:
    """The strace lines that address an IPv4/IPv6 host outside loopback."""
    found = []
    for line in trace.splitlines():
        match = _INET.search(line)
        if match is None:
            continue
        address = ipaddress.ip_address(next(a for a in match.groups()[1:] if a))
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
        if not (mapped or address).is_loopback:
            found.append(line)
    return found


def test_the_parser_sees_an_off_loopback_attempt():
    trace = ('7 connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.255.255.53")}, 16) = -1\n'
             '7 connect(3, {sa_family=AF_INET, sin_port=htons(6379), sin_addr=inet_addr("127.0.0.1")}, 16) = 0\n'
             '8 connect(5, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), '
             'inet_pton(AF_INET6, "2606:4700::1", &sin6_addr), sin6_scope_id=0}, 28) = -1\n'
             '8 connect(5, {sa_family=AF_INET6, sin6_port=htons(1), inet_pton(AF_INET6, "::1", &sin6_addr)}, 28) = 0\n'
             '8 connect(5, {sa_family=AF_INET6, inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr)}, 28) = 0\n'
             '9 connect(4, {sa_family=AF_UNIX, sun_path="/tmp/x"}, 110) = 0\n')
    assert [line.split()[0] for line in off_loopback(trace)] == ["7", "8"]


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_a_tracker_run_in_a_loopback_only_namespace_stays_there_and_keeps_the_key_out(tmp_path):
    from relax.runtime.model_files import cache_dir

    home, out = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    (tmp_path / "judge.py").write_text(JUDGE)
    (tmp_path / "spec.yaml").write_text(textwrap.dedent(f"""\
        extends: tiny-cpu
        name: offline
        trainer: {{steps: 2, output_dir: {out}}}
        tracing: {{exporter: none}}
        rewards:
          - name: exact_match
          - name: remote
            weight: 0.1
            options:
              url: http://127.0.0.1:${{oc.env:JUDGE_PORT}}/score
              retries: 0
              headers: {{X-Api-Key: "${{oc.env:JUDGE_KEY}}"}}
              headers_env: {{X-Other-Key: OTHER_KEY}}
        logging:
          - name: tensorboard
          - name: wandb
          - name: mlflow
        """))
    # The run's own environment: an empty HOME, the built model where the suite keeps it, and none
    # of the markers that make MLflow switch its telemetry off by itself (pytest's, CI's).
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "WANDB_MODE", "MLFLOW_TRACKING_URI",
                        "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "WANDB_ERROR_REPORTING")}
    env.update(HOME=str(home), RELAX_CACHE=cache_dir(), JUDGE_KEY=SECRET, OTHER_KEY=OTHER,
               PATH=f"{os.environ.get('PATH', '')}:/usr/sbin")
    script = (f"ip link set lo up && cd {tmp_path} && {{ {sys.executable} judge.py port seen.jsonl "
              ">judge.log 2>&1 & judge=$!; } && while [ ! -s port ]; do sleep 0.1; done && "
              "export JUDGE_PORT=$(cat port) && "
              f"strace -f -qq -e trace=connect,sendto,sendmsg -o trace.txt {sys.executable} -m relax run spec.yaml; "
              "code=$?; kill $judge; exit $code")
    done = subprocess.run(["unshare", "-n", "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    trace = (tmp_path / "trace.txt").read_text()
    assert "connect(" in trace  # strace saw the run (Ray's own loopback connections at least)
    assert off_loopback(trace) == []

    written = sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())
    assert written == [".ray/auth_token"], written

    seen = (tmp_path / "seen.jsonl").read_text().splitlines()
    assert seen and all(line == f'["{SECRET}", "{OTHER}"]' for line in seen)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"spec.yaml", "plan.json"} <= {p.name for p in files}
    assert any("wandb" in p.parts for p in files) and any("mlruns" in p.parts for p in files)
    holding = [str(p.relative_to(out)) for p in files if SECRET.encode() in p.read_bytes()
               or OTHER.encode() in p.read_bytes()]
    assert holding == []
    assert "${oc.env:JUDGE_KEY}" in (out / "spec.yaml").read_text()
    [wandb_file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"oc.env:JUDGE_KEY" in wandb_file.read_bytes()
