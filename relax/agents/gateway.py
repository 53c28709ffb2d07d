"""The endpoint an agent program drives the policy through (``roles.rollout.agent.gateway``).

An agent program written against the OpenAI or Anthropic client is run once per trajectory as
``program(task, base_url, api_key)``. The API key names the trajectory: every call made with it is
one model turn of that trajectory, through any of the APIs of ``relax.agents.wire_formats`` (chat
completions, streamed or not; responses; Anthropic messages; legacy text completions), which all
come down to one conversation. Relax never re-tokenizes what the program sends back: the first
call's messages are rendered once with the chat template (the prompt); each later call must send
the previous call's messages and the assistant message returned (up to whitespace and ``content:
null``), then only new messages, which are rendered with ``ChatTokens.following`` and appended to
the tokens the model actually read and wrote. The trajectory thus records the exact tokens,
behaviour log-probs and policy version of every call, and is trained like an environment's.

Sampling is the run's (``roles.rollout.sampling``): the request's temperature, top_p, seed, stop
and the like are ignored, so the behaviour policy is the one the algorithm corrects against.
``tool_choice`` (none, required, a named tool) and ``response_format`` (``json_object``,
``json_schema``; Responses' ``text.format``) are enforced by constrained decoding: the turn is
sampled under a grammar (``relax.agents.constraints``) by a backend whose ``constrained_decoding``
takes it (hf: llguidance; vllm: its structured outputs), and its recorded log-probs are those of
the masked distribution it was drawn from. A
backend without it, or a tool-call format the grammar cannot express, gets a 400 that names the
parameter and the backend, never a silent ignore.

Per-turn rewards: a call whose ``metadata`` holds ``relax.turn_reward`` (a number, or its text as
the OpenAI API's string-valued metadata carries it) sets the reward of the turn that call generates;
``POST /v1/relax/turn_reward`` with ``{"reward": r, "turn": t}`` under the trajectory's key sets turn
``t``'s (default: the last turn), e.g. once the program has judged the last reply. The trajectory's
``turn_reward`` is their sum, weighted by ``roles.rollout.agent.turn_reward_weight`` and added to its
reward as an environment's turn rewards are (``relax.runtime.worker.roles.reward.agent_rewards``).

Time and budgets: the program has ``tool_timeout_s * (max_turns + 1)`` seconds; past it, or if it
raises, the trajectory ends with an error (kept with a zero loss mask) and the run goes on. A call
past ``max_turns`` or with no tokens left is refused (400) and the trajectory is truncated. Until
its first call the batcher counts the program as outside (it never waits for it); once handed a
reply, the program is *returning*: the next batch waits for it to call again, but only within the
linger of its reply (``relax.agents.runner``), after which it counts as outside too. A thousand
programs reading their replies one after another thus share a batch instead of making dozens.

The server (``relax.agents.gateway_http``) listens on loopback by default, started once per
driver on its first trajectory and stopped by ``close()``: one asyncio event loop with HTTP/1.1
keep-alive, so a connection costs a file descriptor and no thread. It checks the key
(``Authorization: Bearer`` or ``x-api-key``) before it reads a body, refuses a body over
``MAX_BODY_BYTES`` with 413 unread, bounds every read in time, serves at most ``MAX_ACTIVE``
requests (or twice ``roles.rollout.agent.concurrency``) at once (503 past it) and
``MAX_CALLS_PER_KEY`` calls per key (429 past it). A call is served on its trajectory's own thread
(``dispatch``), which otherwise only waits for its program. A program running in the driver's
process may skip the socket: ``ProgramDriver.in_process`` (or ``gateway_http.http_client``) gives
an ``httpx2`` client whose transport calls the same routes directly.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import inspect
import math
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from relax.agents.calls import EnvironmentFailure
from relax.agents.chat import ChatTokens, TemplateError
from relax.agents.constraints import (
    anthropic_choice,
    asked_by,
    grammar,
    openai_choice,
    response_schema,
    structured_outputs,
)
from relax.agents.gateway_http import (
    MAX_ACTIVE,
    MAX_BODY_BYTES,
    MAX_CALLS_PER_KEY,
    ROUTES,
    GatewayServer,
    Routes,
    base_url_of,
    in_process_client,
    register,
    unregister,
)
from relax.agents.program_processes import ProgramProcesses
from relax.agents.programs import Outcome, ProgramError, ProgramRaised, checked_reward, load_program
from relax.agents.runner import AgentLimits, BackendFailure, GenerationBatcher
from relax.agents.tool_calls import parse_tool_calls, resolve_format, turn_text
from relax.agents.trajectory import Trajectory
from relax.agents.wire_formats import (
    MODEL_ID,
    Api,
    Event,
    GatewayError,
    Message,
    ModelCall,
    Reply,
    TextCall,
    anthropic_events,
    anthropic_message,
    chat_chunks,
    chat_completion,
    read_chat,
    read_completions,
    read_messages,
    read_responses,
    response_events,
    response_object,
    text_chunks,
    text_completion,
)
from relax.contracts import AgentTask, Generation, TokenPrompt, ToolSpec
from relax.telemetry import AGENT_SEGMENT, AGENT_TURN, NULL_SPAN

__all__ = ["MAX_ACTIVE", "MAX_BODY_BYTES", "MAX_CALLS_PER_KEY", "ROUTES", "ProgramDriver", "ProgramError",
           "load_program"]

#: How many tool sets' chat renderers a driver keeps (``ProgramDriver._chat``): programs of a run
#: declare one or a few; a program that varies its tools per call only rebuilds them.
CHAT_RENDERERS = 64
#: The ``metadata`` key of a request through which a program reports the reward of the turn it asks for.
TURN_REWARD_KEY = "relax.turn_reward"


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
    work: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    """Calls the server hands to the trajectory's thread (``ProgramDriver.dispatch``); None: the
    program has ended."""
    closed: bool = False
    in_flight: int = 0
    chat: ChatTokens | None = None
    tools: list[ToolSpec] = field(default_factory=list)
    tools_key: str = ""
    history: list[Message] = field(default_factory=list)
    """The messages of the last call and the assistant message returned to it."""
    mode: str | None = None
    """``chat`` (chat-style messages: chat completions, responses, messages) or ``text`` (legacy
    completions): set by the first call; a trajectory keeps to one."""
    text: str = ""
    """Legacy completions: the last prompt and the completion returned for it."""
    responses: dict[str, list[Message]] = field(default_factory=dict)
    """Responses API: each response's conversation (its messages and reply), by response id."""
    refused: str | None = None
    """The code of the last call the gateway refused (what a program that then fails failed on)."""
    turn_rewards: dict[int, float] = field(default_factory=dict)
    """The rewards the program reported, by turn (counted over the whole trajectory, every segment)."""
    segment_carrier: dict[str, str] = field(default_factory=dict)
    """The trace carrier of the current segment's ``relax.agent.segment`` span (a new segment links to it)."""
    stopped: str | None = None
    """The decoded stop token the last model turn ended with (None: it was cut at its budget)."""
    calls: int = 0
    ended: str | None = None
    """Why the gateway refuses further calls (a budget was spent; the trajectory is truncated)."""
    model_s: float = 0.0
    outside: bool = False
    """Counted by the batcher as outside (the program has not called the model yet)."""
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
        self.routes = Routes(self)
        """The gateway's routes, whatever carries a request (a socket, an in-process client, a worker's channel)."""
        self._processes = ProgramProcesses(gateway.program, gateway.processes, self.routes, host=gateway.host,
                                           max_active=self._max_active(limits)) \
            if gateway.processes else None
        """The worker processes the program runs in (``roles.rollout.agent.gateway.processes``), or None:
        in this process."""
        self.tokenizer = backend.tokenizer
        self.limits, self.version, self.telemetry = limits, version, telemetry
        self.max_prompt_tokens = max_prompt_tokens
        self._plain = ChatTokens(self.tokenizer, [], None, max_prompt_tokens)  # checks the template once, early
        self.backend_name = type(backend).__module__.rsplit(".", 1)[-1]
        """Named in a refusal of what the backend cannot enforce (``tool_choice``, ``response_format``)."""
        self.constrained = frozenset(getattr(backend, "constrained_decoding", ()) or ())
        """The constraints the backend decodes under: ``grammar`` (``TokenPrompt.grammar``, hf) or
        ``structured_outputs`` (vLLM's); empty: none."""
        self.developer_role = _developer_role(self._plain)
        self.format = resolve_format(limits.tool_call_format, self.tokenizer)
        """The tool-call format of the model's turns (``auto`` resolved from its chat template), as
        the environment path parses them (``agent/malformed_calls/<format>``)."""
        self.history = agent.history
        """``segments``: a call that does not extend the conversation starts a new segment; ``strict``: 400."""
        self.timeout_s = limits.tool_timeout_s * (limits.max_turns + 1)
        self._slots = threading.Semaphore(limits.concurrency)
        """Plain programs running at once (each on a thread of its own)."""
        self._sessions: dict[str, _Session] = {}
        self._async = inspect.iscoroutinefunction(self.program)
        """An ``async def`` program: run on the driver's one event loop (``_run_program``), not a thread each."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._server: GatewayServer | None = None
        self._clients: dict[bool, Any] = {}
        self._chats: collections.OrderedDict[str, ChatTokens] = collections.OrderedDict()
        """The chat renderer of each tool set seen (``ModelCall.tools_key``), most recent last: building
        one renders the template's probe conversation, which cost a third of a call's server time when
        every trajectory built its own (the same tools, in a run's programs, nearly always)."""
        self.base_url = ""

    # -- the server --------------------------------------------------------------------------------

    @staticmethod
    def _max_active(limits: AgentLimits) -> int:
        """Requests a server serves at once: ``MAX_ACTIVE``, or twice the trajectories run at once."""
        return max(MAX_ACTIVE, 2 * limits.concurrency)

    def start(self) -> str:
        """Start the endpoint if it is not running; its base URL (``http://host:port/v1``)."""
        with self._lock:
            if self._server is None:
                try:
                    server = GatewayServer(self.routes, self.host, self.port, max_active=self._max_active(self.limits))
                except OSError as exc:
                    raise RuntimeError(f"the agent gateway cannot listen on {self.host}:{self.port} ({exc}); set "
                                       "roles.rollout.agent.gateway.port to a free port, or 0 to pick one") from exc
                self._server = server
                self.base_url = base_url_of(self.host, server.server_address[1])
                register(self.base_url, self)
                if self._processes is not None:  # they import the program meanwhile; the first run waits
                    self._processes.start()
            return self.base_url

    def close(self) -> None:
        """Stop the endpoint and the programs' event loop (a later trajectory starts them again)."""
        with self._lock:
            server, self._server = self._server, None
            loop, loop_thread, self._loop, self._loop_thread = self._loop, self._loop_thread, None, None
            clients, self._clients = self._clients, {}
        if self._processes is not None:  # before the server: a program's last calls still reach it
            self._processes.close()
        if server is not None:
            unregister(self.base_url, self)
            server.close()
        for client in clients.values():
            close = getattr(client, "close", None)
            if close is not None:
                close()
        if loop is not None and loop_thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            loop_thread.join()
            loop.close()

    def _programs_loop(self) -> asyncio.AbstractEventLoop:
        """The one event loop every ``async def`` program of the driver runs on (started on first use)."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="relax-agent-programs", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def _run_program(self, session: _Session, task: AgentTask, base_url: str, key: str) -> Outcome:
        """Run the program (in a worker process; else an ``async def`` one on the driver's one event
        loop, a plain one on a thread of its own) within its time limit, and meanwhile serve the
        calls the server hands to the trajectory (``dispatch``) on this thread, the trajectory's:
        thousands of concurrent trajectories then cost no server thread each. Its checked outcome,
        or ``EnvironmentFailure`` (from the program's exception; without a cause past the limit, a
        coroutine then cancelled)."""
        box: dict[str, Any] = {}
        future: concurrent.futures.Future | None = None
        cancel: Callable[[], Any] | None = None
        if self._processes is not None:
            def done(outcome: Outcome) -> None:
                box["outcome"] = outcome
                session.work.put(None)

            cancel = self._processes.run(task, key, done)
        elif self._async:
            future = asyncio.run_coroutine_threadsafe(self.program(task, base_url, key), self._programs_loop())
            future.add_done_callback(lambda _: session.work.put(None))
        else:
            self._slots.acquire()  # waiting for a slot does not count against the time limit
            released = threading.Lock()

            def release() -> None:  # once: when the program ends, or when it is abandoned past its limit
                if released.acquire(blocking=False):
                    self._slots.release()

            def run() -> None:
                try:
                    result = self.program(task, base_url, key)
                    if inspect.isawaitable(result):
                        result = asyncio.run(_awaited(result))
                    box["result"] = result
                except BaseException as exc:  # reported to the trajectory, never raised on this thread
                    box["error"] = exc
                finally:
                    release()
                    session.work.put(None)

            threading.Thread(target=run, name=f"agent-program-{task.trajectory_id}", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                item = session.work.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                if cancel is not None:
                    cancel()
                elif future is not None:
                    future.cancel()
                else:
                    release()
                raise EnvironmentFailure(f"agent program {self.name} ran past {self.timeout_s:g} s") from None
            if item is None:
                break
            item()
        if cancel is not None:
            outcome = box["outcome"]
            if outcome.raised is not None:
                raise EnvironmentFailure(f"agent program {self.name} raised {outcome.raised}: {outcome.error}") \
                    from ProgramRaised(outcome.raised, outcome.error or "", outcome.code)
            return outcome
        if future is not None:
            try:
                return checked_reward(future.result(), self.name)
            except Exception as exc:
                raise EnvironmentFailure(f"agent program {self.name} raised {type(exc).__name__}: {exc}") from exc
        if "error" in box:
            error = box["error"]
            raise EnvironmentFailure(f"agent program {self.name} raised {type(error).__name__}: {error}") from error
        return checked_reward(box.get("result"), self.name)

    def dispatch(self, key: str | None, work: Callable[[], Any], reply: Callable[[Any], None]) -> None:
        """Serve a call of the server: ``reply(work())`` on the thread of the trajectory ``key``
        names, or here at once when no live trajectory has the key (``work`` then refuses it
        without blocking)."""
        with self._lock:
            session = self._sessions.get(key or "")
        if session is not None:
            with session.state:
                if not session.closed:
                    session.work.put(lambda: reply(work()))
                    return
        reply(work())

    def program_pids(self) -> list[int]:
        """The process ids of the program's worker processes running now (none without ``processes``)."""
        return self._processes.pids() if self._processes is not None else []

    def in_process(self, sync: bool = True) -> Any:
        """The driver's in-process ``httpx2`` client (``relax.agents.gateway_http.http_client``)."""
        with self._lock:
            client = self._clients.get(sync)
            if client is None:
                client = self._clients[sync] = in_process_client(self, sync)
            return client

    # -- a trajectory ------------------------------------------------------------------------------

    def episode(self, task: AgentTask, batcher: GenerationBatcher) -> Trajectory:
        base_url = self.start()
        key = "relax-" + secrets.token_urlsafe(24)
        session = _Session(task=task, batcher=batcher, traj=Trajectory(prompt_ids=[]),
                           context=contextvars.copy_context())
        with self._lock:
            self._sessions[key] = session
        traj = session.traj
        outcome = Outcome()
        batcher.outside(+1)  # until its first call the program may take any time: the batcher does not wait for it
        session.outside = True
        started = time.perf_counter()
        try:
            outcome = self._run_program(session, task, base_url, key)
        except EnvironmentFailure as exc:
            if exc.__cause__ is None:  # the time limit (calls.py raises without a cause)
                traj.error = (f"agent program {self.name}: ran past {self.timeout_s:g} s (roles.rollout.agent."
                              "tool_timeout_s x (max_turns + 1)); the trajectory ends here")
                traj.cause = "program_timeout"
            elif session.ended is None:
                cause = exc.__cause__
                raised_type = cause.type_name if isinstance(cause, ProgramRaised) else type(cause).__name__
                traj.error = f"agent program {self.name}: raised {raised_type}: {cause}"
                code = getattr(cause, "code", None)  # an API client's error for a refused call
                code = code if isinstance(code, str) and code else session.refused
                traj.cause = raised_type + (f":{code}" if code else "")
            # else: the program stopped on the gateway's refusal of a call past a budget (truncated)
        finally:
            self._close(key, session)
            if session.outside:
                batcher.outside(-1)
            batcher.returning(id(session), back=False)
        traj.env_s = max(0.0, time.perf_counter() - started - session.model_s)
        if session.failure is not None:
            raise session.failure
        if traj.error is None:
            if outcome.error is not None:
                traj.error, traj.cause = outcome.error, outcome.cause
            elif outcome.reward is not None:
                traj.agent_reward = outcome.reward
            if traj.error is None and not traj.turns:
                traj.error = (f"agent program {self.name}: returned without calling the model; it must call "
                              f"{base_url}/chat/completions with the API key it was given")
                traj.cause = "program_made_no_call"
        if not traj.prompt_ids:  # no call was served: the task's prompt stands for the sample's prompt
            traj.prompt_ids = self._plain.prompt(task.prompt).ids
        return traj

    def _close(self, key: str, session: _Session) -> None:
        """Refuse the key from now on and wait for a call already being served (it is generated
        while the trajectory is still live, so the batcher serves it)."""
        with self._lock:
            self._sessions.pop(key, None)
        with session.state:
            session.closed = True  # dispatch hands it no more calls
            while session.in_flight:
                session.state.wait()
        while True:  # calls handed over while the program ended: refused (the key is closed)
            try:
                item = session.work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item()

    # -- a request ----------------------------------------------------------------------------------

    def models(self, key: str | None) -> dict[str, Any]:
        self._session(key)
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "relax"}]}

    def check_key(self, key: str | None) -> None:
        """Raise the 401 ``GatewayError`` unless ``key`` names a live trajectory (checked before a body is read)."""
        self._session(key)

    def _session(self, key: str | None) -> _Session:
        with self._lock:
            session = self._sessions.get(key or "")
        if session is None:
            raise GatewayError(401, "unknown or expired API key: each trajectory has its own key, valid while its "
                                    "agent program runs (use the api_key the program was called with)",
                               kind="invalid_request_error", code="invalid_api_key")
        return session

    def serve(self, key: str | None, api: Api, body: Any) -> dict[str, Any] | Iterator[Event]:
        """Serve one request of the trajectory ``key`` names: a reply in the API's shape, or its
        server-sent events when the request asks to stream."""
        session = self._session(key)
        with session.state:
            if session.closed:
                raise GatewayError(401, "this trajectory has ended; its API key is no longer valid",
                                   code="invalid_api_key")
            session.in_flight += 1
        try:
            with session.turn_lock:
                return self._serve(session, api, body)
        except GatewayError as exc:
            session.refused = exc.code or f"http_{exc.status}"
            raise
        finally:
            with session.state:
                session.in_flight -= 1
                session.state.notify_all()

    def complete(self, key: str | None, request: Any) -> dict[str, Any] | Iterator[Event]:
        """Serve one ``/v1/chat/completions`` request of the trajectory ``key`` names."""
        return self.serve(key, "chat", request)

    def _serve(self, session: _Session, api: Api, body: Any) -> dict[str, Any] | Iterator[Event]:
        if api == "turn_reward":
            return self._report_turn_reward(session, body)
        reward = _metadata_reward(body)  # read first: a bad value is refused before the turn is generated
        out = self._serve_turn(session, api, body)
        if reward is not None:  # the turn this call generated
            self._set_turn_reward(session, session.calls - 1, reward)
        return out

    def _report_turn_reward(self, session: _Session, body: Any) -> dict[str, Any]:
        """``POST /v1/relax/turn_reward``: ``{"reward": r, "turn": t}`` sets turn ``t``'s reward (the
        trajectory's turns counted from 0 over every segment; default: the last turn)."""
        if not isinstance(body, dict) or "reward" not in body:
            raise GatewayError(400, 'send {"reward": <number>, "turn": <turn index, optional: the last turn>}',
                               param="reward", code="invalid_turn_reward")
        reward = _reward_value(body["reward"], "reward")
        turn = body.get("turn")
        if session.calls == 0:
            raise GatewayError(400, "this trajectory has no model turn yet; report a turn's reward after its call",
                               param="turn", code="invalid_turn_reward")
        if turn is None:
            turn = session.calls - 1
        if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < session.calls:
            raise GatewayError(400, f"turn={turn!r} is not a turn of this trajectory: give an integer from 0 to "
                                    f"{session.calls - 1} (its model calls so far, counted from 0)",
                               param="turn", code="invalid_turn_reward")
        self._set_turn_reward(session, turn, reward)
        return {"object": "relax.turn_reward", "turn": turn, "reward": reward,
                "turn_reward": session.traj.turn_reward}

    def _set_turn_reward(self, session: _Session, turn: int, reward: float) -> None:
        """Turn ``turn``'s reward is ``reward`` (reported again: replaced); the trajectory's
        ``turn_reward`` is their sum, and its info keeps each (``samples.jsonl``)."""
        session.turn_rewards[turn] = reward
        traj = session.traj
        traj.turn_reward = sum(session.turn_rewards.values())
        traj.info["turn_rewards"] = {str(t): r for t, r in sorted(session.turn_rewards.items())}

    def _serve_turn(self, session: _Session, api: Api, body: Any) -> dict[str, Any] | Iterator[Event]:
        if api == "completions":
            text_call = read_completions(body)
            echo = text_call.prompt if text_call.echo else ""
            reply = self._text_turn(session, text_call)
            return text_chunks(reply, text_call, echo) if text_call.stream else \
                text_completion(reply, text_call, echo)
        reader = {"chat": read_chat, "responses": read_responses, "messages": read_messages}[api]
        call = reader(body, self.backend_name)
        if api == "responses":
            self._resolve_previous(session, call)
        self._constrain(api, call)
        reply = self._turn(session, call)
        if api == "chat":
            return chat_chunks(reply, call) if call.stream else chat_completion(reply, call)
        if api == "messages":
            return anthropic_events(reply, call) if call.stream else anthropic_message(reply, call)
        response_id = f"resp_{uuid.uuid4().hex}"
        session.responses[response_id] = list(session.history)
        return response_events(reply, call, response_id) if call.stream else response_object(reply, call, response_id)

    def _constrain(self, api: Api, call: ModelCall) -> None:
        """The grammar ``call``'s ``tool_choice`` and ``response_format`` ask the turn to follow
        (``call.grammar``), or a 400 where the backend or the tool-call format cannot enforce it."""
        choice = anthropic_choice(call.tool_choice) if api == "messages" else \
            openai_choice(call.tool_choice, call.parallel_tool_calls)
        schema = response_schema(call.response_format, call.format_param)
        call.tool_calls_off = choice.mode == "none"
        call.grammar = grammar(choice, schema, call.tools, self.format, self.backend_name, self.tokenizer,
                               call.format_param)
        if call.grammar is None or "grammar" in self.constrained:
            return
        param = asked_by(choice, schema, call.format_param)
        if "structured_outputs" in self.constrained:
            call.structured_outputs = structured_outputs(choice, schema, call.tools, self.format)
            if call.structured_outputs is None:
                raise GatewayError(400, f"{param} cannot be enforced by the rollout backend {self.backend_name!r}: "
                                        "its structured outputs (xgrammar) cannot express it with the tool-call "
                                        f"format {self.format!r} (tool_choice none, or a response format beside "
                                        "auto tools); use the hf backend, or leave it out and check the reply in "
                                        "the program instead", code="unsupported_parameter", param=param)
            return
        raise GatewayError(400, f"{param} cannot be enforced by the rollout backend {self.backend_name!r}: it has no "
                                "constrained decoding (constrained_decoding); leave it out, or use a backend that "
                                "has it (hf, vllm), and check the reply in the program instead",
                           code="unsupported_parameter", param=param)

    def _resolve_previous(self, session: _Session, call: ModelCall) -> None:
        """A Responses call's whole conversation: the instructions, then the conversation of
        ``previous_response_id`` (one of this trajectory's), then the input items."""
        before: list[Message] = []
        if call.previous_response_id is not None:
            if call.previous_response_id not in session.responses:
                raise GatewayError(400, f"previous_response_id={call.previous_response_id!r} is not a response of "
                                        "this trajectory (responses are kept while the trajectory runs, under its "
                                        "API key)", param="previous_response_id", code="previous_response_not_found")
            before = list(session.responses[call.previous_response_id])
            if before and before[0].role == "system" and call.instructions is not None:
                before = before[1:]  # the new instructions stand in front (an edit if they differ)
        if call.instructions is not None:
            before = [Message("system", call.instructions), *before]
        call.messages = [*before, *call.messages]

    def _check_open(self, session: _Session) -> None:
        if session.ended is not None:
            raise GatewayError(400, session.ended, code="trajectory_ended")
        if session.failure is not None:
            raise GatewayError(503, f"the rollout backend failed: {session.failure}", kind="server_error",
                               code="backend_failure")

    def _render(self, session: _Session, messages: list[Message], first: bool) -> list[int]:
        """The tokens of ``messages``: the whole prompt (``first``), or what follows the last model
        turn. A template that cannot render them is the request's problem (400), never a 500."""
        assert session.chat is not None
        templated = [m.template(self.developer_role) for m in messages]
        try:
            if first:
                text = session.chat.render(templated, generation_prompt=True)
                return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            return session.chat.following(templated, [], session.stopped).ids
        except TemplateError as exc:
            raise GatewayError(400, str(exc), code="unsupported_messages") from exc
        except Exception as exc:  # the template's own refusal (raise_exception) or a type it cannot handle
            roles = ", ".join(sorted({m.role for m in messages}))
            raise GatewayError(400, f"the model's chat template cannot render these messages (roles: {roles}): "
                                    f"{type(exc).__name__}: {exc}", code="unsupported_messages") from exc

    def _turn(self, session: _Session, call: ModelCall) -> Reply:
        """One chat-style model turn: render what is new, generate, and record it."""
        limits, traj = self.limits, session.traj
        if session.mode == "text":
            raise GatewayError(400, "this trajectory talks through /v1/completions (text); a trajectory keeps to "
                                    "one kind: text completions, or chat-style messages", code="history_edited")
        self._check_open(session)
        messages = call.messages
        context: list[int] = []
        if session.calls == 0:
            session.chat = self._chat(call)
            session.tools, session.tools_key = call.tools, call.tools_key
            prompt = self._render(session, messages, first=True)
            if len(prompt) > self.max_prompt_tokens:
                raise GatewayError(400, f"the first call's messages render to {len(prompt)} tokens, more than "
                                        f"data.max_prompt_tokens={self.max_prompt_tokens}; shorten them or raise it",
                                   code="context_length_exceeded")
        else:
            edit = ("tools differ from the trajectory's first call; they are part of the prompt's tokens"
                    if call.tools_key != session.tools_key else self._edit(session, messages))
            if edit is not None and self.history == "strict":
                raise GatewayError(400, f"{edit}. Relax trains on token sequences: with roles.rollout.agent.history="
                                        "strict each call of a trajectory must send the previous call's messages "
                                        "and the assistant reply unchanged, then only new messages (set it to "
                                        "segments to continue such a call as a new segment)", code="history_edited")
            if session.calls >= limits.max_turns:
                self._end(session, f"the trajectory has used its {limits.max_turns} model calls "
                                   "(roles.rollout.agent.max_turns); it is truncated here")
            if edit is None:
                context = self._render(session, messages[len(session.history):], first=False)
            else:  # a new segment: the whole conversation as it is now is its prompt
                session.chat, session.tools, session.tools_key = self._chat(call), call.tools, call.tools_key
                ids = self._render(session, messages, first=True)
                self._branch(session, ids, edit)
            prompt = traj.prompt_ids
        constraint = (call.grammar, call.structured_outputs) if call.grammar is not None else None
        generation = self._generate_turn(session, prompt, context, call.max_tokens, constraint)
        text = generation.text
        content: str | None = text
        calls: list[tuple[str, str, dict[str, Any]]] = []
        finish = "stop" if generation.finished else "length"
        if session.tools and not call.tool_calls_off:
            # Parsed from the turn decoded with its special tokens (several formats delimit calls with them).
            parsed = parse_tool_calls(turn_text(self.tokenizer, generation.response_ids), session.tools,
                                      self.format)
            traj.tool_calls += parsed.attempted
            traj.tool_errors += len(parsed.errors)
            traj.malformed_calls += len(parsed.errors)
            if parsed.calls and not parsed.errors:  # a malformed call: the program gets the text as written
                calls = [(f"call_{uuid.uuid4().hex[:24]}", c.name, c.arguments) for c in parsed.calls]
                content = self._without_stop(parsed.content, generation) or None
                finish = "tool_calls" if generation.finished else finish
        session.history = [*messages, Message("assistant", content or "", [(n, a) for _, n, a in calls])]
        return self._reply(generation, content, calls, finish, len(traj.ids) - len(generation.response_ids),
                           call.stream)

    def _chat(self, call: ModelCall) -> ChatTokens:
        """The chat renderer of ``call``'s tools, shared by every trajectory that declares the same
        ones (it holds no trajectory state); at most ``CHAT_RENDERERS`` tool sets are kept."""
        with self._lock:
            chat = self._chats.get(call.tools_key)
            if chat is not None:
                self._chats.move_to_end(call.tools_key)
                return chat
        chat = ChatTokens(self.tokenizer, call.tools, None, self.max_prompt_tokens)  # outside the lock: it renders
        with self._lock:
            self._chats[call.tools_key] = chat
            while len(self._chats) > CHAT_RENDERERS:
                self._chats.popitem(last=False)
        return chat

    def _without_stop(self, text: str, generation: Generation) -> str:
        """A turn's text without the stop token it ended with (kept by ``turn_text``)."""
        if generation.finished and generation.response_ids:
            stop = self.tokenizer.decode(generation.response_ids[-1:], skip_special_tokens=False)
            if stop and text.endswith(stop):
                text = text[:-len(stop)]
        return text.strip()

    def _text_turn(self, session: _Session, call: TextCall) -> Reply:
        """One legacy-completions turn: the first prompt is tokenized as the program rendered it; a
        later prompt must extend the previous prompt and completion, and only the text it adds is
        tokenized (the rest of the model's stop token's text first removed, as the model wrote it)."""
        limits, traj = self.limits, session.traj
        if session.mode == "chat":
            raise GatewayError(400, "this trajectory talks through chat-style messages; a trajectory keeps to one "
                                    "kind: text completions, or chat-style messages", code="history_edited")
        self._check_open(session)
        context: list[int] = []
        if session.calls == 0:
            prompt = list(self.tokenizer(call.prompt, add_special_tokens=False)["input_ids"])
            if len(prompt) > self.max_prompt_tokens:
                raise GatewayError(400, f"the first prompt is {len(prompt)} tokens, more than data.max_prompt_tokens="
                                        f"{self.max_prompt_tokens}; shorten it or raise it",
                                   code="context_length_exceeded")
        else:
            extends = call.prompt.startswith(session.text)
            if not extends and self.history == "strict":
                raise GatewayError(400, "the prompt does not extend the previous prompt and the completion returned "
                                        "for it. Relax trains on token sequences: with roles.rollout.agent.history="
                                        "strict each call of a trajectory must send the text so far unchanged, then "
                                        "new text", code="history_edited")
            if session.calls >= limits.max_turns:
                self._end(session, f"the trajectory has used its {limits.max_turns} model calls "
                                   "(roles.rollout.agent.max_turns); it is truncated here")
            if extends:
                new = call.prompt[len(session.text):]
                if session.stopped and new.startswith(session.stopped):
                    new = new[len(session.stopped):]
                context = list(self.tokenizer(new, add_special_tokens=False)["input_ids"]) if new else []
            else:
                self._branch(session, list(self.tokenizer(call.prompt, add_special_tokens=False)["input_ids"]),
                             "the prompt does not extend the previous prompt and completion")
            prompt = traj.prompt_ids
        session.mode = "text"
        generation = self._generate_turn(session, prompt, context, call.max_tokens)
        session.text = call.prompt + generation.text
        return self._reply(generation, generation.text, [], "stop" if generation.finished else "length",
                           len(traj.ids) - len(generation.response_ids), call.stream)

    def _generate_turn(self, session: _Session, prompt: list[int], context: list[int], asked: int | None,
                       constraint: tuple[str, Any] | None = None) -> Generation:
        """Generate the next turn after ``context`` within the budgets, and record both."""
        limits, traj = self.limits, session.traj
        left = limits.max_tokens - traj.spent_before - len(traj.response_ids) - len(context)
        budget = min(limits.max_new_tokens, left, asked or limits.max_new_tokens)
        if budget <= 0:
            self._end(session, f"the trajectory has no tokens left of roles.rollout.agent.max_tokens="
                               f"{limits.max_tokens}; it is truncated here")
        if session.calls == 0:
            traj.prompt_ids = prompt
            self._segment_span(session)
        if session.mode is None:
            session.mode = "chat"
        traj.add_context(context)
        index = session.calls
        generation, version = session.context.run(self._generate, session, index, budget, constraint)
        session.calls += 1
        traj.add_model(generation.response_ids, generation.logprobs, version)
        traj.final_text = generation.text
        session.stopped = (self.tokenizer.decode(generation.response_ids[-1:], skip_special_tokens=False)
                           if generation.finished and generation.response_ids else None)
        return generation

    def _reply(self, generation: Generation, content: str | None, calls: list[tuple[str, str, dict[str, Any]]],
               finish: Any, prompt_tokens: int, stream: bool = True) -> Reply:
        ids = generation.response_ids
        pieces: list[str] | None = None
        # Cut at tokens for streaming, when decoding allows it (a decode per token: only for a stream).
        if stream and content and content == generation.text:
            pieces, before = [], ""
            for n in range(1, len(ids) + 1):
                so_far = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
                if not so_far.startswith(before):
                    pieces = None
                    break
                pieces.append(so_far[len(before):])
                before = so_far
            if pieces is not None and "".join(pieces) != content:
                pieces = None
        return Reply(text=generation.text, content=content, calls=calls, finish=finish, token_ids=list(ids),
                     token_text=self._tokens, logprobs=[float(x) for x in generation.logprobs],
                     prompt_tokens=prompt_tokens, pieces=pieces)

    def _edit(self, session: _Session, messages: list[Message]) -> str | None:
        """Why a later call does not extend the previous call and its reply (None: it does)."""
        previous = session.history
        for i, old in enumerate(previous):
            if i >= len(messages) or not messages[i].same(old):
                what = "the assistant message this endpoint returned" if i == len(previous) - 1 else \
                    "the previous call's message"
                return f"message {i} {'is missing' if i >= len(messages) else 'differs'} from {what}"
        return None

    def _branch(self, session: _Session, prompt: list[int], why: str) -> None:
        """Start a new segment of the trajectory on ``prompt`` (the conversation rendered anew)."""
        limits, traj = self.limits, session.traj
        most = self.max_prompt_tokens + limits.max_tokens
        if len(prompt) > most:
            raise GatewayError(400, f"this call does not extend the conversation ({why}), so it starts a new "
                                    f"segment whose prompt is the whole conversation: {len(prompt)} tokens, more "
                                    f"than data.max_prompt_tokens + roles.rollout.agent.max_tokens = {most}",
                               code="context_length_exceeded")
        traj.new_segment(prompt, why)
        self._segment_span(session)

    def _segment_span(self, session: _Session) -> None:
        """The ``relax.agent.segment`` span where a segment starts, linked to its parent segment's."""
        if self.telemetry is None:
            return
        traj, parent = session.traj, session.segment_carrier

        def mark() -> None:
            with self.telemetry.span(AGENT_SEGMENT, links=[parent] if parent else (),
                                     trajectory=session.task.trajectory_id, segment=len(traj.segments),
                                     parent=len(traj.segments) - 1 if traj.segments else None,
                                     prompt_tokens=len(traj.prompt_ids)) as span:
                session.segment_carrier = span.carrier()

        session.context.run(mark)

    def _end(self, session: _Session, why: str) -> None:
        session.traj.truncated = True
        session.ended = why
        raise GatewayError(400, why, code="trajectory_ended")

    def _generate(self, session: _Session, index: int, budget: int, constraint: tuple[str, Any] | None = None
                  ) -> tuple[Generation, int]:
        """One model turn through the batcher, in an ``AGENT_TURN`` span."""
        traj, batcher = session.traj, session.batcher
        span_cm = NULL_SPAN if self.telemetry is None else self.telemetry.span(
            AGENT_TURN, trajectory=session.task.trajectory_id, turn=index)
        started = time.perf_counter()
        with span_cm as span:
            if session.outside:
                batcher.outside(-1)
                session.outside = False
            try:
                grammar_text, structured = constraint or (None, None)
                generation = batcher.request(TokenPrompt(traj.ids, [], budget, grammar_text, structured), id(session))
            except BackendFailure as exc:
                session.failure = exc
                raise GatewayError(503, f"the rollout backend failed: {exc}", kind="server_error",
                                   code="backend_failure") from exc
            finally:
                batcher.returning(id(session))  # it reads the reply and most often calls again at once
                session.model_s += time.perf_counter() - started
            version = int(self.version())
            span.set(tokens=len(generation.response_ids), policy_version=version)
        return generation, version

    def _tokens(self, ids: list[int]) -> list[str]:
        """Each token's text, as ``decode`` gives it for that token alone (one batched call)."""
        return list(self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False))


