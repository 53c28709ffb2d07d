"""Agentic rollouts: multi-turn, tool-using trajectories (docs/agents.md).

A trajectory is one sample: the data row's prompt, then model turns and the environment's (or the
agent program's) observations, kept as the exact token sequence the model read and wrote. The parts:

- ``tool_calls``: how tool calls are written in a model turn and parsed from it;
- ``chat``: the chat template's tokens around each message, appended without re-tokenizing history;
- ``trajectory``: one trajectory's tokens, masks, log-probs and versions, and its record on the bus;
- ``calls``: environment calls with a time limit and a concurrency bound;
- ``outcomes``: how a trajectory ended (ok, truncated, tool_error, or an infrastructure failure kept
  out of training) and the stop when infrastructure failures pass a share;
- ``runner``: runs a unit's trajectories side by side, batching the generate calls of those that
  wait for the model;
- ``gateway``: the OpenAI-compatible endpoint an agent program drives the policy through;
  ``programs`` how a program is loaded and its end told back, ``gateway_http`` the server and
  in-process clients, ``program_processes`` the worker processes programs may run in.

Only ``runner`` and ``gateway`` touch a rollout backend; nothing here imports torch at module level.
"""
