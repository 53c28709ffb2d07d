"""The OpenAI-compatible endpoint an agent program drives the policy through (``roles.rollout.agent.gateway``).

An agent program written against any OpenAI client is run once per trajectory as
``program(task, base_url, api_key)``. The API key names the trajectory: every
``POST /v1/chat/completions`` made with it is one model turn of that trajectory. Relax never
re-tokenizes what the program sends back: the first call's messages are rendered once with the
chat template (the prompt); each later call must send the previous call's messages and the
assistant message returned, unchanged, then only new messages, which are rendered with
``ChatTokens.following`` and appended to the tokens the model actually read and wrote. The
trajectory thus records the exact tokens, behaviour log-probs and policy version of every call,
and is trained like an environment's.

Sampling is the run's (``roles.rollout.sampling``): the request's temperature, top_p, seed, stop
and the like are ignored, so the behaviour policy is the one the algorithm corrects against.

Time and budgets: the program has ``tool_timeout_s * (max_turns + 1)`` seconds; past it, or if it
raises, the trajectory ends with an error (kept with a zero loss mask) and the run goes on. A call
past ``max_turns`` or with no tokens left is refused (400) and the trajectory is truncated. While
the program thinks between calls the batcher counts it as outside, so it never waits for it.

The server is the standard library's ``ThreadingHTTPServer`` on loopback by default, started once
per driver on its first trajectory and stopped by ``close()``.
"""

from __future__ import annotations

import contextvars
import importlib
import json
import math
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from relax.agents.calls import EnvironmentCalls, EnvironmentFailure
from relax.agents.chat import ChatTokens, TemplateError
from relax.agents.runner import AgentLimits, BackendFailure, GenerationBatcher
from relax.agents.tool_calls import CLOSE, OPEN, parse_tool_calls
from relax.agents.trajectory import Trajectory
from relax.contracts import AgentTask, Generation, TokenPrompt, ToolSpec
from relax.telemetry import AGENT_TURN, NULL_SPAN

#: The model name ``GET /v1/models`` lists (a request may name any model: there is only the policy).
MODEL_ID = "relax-policy"

_BLOCK = re.compile(re.escape(OPEN) + r".*?" + re.escape(CLOSE), re.DOTALL)
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ProgramError(ValueError):
    """``roles.rollout.agent.gateway.program`` does not name a callable that can be imported."""


class GatewayError(Exception):
    """A request the gateway refuses, with its HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}


def load_program(ref: str) -> Callable[..., Any]:
    """The agent program ``package.module:function`` names (imported once, by the driver)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: write it as package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: module {module_name!r} cannot be imported "
                           f"({type(exc).__name__}: {exc}); install its package or put it on PYTHONPATH") from exc
    program = getattr(module, attr, None)
    if program is None:
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: module {module_name!r} has no {attr!r}")
    if not callable(program):
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: {attr!r} is a {type(program).__name__}, "
                           "not a callable; give a function program(task, base_url, api_key)")
    return program


@dataclass
class _Message:
    """A chat message as the gateway compares and renders it (text only)."""

    role: str
    content: str
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """``name`` and ``tool_call_id``: passed to the template, not compared."""

    def same(self, other: _Message) -> bool:
        return (self.role, self.content, self.tool_calls) == (other.role, other.content, other.tool_calls)

    def template(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates take it (tool-call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content, **self.extra}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                                 for n, a in self.tool_calls]
        return out


@dataclass
class _Session:
    """One trajectory's state behind its API key."""

    task: AgentTask
    batcher: GenerationBatcher
    traj: Trajectory
    context: contextvars.Context
    """The trajectory thread's context: the turn spans nest in the rollout batch's span."""
    turn_lock: threading.Lock = field(default_factory=threading.Lock)
    """One call at a time: each call extends the previous one."""
    state: threading.Condition = field(default_factory=threading.Condition)
    closed: bool = False
    in_flight: int = 0
    chat: ChatTokens | None = None
    tools: list[ToolSpec] = field(default_factory=list)
    tools_key: str = ""
    history: list[_Message] = field(default_factory=list)
    """The messages of the last call and the assistant message returned to it."""
    stopped: str | None = None
    """The decoded stop token the last model turn ended with (None: it was cut at its budget)."""
    calls: int = 0
    ended: str | None = None
    """Why the gateway refuses further calls (a budget was spent; the trajectory is truncated)."""
    model_s: float = 0.0
    failure: BaseException | None = None
    """The rollout backend's failure, raised on the trajectory's thread once the program is done."""


