"""Hostile input, second round (issue 43): giant rows, servers that must check first, and cleanup
by identity. All traffic goes to 127.0.0.1; every loop is bounded in count and time.

- Rows: a 10 MB and a 100 MB prompt row and a 10-million-column CSV, each run in a subprocess under
  ``RLIMIT_AS`` (3 GB) with a time limit: validation refuses (exit 2, naming the file and line), or
  the data plugin cuts the prompt before the rollout's ``PromptEncoder`` tokenizes it (a byte-level
  tokenizer, one token per byte: tokenized whole, 10 MB alone takes about 2 GB and a minute). A
  prompt drawn twice in a step is tokenized once.
- Servers: the agent gateway answers a 100 MB body without a key with 401 before reading it (the
  process's memory does not grow, the rest of the body is never read) and a body past its cap with
  413 in the OpenAI error shape; 1,000 idle connections leave its thread count flat and a request
  with a key answered; half-sent requests hold no thread and are closed after the read timeout;
  connections past the cap get 503, headers past theirs 431 (the gateway's asyncio server). The
  control endpoint: the same bounds with at most ``max_active`` threads.
- Cleanup: a decoy process whose command line holds the session folder is not touched, nor is a
  process whose pid is recorded with another start time; a record with an empty session folder
  matches nothing; the recorded process itself (pid and start time) is ended.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import psutil
import pytest

from relax.agents.gateway import MAX_BODY_BYTES, ProgramDriver
from relax.agents.gateway_http import MAX_HEADER_BYTES, Routes
from relax.agents.runner import AgentLimits, GenerationBatcher
from relax.contracts import AgentTask
from relax.runtime.driver.control import MAX_BODY_BYTES as CONTROL_MAX_BODY, MAX_CONNECTIONS, ControlServer
from relax.runtime.driver.ray_sessions import (STATE_DIR_ENV, ProcessEntry, SessionRecord, clean_orphaned_sessions,
                                        session_processes)
from relax.spec.models import AgentSpec, GatewaySpec

ROOT = Path(__file__).resolve().parents[2]
#: The address-space bound the row cases run under, and their time limit.
MEMORY_LIMIT = 3 << 30
TIME_LIMIT_S = 120
MB = 1024 * 1024


# -- rows ---------------------------------------------------------------------------------------------

#: A byte-level tokenizer with no merges (one token per byte of text), built from ``tokenizers``.
TOKENIZER = """
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
raw.decoder = decoders.ByteLevel()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="!")
"""

#: The rollout's first steps on a data file: the run's own data set options (``dataset_use``), the
#: data plugin reading the file, the step's prompts (the long row drawn twice) through the rollout's
#: ``PromptEncoder``, with the texts that reached the tokenizer counted.
ROLLOUT_STEP = TOKENIZER + """
import json, resource, sys, time
from relax.config import load_spec_dict
from relax.plan.wiring import dataset_use
from relax.registry import get_registry
from relax.spec import validate_spec
from relax_plugins.rollout.chat_template import PromptEncoder

started = time.monotonic()
raw_spec, base = load_spec_dict("tiny-cpu", [f"data.train.source={sys.argv[1]}", *sys.argv[2:]])
spec = validate_spec(raw_spec, base_dir=base)
use = dataset_use(spec, base)
registry = get_registry()
dataset = registry.load("datasets", use.name)(registry.build_config("datasets", use.name, use.options))
seen = []
class Counting:
    def __getattr__(self, name):
        return getattr(tokenizer, name)
    def __call__(self, texts, **kwargs):
        seen.extend(len(t) for t in texts)
        return tokenizer(texts, **kwargs)
encoder = PromptEncoder(Counting(), "none", spec.data.max_prompt_tokens, spec.data.on_long_prompt)
prompts = [str(dataset[i][spec.data.prompt_key]) for i in (0, 1, 1, 0)]
ids = encoder.encode_all(prompts)
print(json.dumps({"seconds": time.monotonic() - started, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
                  "tokenized": seen, "lengths": [len(i) for i in ids], "last": tokenizer.decode(ids[1][-4:]),
                  "truncated": getattr(dataset, "truncated", None)}))
"""

#: ``PromptEncoder`` alone on huge prompts (a data set plugin that does not bound its rows).
ENCODER_ONLY = TOKENIZER + """
import json, resource, sys, time
from relax_plugins.rollout.chat_template import PromptEncoder

