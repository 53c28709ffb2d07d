"""The runtime: a plan executed on Ray, in rooms by the process that runs the code.

- ``driver/``: the process that started ``relax run``;
- ``state/``: the ``RunState`` actor;
- ``worker/``: each role worker's process.

The modules here, beside the rooms, are shared by more than one process (checkpoints, metrics rows,
samples, failure classes, the staleness rule, startup helpers, the model's files, the launch
message) and import no room.
"""
