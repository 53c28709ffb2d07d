"""LoRA in the torch trainer and the hf rollout (``roles.actor.lora``): a step equals a hand-built
peft model's, only the adapter trains and syncs, the rollout's log-probs follow a sync, the
reference is the base with the adapter disabled, checkpoints resume exactly and an export loads
with peft."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from relax.algo.batch import collate, token_logprobs
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.registry import get_registry

PROMPTS = ["3+4=", "12+7=", "5=", "9+9+1="]
N = 3
LORA = {"rank": 2, "alpha": 4.0}


def _rollout(spec, path):
    registry = get_registry()
    return registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}), rollout_context(spec, path))


def _trainer(spec, path, role="actor", **options):
    registry = get_registry()
    loss_cls = registry.load("losses", "ppo_clip")
    loss = loss_cls(loss_cls.Config(), algorithm_context(spec))
    return registry.load("trainer", "torch")(registry.build_config("trainer", "torch", options),
                                             trainer_context(spec, role, path, loss=loss))


def _batch(gens, pad_id):
    return collate(gens, torch.linspace(-1.0, 1.0, len(gens)), pad_id, rewards=[0.0] * len(gens))


def _max_diff(batch, logprobs):
    mask = batch.response_mask.bool()
    return (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item()


@pytest.fixture(scope="module")
def spec(make_spec):
    # SGD at lr 1 without clipping: an update is exactly minus the gradient.
    return make_spec({"roles.actor.lora": LORA, "roles.actor.optimizer": {"name": "sgd", "lr": 1.0, "grad_clip": 0.0}})


@pytest.fixture(scope="module")
def rollout(spec, tiny_model_path):
    return _rollout(spec, tiny_model_path)


@pytest.fixture(scope="module")
def batch(spec, rollout):
    return _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=1), rollout.pad_token_id)


def test_a_lora_step_equals_a_hand_built_peft_models(spec, batch, tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from relax_plugins.lora import load_adapter

    trainer = _trainer(spec, tiny_model_path)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert len(held) == len(trainable)  # the optimizer holds the adapter alone
    before = trainer.weights()
    assert before and all(".lora_" in name and name.startswith("base_model.model.") for name in before)

    hand = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                          LoraConfig(r=2, lora_alpha=4.0, lora_dropout=0.0, target_modules="all-linear"))
    load_adapter(hand.get_base_model(), before)  # the trainer's random A (B is zero in both)
    logits = hand(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, use_cache=False).logits
    loss, _ = trainer.loss.compute(batch, token_logprobs(logits, batch.input_ids, trainer.temperature))
    loss.backward()
    expected = {name.replace(".default", "").replace("base_model.model.", "base_model.model.", 1): p.grad
                for name, p in hand.named_parameters() if p.requires_grad}

    metrics = trainer.train_step(batch)
    after = trainer.weights()
    grads = {name: (before[name] - after[name] - grad).abs().max().item()  # the step = lr * grad, lr 1
             for name, grad in expected.items()}
    print(f"lora step against hand-built peft: loss {abs(metrics['loss'] - loss.item()):.1e} apart, adapter "
          f"gradients {max(grads.values()):.1e} ({len(grads)} tensors)")
    assert abs(metrics["loss"] - loss.item()) < 1e-5
    assert max(grads.values()) < 1e-5, grads
    assert sum(int(grad.abs().sum() > 0) for grad in expected.values()) > 0  # B got a gradient: not zeros compared


def test_only_the_adapter_changes_and_syncs(spec, rollout, batch, tiny_model_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(spec, tiny_model_path)
    base = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict().items()}
    trainer.train_step(batch)
    state = trainer.model.state_dict()
    for name, value in base.items():
        held = state.get(name, state.get(name.replace(".weight", ".base_layer.weight")))
        assert torch.equal(held, value), name
    sync = sum(t.numel() * t.element_size() for t in trainer.weights().values())
    full = sum(t.numel() * t.element_size() for t in base.values())
    print(f"lora sync bytes: {sync:,} against the model's {full:,} ({sync / full:.1%})")
    assert sync == trainer.adapter.sync_bytes() and sync < 0.05 * full


def test_rollout_logprobs_follow_an_adapter_sync(spec, rollout, batch, tiny_model_path):
    trainer = _trainer(spec, tiny_model_path)
    assert _max_diff(batch, trainer.compute_logprobs(batch)) < 1e-5  # B = 0: both are the base
    trainer.train_step(batch)
    assert _max_diff(batch, trainer.compute_logprobs(batch)) > 1e-3  # the policy moved
    rollout.load_weights(trainer.weights(), version=1)
    fresh = _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=2), rollout.pad_token_id)
    synced = _max_diff(fresh, trainer.compute_logprobs(fresh))
    print(f"hf rollout log-probs after an adapter sync: {synced:.1e} from the trainer's")
    assert synced < 1e-4
    with pytest.raises(ValueError, match="do not match"):
        rollout.load_weights({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 4)}, version=2)


def test_the_reference_is_the_base_with_the_adapter_disabled(spec, make_spec, batch, tiny_model_path):
    trainer = _trainer(spec, tiny_model_path)
    with_reference = make_spec({"roles.actor.lora": LORA, "roles.reference": {"backend": "torch"},
                                "algorithm.kl_coef": 0.1})
    reference = _trainer(with_reference, tiny_model_path, role="reference")  # a base model of its own, to compare
    assert reference.adapter is None
    trainer.train_step(batch)
    base = trainer.compute_base_logprobs(batch)
    mask = batch.response_mask.bool()
    assert (base[mask] - reference.compute_logprobs(batch)[mask]).abs().max().item() < 1e-5
    assert (trainer.compute_logprobs(batch)[mask] - base[mask]).abs().max().item() > 1e-3  # adapter back on


def test_a_checkpoint_holds_the_adapter_and_resumes_exactly(spec, rollout, tiny_model_path, tmp_path):
    sampling = spec.roles.rollout.sampling
    first = _batch(rollout.generate(PROMPTS, N, sampling, seed=7), rollout.pad_token_id)
    second = _batch(rollout.generate(PROMPTS, N, sampling, seed=8), rollout.pad_token_id)
    trainer = _trainer(spec, tiny_model_path)
    trainer.train_step(first)
    trainer.save(str(tmp_path / "ckpt"))
    trainer.train_step(second)
    continued = trainer.weights()
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files

    restored = _trainer(spec, tiny_model_path)
    restored.load(str(tmp_path / "ckpt"))
    assert restored.version == 1
    restored.train_step(second)
    for key, value in restored.weights().items():
        assert torch.equal(value, continued[key]), key


def test_an_adapter_arrives_over_a_weight_group_too(spec, batch, tiny_model_path):
    import threading

    from relax.weight_group import WeightSender

    rollout, trainer = _rollout(spec, tiny_model_path), _trainer(spec, tiny_model_path)
    sender = WeightSender(rollout.weight_group_ranks, timeout_s=60, host="127.0.0.1")
    rollout.join_weight_group(sender.address.as_dict())
    try:
        trainer.train_step(batch)
        thread = threading.Thread(target=sender.send, args=(trainer.weights(), 1), daemon=True)
        thread.start()
        assert rollout.receive_weights() == 1
        thread.join(timeout=60)
        fresh = _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=3), rollout.pad_token_id)
        assert _max_diff(fresh, trainer.compute_logprobs(fresh)) < 1e-4
    finally:
        rollout.close_weight_group()
        sender.close()


def test_an_export_is_the_peft_adapter_and_merged_model_with_the_trained_logprobs(make_spec, batch, tiny_model_path,
                                                                                   tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from relax.runtime.checkpoint import export_model

    spec = make_spec({"roles.actor.lora": {**LORA, "export_merged": True}})
    trainer = _trainer(spec, tiny_model_path)
    trainer.train_step(batch)
    folder = export_model(tmp_path, 1, trainer)
    files = sorted(p.name for p in folder.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= set(files)
    assert "optimizer.pt" not in files and "trainer_state.json" not in files
    mask = batch.response_mask.bool()
    trained = trainer.compute_logprobs(batch)[mask]
    for model in (PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(folder)),
                  AutoModelForCausalLM.from_pretrained(str(folder / "merged"))):
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, use_cache=False).logits
        apart = (token_logprobs(logits, batch.input_ids, trainer.temperature)[mask] - trained).abs().max().item()
        print(f"export ({type(model).__name__}) log-probs: {apart:.1e} from the trained policy's")
        assert apart < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(str(folder / "merged")).state_dict()
    assert not any(".lora_" in k for k in merged)
    # Merged bucket by bucket (how a sharded trainer exports) is peft's merge_and_unload.
    streamed = {name: t for bucket in trainer.adapter.merged(trainer.extractor(bucket_bytes=4096).buckets())
                for name, t in bucket}
    assert set(streamed) == set(merged)
    assert max((streamed[k] - merged[k]).abs().max().item() for k in merged) < 1e-6


def test_a_colocated_rollout_generates_with_the_lora_trainers_model(spec, batch, tiny_model_path):
    from relax_plugins.lora import adapter_tensors

    trainer = _trainer(spec, tiny_model_path)
    rollout = _rollout(spec, tiny_model_path)
    assert rollout.adopt_model(trainer.shareable_model())
    trainer.train_step(batch)  # no sync: the rollout holds the trainer's model, adapter attached
    assert adapter_tensors(rollout.model).keys() == trainer.weights().keys()
    fresh = _batch(rollout.generate(PROMPTS, N, spec.roles.rollout.sampling, seed=4), rollout.pad_token_id)
    assert _max_diff(fresh, trainer.compute_logprobs(fresh)) < 1e-5


@pytest.mark.fsdp
def test_under_fsdp2_a_lora_step_equals_one_process_and_its_checkpoint_and_export_are_the_adapters(tiny_model_path,
                                                                                                      tmp_path):
    """2 ranks on CPU (gloo), the model sharded by FSDP2 with the adapter attached: loss, grad norm
    and adapter after 3 steps equal one unsharded process's; the checkpoint holds PEFT's adapter
    folder and a sharded state of the adapter and its optimizer state alone (no shard of the frozen
    base), which resumes to the same step-3 loss; the merged export, gathered over the ranks, loads
    with transformers and gives the trained policy's log-probs."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from relax_plugins.lora import is_adapter_name
    from tests.plugins import test_fsdp as fsdp

    raw = fsdp._raw(tiny_model_path, lr=1e-3)  # Adam at 1e-2 turns round-off of near-zero gradients into ~1e-5 of weight
    raw["roles"]["actor"]["lora"] = {**LORA, "export_merged": True}
    case = {"name": "lora", "raw": raw, "batch": fsdp._lm_batch(tiny_model_path, tmp_path, "lora"), "checkpoint": True,
            "export": True}
    sharded = fsdp._spawn([case], tmp_path)["lora"]
    diffs = fsdp._differences(case, sharded)
    assert max(diffs.values()) < 1e-5, diffs
    assert all(".lora_" in name for name in sharded["weights"])
    resumed = {k: abs(sharded["resumed"][k] - sharded["results"][-1][k]) for k in ("loss", "grad_norm")}
    assert max(resumed.values()) < 1e-5, resumed
    folder = tmp_path / "lora-ckpt"
    files = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "sharded"} <= files
    assert not any(name.startswith("model") for name in files)  # no full Hugging Face model beside it

    # The sharded state: the adapter's tensors and their AdamW state, nothing of the frozen base.
    metadata = dcp.FileSystemReader(str(folder / "sharded")).read_metadata().state_dict_metadata
    keys = list(metadata)
    model_keys = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    assert model_keys and all(is_adapter_name(k) for k in model_keys), model_keys[:5]
    assert len(model_keys) == len(sharded["weights"])
    assert {k.split(".", 2)[1] for k in keys if k.startswith("optimizer.")} <= {"state", "param_groups"}
    assert all(is_adapter_name(k) for k in keys if k.startswith("optimizer.state."))
    # Its tensors: the adapter and two AdamW moments, against the frozen base's bytes.
    state_bytes = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in metadata.values() if hasattr(m, "size"))
    model_bytes = sum(p.stat().st_size for p in Path(tiny_model_path).glob("*.safetensors"))
    files_bytes = sum(p.stat().st_size for p in (folder / "sharded").iterdir())
    adapter_bytes = sum(t.numel() * t.element_size() for t in sharded["weights"].values())
    assert 3 * adapter_bytes <= state_bytes < 3 * adapter_bytes + 4096 and state_bytes < 0.15 * model_bytes

    # The merged export: plain transformers weights, the trained policy's log-probs.
    batch = torch.load(case["batch"], weights_only=False)
    policy = fsdp._trainer(raw, {})
    policy.load_weights(sharded["weights"], version=3)
    trained = policy.compute_logprobs(batch)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lora-merged"), dtype=torch.float32).eval()
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    with torch.no_grad():
        logits = merged(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids, use_cache=False).logits
    mask = batch.response_mask.bool()
    export_diff = (token_logprobs(logits, batch.input_ids)[mask] - trained[mask]).abs().max().item()
    moved = (fsdp._trainer(raw, {}).compute_logprobs(batch)[mask] - trained[mask]).abs().max()
    print(f"fsdp lora: step differences {diffs}, resume {resumed}, sharded state tensors {state_bytes} bytes "
          f"(adapter {adapter_bytes}) against the model's {model_bytes}, files {files_bytes}, merged export "
          f"log-probs {export_diff:.2e} (policy moved {moved.item():.2e})")
    assert export_diff < 1e-5 and moved.item() > 1e-4


