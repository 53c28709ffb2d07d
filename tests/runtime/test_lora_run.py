"""``relax run tiny-lora-cpu`` on a real local Ray: the adapter learns the task (reward <= 0.4 ->
>= 0.8), each weight sync moves the adapter alone (``weights/sync_bytes`` under 5% of the model's
bytes), the base model's files are untouched, the reference runs as the actor's base model with
the adapter disabled, the checkpoint holds only adapter tensors, and the run's export loads with
peft."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_the_tiny_lora_preset_learns_and_changes_only_its_adapter(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from relax.runtime.model_files import materialize_path

    base = Path(materialize_path("builtin:tiny-lm", {}, Path.cwd()))
    files = sorted(base.glob("*.safetensors"))
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    with testing.local_ray():
        code, rows, _ = testing.tiny_run(tmp_path, "lora", "trainer.steps=20", "trainer.export_every=20",
                                         "algorithm.kl_coef=0.001", "roles.reference.backend=torch",
                                         preset="tiny-lora-cpu")
    assert code == 0
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[:3]) / 3 <= 0.4, rewards[:3]
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards[-5:]

    full = sum(t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(base).state_dict().values())
    synced = {r["weights/sync_bytes"] for r in rows}
    print(f"tiny-lora-cpu: reward {rewards[0]:.2f} -> {rewards[-1]:.2f} (first 3 {sum(rewards[:3]) / 3:.2f}, last 5 "
          f"{sum(rewards[-5:]) / 5:.2f}), weights/sync_bytes {sorted(synced)} against the model's {full:,}")
    assert len(synced) == 1 and 0 < synced.pop() < 0.05 * full
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files} == before  # the base is frozen

    # The reference is the actor's base model with the adapter disabled, in the actor's worker: the KL
    # to it starts at 0 (a new adapter's B is zero) and grows as the adapter trains.
    workers = json.loads((tmp_path / "lora" / "workers.json").read_text())
    assert ["actor", "reference"] in [sorted(w["roles"]) for w in workers]
    kl = [r["train/kl"] for r in rows]
    assert abs(kl[0]) < 1e-6 and kl[-1] > 1e-4, kl

    adapter = load_file(str(tmp_path / "lora" / "checkpoints" / "step-20" / "trainer" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    exported = tmp_path / "lora" / "export" / "step-20"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(exported))
    assert any(".lora_B." in name and p.abs().sum() > 0 for name, p in model.named_parameters())  # B moved off 0

