"""TransferQueue (and tensordict), imported the way the bus needs them: every module of
``relax.bus`` imports them from here, so these settings hold wherever they are first imported.

- ``TQ_NUM_THREADS``: TransferQueue reads it once, at import, and warns on every put and get when
  it exceeds the physical cores (8 by default; our development machines have 2).
- Its dependency tensordict marks a few helpers for ``torch.compile`` at import time
  (``torch.compiler.allow_in_graph``, ``assume_constant_result``), which imports all of
  ``torch._dynamo``: about a second of CPU in every process that reaches the bus, on the start-up
  path of every worker. Nothing in Relax compiles tensordict code, so during that import the two
  marks leave the helpers as they are; they are restored right after, and code that compiles its
  own functions later is unaffected.
"""

from __future__ import annotations

import os

import psutil
import torch.compiler

os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))

_marks = (torch.compiler.allow_in_graph, torch.compiler.assume_constant_result)
torch.compiler.allow_in_graph = torch.compiler.assume_constant_result = lambda fn: fn
try:
    import transfer_queue
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack
    from transfer_queue import BatchMeta, TransferQueueClient
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory
finally:
    torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = _marks

__all__ = ["BatchMeta", "NonTensorStack", "StorageBootstrapProvider", "StorageManager", "StorageManagerFactory",
           "TensorDict", "TransferQueueClient", "transfer_queue"]