@pytest.mark.fsdp
def test_a_run_with_a_sharded_lora_actor_exports_the_adapter_and_the_merged_model(tmp_path):
    """``relax run tiny-lora-cpu`` with the actor on 2 CPU ranks under FSDP2 (real Ray, gloo): the
    export holds PEFT's adapter and ``merged/`` (every rank gathered it, rank 0 wrote), no training
    state; both give the same log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from relax import testing
    from relax.runtime.model_files import materialize_path

    with testing.local_ray():
        code, rows, printed = testing.tiny_run(tmp_path, "lora", "trainer.steps=2", "trainer.export_every=2",
                                               "roles.actor.cpu_ranks=2", "roles.actor.options.fsdp.enabled=true",
                                               "roles.actor.lora.export_merged=true", preset="tiny-lora-cpu")
    assert code == 0, printed
    exported = tmp_path / "lora" / "export" / "step-2"
    files = {p.name for p in exported.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= files
    assert not files & {"sharded", "optimizer.pt", "trainer_state.json"}, files
    base = Path(materialize_path("builtin:tiny-lm", {}, Path.cwd()))
    ids = torch.tensor([[3, 7, 11, 5, 2, 9, 4, 8]])
    logprobs = []
    for model in (PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(exported)),
                  AutoModelForCausalLM.from_pretrained(str(exported / "merged"))):
        with torch.no_grad():
            logprobs.append(torch.log_softmax(model.eval()(input_ids=ids).logits.float(), -1))
    assert (logprobs[0] - logprobs[1]).abs().max().item() < 1e-5
