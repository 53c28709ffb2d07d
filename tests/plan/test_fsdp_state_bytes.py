"""The plan counts an FSDP2 role's state in the dtype the torch trainer really holds it in: the
trainer is built (one rank, CPU, in a process of its own: a process group must not outlive a test in
pytest's), trains a step, and its shards and Adam state are weighed against ``fsdp_state_bytes``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from relax.plan.memory import fsdp_state_bytes

WEIGH = """
import json, sys
from pathlib import Path
import torch
from relax import testing
from relax.runtime.model_files import materialize_model
from relax.runtime.worker.components import build_trainer

held = {}
for dtype in sys.argv[2:]:
    spec, _, base = testing.tiny_spec(Path(sys.argv[1]), dtype, f"model.dtype={dtype}", preset="tiny-fsdp-cpu")
    trainer = build_trainer(spec, materialize_model(spec, base), 1)
    trainer.train_step(testing.sample_train_batch(rows=4))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    local = [getattr(p, "to_local", lambda p=p: p)() for p in params]
    count = sum(t.numel() for t in local)
    state = [v for p in params for k, v in trainer.optimizer.state[p].items() if k != "step"]
    held[dtype] = {"sharded": all(hasattr(p, "to_local") for p in params),
                   "weights": sum(t.numel() * t.element_size() for t in local) / count,
                   "optimizer": sum(t.numel() * t.element_size() for t in state) / count}
print(json.dumps(held))
"""

DTYPES = ("bfloat16", "float32")


def test_the_plan_counts_the_dtype_the_fsdp_trainer_holds(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", WEIGH, str(tmp_path), *DTYPES], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    held = json.loads(done.stdout.strip().splitlines()[-1])
    for dtype in DTYPES:
        assert held[dtype]["sharded"]
        weights, _, optimizer = fsdp_state_bytes(dtype, "adamw")
        assert (held[dtype]["weights"], held[dtype]["optimizer"]) == (weights, optimizer), dtype
