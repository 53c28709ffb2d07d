"""What the bus raises.

Every error names the partition, task and fields involved, so a stuck or failing role can be
diagnosed from its log line alone, without attaching a debugger to a Ray actor.
"""

from __future__ import annotations


class BusError(RuntimeError):
    """The bus was used wrongly or TransferQueue is not in a usable state; the message says how to fix it."""


class BusTimeout(BusError, TimeoutError):
    """``Bus.get`` waited ``timeout_s`` without enough ready rows.

    Also a ``TimeoutError``, so callers that already handle timeouts generically keep working.
    The counts are kept as attributes so a watchdog can report them without parsing the message.
    """

    def __init__(
        self,
        *,
        partition: str,
        task: str,
        fields: list[str],
        wanted: int,
        ready: int,
        rows: int,
        consumed: int,
        missing_fields: list[str],
        timeout_s: float,
    ) -> None:
        self.partition = partition
        self.task = task
        self.fields = fields
        self.wanted = wanted
        self.ready = ready
        self.rows = rows
        self.consumed = consumed
        self.missing_fields = missing_fields
        self.timeout_s = timeout_s
        detail = f"the partition holds {rows} rows, {consumed} already taken by task {task!r}"
        if missing_fields:
            detail += f"; no row has been written with field(s) {missing_fields} yet"
        super().__init__(
            f"bus get timed out after {timeout_s:g}s: task {task!r} wanted {wanted} rows of partition "
            f"{partition!r} with fields {fields}, but only {ready} were ready ({detail})"
        )