started = time.monotonic()
size = int(sys.argv[1])
huge = "y" * size + " end"
ids = PromptEncoder(tokenizer, "none", 256).encode_all([huge, "short", huge])
print(json.dumps({"seconds": time.monotonic() - started, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
                  "lengths": [len(i) for i in ids], "last": tokenizer.decode(ids[0][-4:])}))
"""


def _bounded(args: list[str], timeout: float = TIME_LIMIT_S) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``args`` under ``RLIMIT_AS`` = 3 GB: (the finished process, its wall time)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    started = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, preexec_fn=limit,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return done, time.monotonic() - started


def _long_row_file(path: Path, megabytes: int) -> Path:
    """A JSON-lines file: a short row, then one whose prompt is ``megabytes`` MB ending in a question."""
    with open(path, "w") as out:
        out.write(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
        out.write('{"prompt": "')
        chunk = "x" * MB
        for _ in range(megabytes):
            out.write(chunk)
        out.write(' 2+2=", "answer": "4"}\n')
    return path


def _report(name: str, seconds: float, peak_mb: float | None = None) -> None:
    print(f"\n[hostile] {name}: {seconds:.2f} s" + ("" if peak_mb is None else f", peak {peak_mb:.0f} MB"))


def test_a_10mb_prompt_row_is_cut_before_it_is_tokenized_once(tmp_path) -> None:
    data = _long_row_file(tmp_path / "ten.jsonl", 10)
    done, took = _bounded([sys.executable, "-c", ROLLOUT_STEP, str(data)])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    _report("10 MB prompt row, truncate (data plugin + PromptEncoder)", took, out["peak_mb"])
    limit = 256 * 32  # data.max_prompt_tokens x PROMPT_CHARS_PER_TOKEN
    assert out["truncated"] == 1  # the data plugin cut it as it read the file
    assert sorted(out["tokenized"]) == [4, limit]  # two distinct prompts, each tokenized once, the long one cut
    assert out["lengths"] == [4, 256, 256, 4] and out["last"] == "2+2="  # cut from the left: the question stays
    assert out["peak_mb"] < 1024 and took < 60


@pytest.mark.parametrize("megabytes", [10, 100])
def test_a_huge_prompt_is_cut_by_the_encoder_itself(megabytes: int) -> None:
    """A data set plugin that does not bound its rows: the rollout's encoder still never
    tokenizes the prompt whole (before: 10 MB took about 2 GB and 70 s; 100 MB could not fit)."""
    done, took = _bounded([sys.executable, "-c", ENCODER_ONLY, str(megabytes * MB)])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    _report(f"{megabytes} MB prompt, PromptEncoder alone", took, out["peak_mb"])
    assert out["lengths"] == [256, 5, 256] and out["last"] == " end"
    assert out["peak_mb"] < 1024 + megabytes * 2 and took < 60


def test_a_10mb_prompt_row_under_refuse_is_refused_by_validation_with_file_and_line(tmp_path) -> None:
    data = _long_row_file(tmp_path / "ten.jsonl", 10)
    done, took = _bounded([sys.executable, "-m", "relax", "validate", "tiny-cpu", f"data.train.source={data}",
                           "data.on_long_prompt=refuse"])
    _report("10 MB prompt row, refuse (relax validate)", took)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert f"{data}:2" in said and "data.on_long_prompt" in said and "Traceback" not in said
    # The run's data plugin refuses it too, naming the file and line, before any tokenizer sees it.
    done, _ = _bounded([sys.executable, "-c", ROLLOUT_STEP, str(data), "data.on_long_prompt=refuse"])
    assert done.returncode != 0 and f"{data}:2" in done.stderr and "on_long_prompt: refuse" in done.stderr


def test_a_100mb_prompt_row_is_refused_with_file_and_line(tmp_path) -> None:
    data = _long_row_file(tmp_path / "hundred.jsonl", 100)
    done, took = _bounded([sys.executable, "-m", "relax", "validate", "tiny-cpu", f"data.train.source={data}"])
    _report("100 MB prompt row (relax validate)", took)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert f"{data}:2" in said and "max_row_bytes" in said and "Traceback" not in said
    assert took < 30
    done, took = _bounded([sys.executable, "-c", ROLLOUT_STEP, str(data)])
    _report("100 MB prompt row (data plugin)", took)
    assert done.returncode != 0 and f"{data}:2: a row of more than" in done.stderr and "MemoryError" not in done.stderr


def _wide_csv(path: Path, columns: int) -> Path:
    with open(path, "w") as out:
        step = 100_000
        for start in range(0, columns, step):
            out.write(("," if start else "") + ",".join("c" for _ in range(min(step, columns - start))))
        out.write("\nx\n")
    return path


def test_a_10_million_column_csv_is_refused_quickly_naming_the_file(tmp_path) -> None:
    data = _wide_csv(tmp_path / "wide.csv", 10_000_000)
    done, took = _bounded([sys.executable, "-m", "relax", "validate", "tiny-cpu", f"data.train.source={data}"],
                          timeout=60)
    _report("10-million-column CSV (relax validate)", took)
    assert done.returncode == 2 and f"{data}:1 (the header row): 10000000 columns" in done.stdout + done.stderr, done
    assert took < 30
    code = ("import sys\nfrom relax_plugins.datasets.files import CsvDataset\n"
            "CsvDataset(CsvDataset.Config(path=sys.argv[1]))\n")
    done, took = _bounded([sys.executable, "-c", code, str(data)], timeout=60)
    _report("10-million-column CSV (data plugin)", took)
    assert done.returncode != 0 and f"{data}:1 (the header row): 10000000 columns" in done.stderr
    assert "MemoryError" not in done.stderr and took < 30


def test_table_rows_past_the_caps_are_refused_naming_the_row(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from relax_plugins.datasets.files import DatasetFileError, ParquetDataset

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["short", "z" * 5000], "answer": ["1", "2"], "x": [1, 2]}), path)
    with pytest.raises(DatasetFileError, match=r"rows\.parquet: 3 columns, more than 2"):
        ParquetDataset(ParquetDataset.Config(path=str(path), max_columns=2))
    with pytest.raises(DatasetFileError, match=r"rows\.parquet: row 1: a row of more than 1000 bytes"):
        ParquetDataset(ParquetDataset.Config(path=str(path), max_row_bytes=1000))
    cut = ParquetDataset(ParquetDataset.Config(path=str(path), prompt_key="prompt", max_prompt_chars=64))
    assert cut[1]["prompt"] == "z" * 64 and cut[0]["prompt"] == "short" and cut.truncated == 1


# -- the agent gateway ---------------------------------------------------------------------------------

#: A ChatML-like template for the byte-level tokenizer the gateway renders with.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
KEYS: queue.Queue = queue.Queue()
RELEASE = threading.Event()


def holds_its_key(task: AgentTask, base_url: str, api_key: str) -> None:
    """An agent program that hands its key to the test and waits (its key stays live meanwhile)."""
    KEYS.put((base_url, api_key))
    RELEASE.wait(60)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="!")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _never(prompts, seed):
    raise AssertionError("no model call is expected here")


@pytest.fixture
def gateway():
    """A live gateway with one trajectory's key held open: (driver, host, port, key)."""
    RELEASE.clear()
    limits = AgentLimits(max_turns=2, max_tokens=64, max_new_tokens=8, tool_timeout_s=30, concurrency=4)
    agent = AgentSpec(gateway=GatewaySpec(program="tests.hostile.test_hostile_rows_and_servers:holds_its_key"),
                      max_turns=2, max_tokens=64)
    driver = ProgramDriver(agent, types.SimpleNamespace(tokenizer=_tokenizer()), limits, version=lambda: 0)
    task = AgentTask(prompt="hi", label=None, row={}, index=0, sample=0, trajectory_id="t0")
    episode = threading.Thread(target=driver.episode, args=(task, GenerationBatcher(_never, seed=0)), daemon=True)
    episode.start()
    _, key = KEYS.get(timeout=30)
    host, port = driver._server.server_address[:2]
    try:
        yield driver, host, port, key
    finally:
        RELEASE.set()
        episode.join(30)
        driver.close()