class ProgramDriver:
    """Runs a trajectory by calling an agent program that talks to the policy through the gateway."""

    def __init__(self, agent: Any, backend: Any, limits: AgentLimits, version: Callable[[], int],
                 telemetry: Any = None, max_prompt_tokens: int = 256) -> None:
        gateway = agent.gateway
        if gateway is None:
            raise ValueError("ProgramDriver needs roles.rollout.agent.gateway (the agent program and its endpoint)")
        self.name = gateway.program
        self.program = load_program(gateway.program)
        self.host, self.port = gateway.host, gateway.port
        self.tokenizer = backend.tokenizer
        self.limits, self.version, self.telemetry = limits, version, telemetry
        self.max_prompt_tokens = max_prompt_tokens
        self._plain = ChatTokens(self.tokenizer, [], None, max_prompt_tokens)  # checks the template once, early
        self.timeout_s = limits.tool_timeout_s * (limits.max_turns + 1)
        self.calls = EnvironmentCalls(f"agent program {self.name}", self.timeout_s, limits.concurrency)
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    # -- the server --------------------------------------------------------------------------------

    def start(self) -> str:
        """Start the endpoint if it is not running; its base URL (``http://host:port/v1``)."""
        with self._lock:
            if self._server is None:
                server_cls = _Server6 if ":" in self.host else _Server
                try:
                    server = server_cls((self.host, self.port), _Handler)
                except OSError as exc:
                    raise RuntimeError(f"the agent gateway cannot listen on {self.host}:{self.port} ({exc}); set "
                                       "roles.rollout.agent.gateway.port to a free port, or 0 to pick one") from exc
                server.driver = self
                thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                          name="relax-agent-gateway", daemon=True)
                thread.start()
                self._server, self._thread = server, thread
                host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
                host = f"[{host}]" if ":" in host else host
                self.base_url = f"http://{host}:{server.server_address[1]}/v1"
            return self.base_url

    def close(self) -> None:
        """Stop the endpoint (a later trajectory starts it again)."""
        with self._lock:
            server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

    # -- a trajectory ------------------------------------------------------------------------------

    def episode(self, task: AgentTask, batcher: GenerationBatcher) -> Trajectory:
        base_url = self.start()
        key = "relax-" + secrets.token_urlsafe(24)
        session = _Session(task=task, batcher=batcher, traj=Trajectory(prompt_ids=[]),
                           context=contextvars.copy_context())
        with self._lock:
            self._sessions[key] = session
        traj = session.traj
        result: Any = None
        batcher.outside(+1)  # the program thinks outside its calls: the batcher does not wait for it
        started = time.perf_counter()
        try:
            result, _ = self.calls.call("program", self.program, task, base_url, key)
        except EnvironmentFailure as exc:
            if exc.__cause__ is None:  # the time limit (calls.py raises without a cause)
                traj.error = (f"agent program {self.name}: ran past {self.timeout_s:g} s (roles.rollout.agent."
                              "tool_timeout_s x (max_turns + 1)); the trajectory ends here")
            elif session.ended is None:
                cause = exc.__cause__
                traj.error = f"agent program {self.name}: raised {type(cause).__name__}: {cause}"
            # else: the program stopped on the gateway's refusal of a call past a budget (truncated)
        finally:
            self._close(key, session)
            batcher.outside(-1)
        traj.env_s = max(0.0, time.perf_counter() - started - session.model_s)
        if session.failure is not None:
            raise session.failure
        if traj.error is None:
            if isinstance(result, bool) or not (result is None or isinstance(result, (int, float))):
                traj.error = (f"agent program {self.name}: returned a {type(result).__name__}; return the "
                              "trajectory's reward (a float) or None (the reward plugins score it)")
            elif result is not None and not math.isfinite(float(result)):
                traj.error = f"agent program {self.name}: returned the reward {result!r}; a reward is a finite float"
            elif result is not None:
                traj.agent_reward = float(result)
            if traj.error is None and not traj.turns:
                traj.error = (f"agent program {self.name}: returned without calling the model; it must call "
                              f"{base_url}/chat/completions with the API key it was given")
        if not traj.prompt_ids:  # no call was served: the task's prompt stands for the sample's prompt
            traj.prompt_ids = self._plain.prompt(task.prompt).ids
        return traj

    def _close(self, key: str, session: _Session) -> None:
        """Refuse the key from now on and wait for a call already being served (it is generated
        while the trajectory is still live, so the batcher serves it)."""
        with self._lock:
            self._sessions.pop(key, None)
        with session.state:
            session.closed = True
            while session.in_flight:
                session.state.wait()

    # -- a request ----------------------------------------------------------------------------------

    def models(self, key: str | None) -> dict[str, Any]:
        self._session(key)
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "relax"}]}

    def _session(self, key: str | None) -> _Session:
        with self._lock:
            session = self._sessions.get(key or "")
        if session is None:
            raise GatewayError(401, "unknown or expired API key: each trajectory has its own key, valid while its "
                                    "agent program runs (use the api_key the program was called with)",
                               kind="invalid_request_error", code="invalid_api_key")
        return session

    def complete(self, key: str | None, request: Any) -> dict[str, Any]:
        """Serve one ``/v1/chat/completions`` request of the trajectory ``key`` names."""
        session = self._session(key)
        with session.state:
            if session.closed:
                raise GatewayError(401, "this trajectory has ended; its API key is no longer valid",
                                   code="invalid_api_key")
            session.in_flight += 1
        try:
            with session.turn_lock:
                return self._complete(session, request)
        finally:
            with session.state:
                session.in_flight -= 1
                session.state.notify_all()

    def _complete(self, session: _Session, request: Any) -> dict[str, Any]:
        limits, traj = self.limits, session.traj
        if not isinstance(request, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        if request.get("stream"):
            raise GatewayError(400, "stream=true is not supported by the Relax gateway; call without streaming",
                               code="unsupported_parameter")
        if request.get("n") not in (None, 1):
            raise GatewayError(400, "n must be 1: each call is one turn of one trajectory",
                               code="unsupported_parameter")
        raw = request.get("messages")
        if not isinstance(raw, list) or not raw:
            raise GatewayError(400, "messages must be a non-empty list of chat messages")
        messages = [_message(i, m) for i, m in enumerate(raw)]
        asked = request.get("max_completion_tokens", request.get("max_tokens"))
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            raise GatewayError(400, f"max_completion_tokens / max_tokens must be a positive integer, got {asked!r}")
        tools, tools_key = _tools(request.get("tools"))
        if session.ended is not None:
            raise GatewayError(400, session.ended, code="trajectory_ended")
        if session.failure is not None:
            raise GatewayError(503, f"the rollout backend failed: {session.failure}", kind="server_error",
                               code="backend_failure")

        context: list[int] = []
        if session.calls == 0:
            session.chat = ChatTokens(self.tokenizer, tools, None, self.max_prompt_tokens)
            session.tools, session.tools_key = tools, tools_key
            text = session.chat.render([m.template() for m in messages], generation_prompt=True)
            prompt = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(prompt) > self.max_prompt_tokens:
                raise GatewayError(400, f"the first call's messages render to {len(prompt)} tokens, more than "
                                        f"data.max_prompt_tokens={self.max_prompt_tokens}; shorten them or raise it",
                                   code="context_length_exceeded")
        else:
            assert session.chat is not None
            if tools_key != session.tools_key:
                raise GatewayError(400, "tools differ from the trajectory's first call; they are part of the prompt's "
                                        "tokens, so every call of a trajectory must declare the same tools",
                                   code="history_edited")
            new = self._extension(session, messages)
            if session.calls >= limits.max_turns:
                self._end(session, f"the trajectory has used its {limits.max_turns} model calls "
                                   "(roles.rollout.agent.max_turns); it is truncated here")
            try:
                context = session.chat.following([m.template() for m in new], [], session.stopped).ids
            except TemplateError as exc:
                raise GatewayError(400, str(exc), code="unsupported_messages") from exc
            prompt = traj.prompt_ids
        left = limits.max_tokens - len(traj.response_ids) - len(context)
        budget = min(limits.max_new_tokens, left, asked or limits.max_new_tokens)
        if budget <= 0:
            self._end(session, f"the trajectory has no tokens left of roles.rollout.agent.max_tokens="
                               f"{limits.max_tokens}; it is truncated here")
        if session.calls == 0:
            traj.prompt_ids = prompt
        traj.add_context(context)
        index = session.calls
        generation, version = session.context.run(self._generate, session, index, budget)
        session.calls += 1
        traj.add_model(generation.response_ids, generation.logprobs, version)
        traj.final_text = generation.text
        session.stopped = (self.tokenizer.decode(generation.response_ids[-1:], skip_special_tokens=False)
                           if generation.finished and generation.response_ids else None)
        return self._response(session, request, messages, generation, prompt_tokens=len(traj.ids) - len(
            generation.response_ids))

    def _extension(self, session: _Session, messages: list[_Message]) -> list[_Message]:
        """The new messages of a later call, after checking it repeats the previous call and reply."""
        previous = session.history
        for i, old in enumerate(previous):
            if i >= len(messages) or not messages[i].same(old):
                what = "the assistant message this endpoint returned" if i == len(previous) - 1 else \
                    "the previous call's message"
                got = "is missing" if i >= len(messages) else "differs"
                raise GatewayError(400, f"message {i} {got} from {what}. Relax trains on token sequences: each call "
                                        "of a trajectory must send the previous call's messages and the assistant "
                                        "reply unchanged, then only new messages (edit or drop history in a new "
                                        "trajectory instead)", code="history_edited")
        return messages[len(previous):]

    def _end(self, session: _Session, why: str) -> None:
        session.traj.truncated = True
        session.ended = why
        raise GatewayError(400, why, code="trajectory_ended")

    def _generate(self, session: _Session, index: int, budget: int) -> tuple[Generation, int]:
        """One model turn through the batcher, in an ``AGENT_TURN`` span."""
        traj, batcher = session.traj, session.batcher
        span_cm = NULL_SPAN if self.telemetry is None else self.telemetry.span(
            AGENT_TURN, trajectory=session.task.trajectory_id, turn=index)
        started = time.perf_counter()
        with span_cm as span:
            batcher.outside(-1)
            try:
                generation = batcher.request(TokenPrompt(traj.ids, [], budget))
            except BackendFailure as exc:
                session.failure = exc
                raise GatewayError(503, f"the rollout backend failed: {exc}", kind="server_error",
                                   code="backend_failure") from exc
            finally:
                batcher.outside(+1)
                session.model_s += time.perf_counter() - started
            version = int(self.version())
            span.set(tokens=len(generation.response_ids), policy_version=version)
        return generation, version

    def _response(self, session: _Session, request: dict[str, Any], messages: list[_Message],
                  generation: Generation, prompt_tokens: int) -> dict[str, Any]:
        """The OpenAI ``chat.completion`` of a turn; the reply joins the session's history."""
        traj, text = session.traj, generation.text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: list[tuple[str, dict[str, Any]]] = []
        finish = "stop" if generation.finished else "length"
        if session.tools:
            parsed = parse_tool_calls(text, session.tools, self.limits.tool_call_format)
            traj.tool_calls += parsed.attempted
            traj.tool_errors += len(parsed.errors)
            if parsed.calls and not parsed.errors:  # a malformed call: the program gets the text as written
                calls = [(c.name, c.arguments) for c in parsed.calls]
                content = _BLOCK.sub("", text).strip()
                message["content"] = content or None
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": name, "arguments": json.dumps(arguments)}} for name, arguments in calls]
                finish = "tool_calls" if generation.finished else finish
        session.history = [*messages, _Message("assistant", message["content"] or "", calls)]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if request.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": float(lp), "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                for token, lp in zip(self._tokens(generation.response_ids), generation.logprobs)]}
        completion = len(generation.response_ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": str(request.get("model") or MODEL_ID), "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    def _tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _message(index: int, raw: Any) -> _Message:
    """A request's message, checked: a known role, text content, tool calls with JSON arguments."""
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise GatewayError(400, f"{where} must be an object with role and content")
    role = raw.get("role")
    if role not in _ROLES:
        raise GatewayError(400, f"{where} has role {role!r}; the roles are: {', '.join(_ROLES)}")
    calls = []
    for j, call in enumerate(raw.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise GatewayError(400, f"{where}: tool call {j} needs function.name and function.arguments")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise GatewayError(400, f"{where}: tool call {j} has arguments that are not JSON ({exc.msg})") from exc
        calls.append((function["name"], arguments))
    extra = {k: raw[k] for k in ("name", "tool_call_id") if isinstance(raw.get(k), str)}
    return _Message(role, _text(where, raw.get("content")), calls, extra)


def _text(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: content must be a string or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise GatewayError(400, f"{where} has a {kind!r} content part; the gateway takes text only (images and "
                                    "audio reach the model through environments, see docs/agents.md)",
                               code="unsupported_content")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _tools(raw: Any) -> tuple[list[ToolSpec], str]:
    """The request's ``tools`` as ``ToolSpec`` (function tools only), and a key to compare them by."""
    if raw is None:
        return [], "[]"
    if not isinstance(raw, list):
        raise GatewayError(400, "tools must be a list of function tools")
    tools = []
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise GatewayError(400, f"tools[{i}]: only function tools are supported "
                                    '({"type": "function", "function": {"name": ..., "parameters": {...}}})')
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        tools.append(ToolSpec(function["name"], str(function.get("description") or ""), parameters))
    return tools, json.dumps([t.to_openai() for t in tools], sort_keys=True)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    #: Connections waiting to be accepted: every trajectory of a unit may connect at once (the
    #: standard library's 5 refuses most of a batch of agent programs).
    request_queue_size = 1024
    driver: ProgramDriver


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    """HTTP around ``ProgramDriver.complete`` and ``models``; every error as an OpenAI error body."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return None  # one line per call on stderr would drown the run's log

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._serve(lambda key: self._route({"/v1/models": lambda: self.server.driver.models(key)}))

    def do_POST(self) -> None:  # noqa: N802
        try:  # read the body first: on a kept-alive connection, an unread body would spoil the next request
            raw: bytes | None = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        except ValueError:
            raw = None

        def chat(key: str | None) -> dict[str, Any]:
            try:
                body = json.loads(raw or b"null") if raw is not None else None
            except ValueError as exc:
                raise GatewayError(400, f"the request body is not JSON ({exc})") from exc
            return self.server.driver.complete(key, body)

        self._serve(lambda key: self._route({"/v1/chat/completions": lambda: chat(key)}))
        if raw is None:
            self.close_connection = True

    def _route(self, routes: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in routes:
            raise GatewayError(404, f"no route {self.command} {self.path}; the gateway serves POST "
                                    "/v1/chat/completions and GET /v1/models", code="not_found")
        return routes[path]()

    def _serve(self, handle: Callable[[str | None], dict[str, Any]]) -> None:
        auth = self.headers.get("Authorization") or ""
        key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None
        try:
            status, body = 200, handle(key)
        except GatewayError as exc:
            status, body = exc.status, exc.body()
        except Exception as exc:  # a gateway bug: the program gets it as an error, the server goes on
            status, body = 500, GatewayError(500, f"the Relax gateway failed: {type(exc).__name__}: {exc}",
                                             kind="server_error").body()
        data = json.dumps(body).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if status >= 500:  # the OpenAI client retries 5xx; a failed backend or gateway will not recover
                self.send_header("x-should-retry", "false")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the program hung up (it timed out or was abandoned): nobody to answer
            self.close_connection = True