def _metadata_reward(body: Any) -> float | None:
    """The turn reward a request reports in ``metadata["relax.turn_reward"]``, or None."""
    metadata = body.get("metadata") if isinstance(body, dict) else None
    if not isinstance(metadata, dict) or TURN_REWARD_KEY not in metadata:
        return None
    return _reward_value(metadata[TURN_REWARD_KEY], f"metadata.{TURN_REWARD_KEY}")


def _reward_value(value: Any, param: str) -> float:
    """A reported reward as a finite float (OpenAI's metadata values are strings: ``"0.5"`` is read
    as 0.5); anything else is the request's mistake (400)."""
    try:
        reward = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        reward = math.nan
    if not math.isfinite(reward):
        raise GatewayError(400, f"{param}={value!r} is not a reward: give a finite number (or its text)",
                           param=param, code="invalid_turn_reward")
    return reward


def _developer_role(chat: ChatTokens) -> str:
    """The role a ``developer`` message is rendered with: ``developer`` when the model's template
    renders it, else ``system`` (what OpenAI's own models do for a developer message)."""
    probe = "relax-developer-probe"
    try:
        if probe in chat.render([{"role": "developer", "content": probe}, {"role": "user", "content": "q"}],
                                generation_prompt=True):
            return "developer"
    except Exception:  # the template refuses the role (raise_exception) or cannot render it
        pass
    return "system"


async def _awaited(awaitable: Any) -> Any:
    """A plain program's awaitable result, awaited (``asyncio.run`` takes a coroutine)."""
    return await awaitable