def _answer(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict]:
    """Read one HTTP answer from a raw socket: (status, JSON body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), b"0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), json.loads(body or b"{}")


def _get(host: str, port: int, path: str, key: str | None) -> tuple[int, dict]:
    with socket.create_connection((host, port), timeout=5) as sock:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
        return _answer(sock)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / MB


def _openai_error(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_a_100mb_body_without_a_key_is_refused_before_it_is_read(gateway) -> None:
    driver, host, port, key = gateway
    before = _rss_mb()
    started = time.monotonic()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 * MB}\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=5) as sock:  # the headers and a few bytes: answered at once
        sock.sendall(head + b'{"messages"')
        status, body = _answer(sock)
    answered = time.monotonic() - started
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and _openai_error(body) and answered < 2.0
    # Then the whole 100 MB, sent for real: the server answers after the headers and never reads the
    # rest (the connection is closed under the sender), and its process does not grow.
    chunk = b" " * MB
    sent = 0
    started = time.monotonic()
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(head)
        status, body = _answer(sock)
        with pytest.raises(OSError):
            while sent < 100 * MB and time.monotonic() - started < 30:
                sock.sendall(chunk)
                sent += len(chunk)
    grew = _rss_mb() - before
    _report(f"gateway, 100 MB body without a key (answered in {answered * 1000:.0f} ms, {sent // MB} MB accepted "
            f"by the kernel before the reset, RSS +{grew:.0f} MB)", time.monotonic() - started)
    assert status == 401 and sent < 100 * MB and grew < 50
    assert _get(host, port, "/v1/models", key)[0] == 200  # and it goes on serving


def test_a_body_past_the_cap_is_413_in_the_openai_shape_unread(gateway) -> None:
    _, host, port, key = gateway
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                      f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n{{").encode())
        status, body = _answer(sock)
    assert status == 413 and _openai_error(body) and str(MAX_BODY_BYTES) in body["error"]["message"]


def test_1000_idle_connections_hold_no_thread_and_a_keyed_call_is_answered(gateway) -> None:
    driver, host, port, key = gateway
    threads = psutil.Process().num_threads()
    started = time.monotonic()
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(1000)]
    try:
        time.sleep(0.5)
        grew = psutil.Process().num_threads() - threads
        status, body = _get(host, port, "/v1/models", key)
        _report(f"gateway, 1000 idle connections (threads +{grew})", time.monotonic() - started)
        assert status == 200 and body["data"][0]["id"] and grew <= 3
        assert _get(host, port, "/v1/models", None)[0] == 401
    finally:
        for sock in idle:
            sock.close()


def test_half_sent_requests_hold_no_thread_and_are_closed_after_the_read_timeout(gateway, monkeypatch) -> None:
    driver, host, port, key = gateway
    server = driver._server
    monkeypatch.setattr(server, "read_timeout_s", 1.0)
    threads = psutil.Process().num_threads()
    half = []
    for _ in range(40):  # a request line and no end of headers
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        half.append(sock)
    try:
        time.sleep(0.3)
        assert psutil.Process().num_threads() - threads <= 2 and server.open >= 40
        started = time.monotonic()
        for sock in half:  # closed without an answer once the read timeout has passed
            sock.settimeout(10)
            assert sock.recv(4096) == b""
        assert 0.5 <= time.monotonic() - started < 10
        deadline = time.monotonic() + 5
        while server.open and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.open == 0
        assert _get(host, port, "/v1/models", key)[0] == 200
    finally:
        for sock in half:
            sock.close()


def test_connections_past_the_cap_are_503_in_the_openai_shape(gateway, monkeypatch) -> None:
    driver, host, port, key = gateway
    monkeypatch.setattr(driver._server, "max_open", 8)
    held = [socket.create_connection((host, port), timeout=5) for _ in range(20)]
    try:
        refused = 0
        for sock in held:
            sock.settimeout(0.5)
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue  # open, waiting for its request
            if data.startswith(b"HTTP/1.1 503"):
                refused += 1
                assert _openai_error(json.loads(data.partition(b"\r\n\r\n")[2]))
        assert refused == 12
    finally:
        for sock in held:
            sock.close()


def test_headers_past_the_cap_are_431(gateway) -> None:
    _, host, port, key = gateway
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n\r\n")
        status, body = _answer(sock)
    assert status == 431 and _openai_error(body) and str(MAX_HEADER_BYTES) in body["error"]["message"]


def test_calls_past_the_per_key_bound_are_429() -> None:
    routes = Routes(driver=None, max_per_key=2)  # type: ignore[arg-type]  # the bound needs no driver
    with routes.key_slot("k") as a, routes.key_slot("k") as b:
        assert a and b
        with routes.key_slot("k") as c, routes.key_slot("other") as d:
            assert not c and d  # a third call of one key is refused; another key is not
    with routes.key_slot("k") as again:
        assert again  # the slots are given back


# -- the control endpoint ------------------------------------------------------------------------------

@pytest.fixture
def control(tmp_path):
    server = ControlServer(tmp_path, lambda: {"replicas": 1}, lambda request: {"rollout": request})
    yield server
    server.close()


def test_control_checks_the_secret_then_the_size_and_bounds_its_threads(control, monkeypatch) -> None:
    host, port = control.server.server_address[:2]
    with socket.create_connection((host, port), timeout=5) as sock:  # no secret: 401 before the body
        sock.sendall(f"POST /scale HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {100 * MB}\r\n\r\n{{".encode())
        assert _answer(sock)[0] == 401
    with socket.create_connection((host, port), timeout=5) as sock:  # the secret, a body past the cap: 413
        sock.sendall(f"POST /scale HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {control.secret}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {CONTROL_MAX_BODY + 1}\r\n\r\n{{".encode())
        status, body = _answer(sock)
        assert status == 413 and str(CONTROL_MAX_BODY) in body["error"]
    threads = psutil.Process().num_threads()
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(1000)]
    try:
        time.sleep(0.5)
        assert psutil.Process().num_threads() - threads <= 3
        assert _get(host, port, "/status", control.secret) == (200, {"replicas": 1})
    finally:
        for sock in idle:
            sock.close()
    monkeypatch.setattr(control.server.RequestHandlerClass, "timeout", 1.0)
    half = []
    for _ in range(3 * MAX_CONNECTIONS):  # the half-request hold: headers never finished
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(f"GET /status HTTP/1.1\r\nAuthorization: Bearer {control.secret}\r\n".encode())
        half.append(sock)
        time.sleep(0.01)
    try:
        time.sleep(0.3)
        assert psutil.Process().num_threads() - threads <= MAX_CONNECTIONS + 2
        deadline = time.monotonic() + 10
        while control.server.active and time.monotonic() < deadline:
            time.sleep(0.1)
        assert control.server.active == 0
        assert _get(host, port, "/status", control.secret)[0] == 200
    finally:
        for sock in half:
            sock.close()


# -- leftover-process cleanup --------------------------------------------------------------------------

def _sleeper(marker: str) -> subprocess.Popen:
    code = f"import time; print('ready', flush=True); time.sleep(120)  # {marker}"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def _gone_driver() -> tuple[int, float]:
    """The pid and start time of a driver that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(process.pid).create_time()
    process.wait(10)
    return process.pid, started


def test_cleanup_kills_by_identity_never_by_command_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "state"))
    session = str(tmp_path / "ray" / "session_2026-12-05_decoy")
    decoy = _sleeper(session)  # names the session folder on its command line, not Ray's
    reused = _sleeper("pid recorded with another start time")
    ours = _sleeper("a process of the session, recorded at launch")
    try:
        assert session in " ".join(psutil.Process(decoy.pid).cmdline())
        driver, driver_started = _gone_driver()
        ours_started = psutil.Process(ours.pid).create_time()
        record = SessionRecord(driver, driver_started, session, [
            ProcessEntry(reused.pid, psutil.Process(reused.pid).create_time() - 100.0, session),
            ProcessEntry(ours.pid, ours_started, session)])
        empty = SessionRecord(driver + 1, driver_started, "", [ProcessEntry(decoy.pid, psutil.Process(decoy.pid).create_time(), "")])
        foreign = SessionRecord(driver + 2, driver_started, session,
                                [ProcessEntry(decoy.pid, psutil.Process(decoy.pid).create_time(), "/elsewhere")])
        assert session_processes(empty) == [] and session_processes(foreign) == []
        assert [p.pid for p in session_processes(record)] == [ours.pid]
        for each in (record, empty, foreign):
            each.write()
        cleaned = clean_orphaned_sessions()
        assert cleaned == [session]
        assert ours.wait(10) is not None  # the recorded process (pid and start time) was ended
        assert decoy.poll() is None and reused.poll() is None  # the decoy and the reused pid were not touched
        assert not list((tmp_path / "state" / "ray-sessions").glob("*.json"))  # every record read is dropped
    finally:
        for process in (decoy, reused, ours):
            process.kill()
            process.wait(10)
