"""The tiny omni preset end to end, and what the bus holds for a multimodal step.

The run uses the real runtime (Ray, the TransferQueue bus, the role workers) with all three
modalities in every step; the bus test puts a real rollout's step on a real bus and reads it back
as the actor does: the columns hold token tensors and media references, never decoded media, and
the trainer's log-probs recomputed from what it read match the rollout's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax.testing import local_ray, tiny_run, tiny_spec

STEPS = 30
#: Steps averaged at the start and at the end of the run when comparing rewards (measured: about
#: 0.21 over the first 5 steps, 0.72 over the last 10).
FIRST, LAST = 5, 10


def test_the_omni_preset_trains_on_all_three_modalities_and_reward_rises(tmp_path):
    media_dir = tmp_path / "media"
    with local_ray():
        code, rows, printed = tiny_run(tmp_path, "omni", f"trainer.steps={STEPS}",
                                       f"data.train.options.media_dir={media_dir}", preset="tiny-omni-cpu")
    assert code == 0, printed
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Every kind of medium went through the run (the data set wrote the files the run asked for).
    suffixes = {p.suffix for p in media_dir.rglob("*") if p.is_file()}
    assert {".png", ".wav", ".npy"} <= suffixes
    assert all(r["data/skipped_samples"] == 0 for r in rows)
    first = sum(r["reward/mean"] for r in rows[:FIRST]) / FIRST
    last = sum(r["reward/mean"] for r in rows[-LAST:]) / LAST
    assert last > first + 0.2, f"reward did not rise: {first:.3f} over the first {FIRST} steps, {last:.3f} over the last {LAST}"


def test_a_step_on_the_bus_holds_references_and_trains_on_the_same_inputs(tmp_path):
    from relax.bus import Bus, RowMeta
    from relax.media import MediaSet, loads_context
    from relax.registry import get_registry
    from relax.plan.contexts import rollout_context, trainer_context
    from relax.runtime.model_files import materialize_model
    from relax.runtime.worker.components import build_dataset, build_loss
    from relax.runtime.worker.data import prompt_rows
    from relax.algo.batch import TrainBatch
    from relax.roles import TRAIN_COLUMNS
    from relax.runtime.worker.rows import media_columns, rollout_columns

    spec, _, base = tiny_spec(tmp_path, "omni-bus", "algorithm.prompts_per_step=3", "algorithm.samples_per_prompt=2",
                              f"data.train.options.media_dir={tmp_path / 'media'}", preset="tiny-omni-cpu")
    path = materialize_model(spec, base)
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, path))
    trainer = registry.load("trainer", "torch")(registry.build_config("trainer", "torch", {}),
                                                trainer_context(spec, "actor", path, loss=build_loss(spec)))
    media = MediaSet.from_spec(spec, base, tmp_path / "spill")
    rows = prompt_rows(build_dataset(spec, base), [0, 1, 2], "prompt", "answer", media=media)
    assert [loads_context(r["media"])[1][0].modality for r in rows] == ["image", "audio", "video"]
    gens = rollout.generate([r["prompt"] for r in rows], 2, spec.roles.rollout.sampling, seed=1,
                            media=[loads_context(r["media"])[1] for r in rows])
    columns = rollout_columns(gens, [r["prompt"] for r in rows], [r["label"] for r in rows], rollout.pad_token_id,
                              [r["media"] for r in rows])
    columns["advantages"] = torch.linspace(-1, 1, len(gens))
    decoded = sum(media.load(ref).data.__sizeof__() if not hasattr(media.load(ref).data, "nbytes")
                  else media.load(ref).data.nbytes for r in rows for ref in loads_context(r["media"])[1])
    with local_ray():
        bus = Bus.start()
        try:
            bus.put("step-0", columns, [RowMeta(policy_version=0, sample_id=f"s{i}") for i in range(len(gens))])
            read = bus.get("step-0", [*TRAIN_COLUMNS, *media_columns(spec)], task="actor", batch_size=len(gens),
                           timeout_s=60)
        finally:
            bus.close()
    fields = read.fields
    tensor_bytes = 0
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):  # rows x token columns at most: no pixels, no waveforms
            assert value.shape[0] == len(gens) and value.ndim <= 2, name
            tensor_bytes += value.numel() * value.element_size()
    contexts = fields["media"]
    assert all(isinstance(c, str) for c in contexts)
    media_bytes = sum(len(c) for c in contexts)
    assert media_bytes + tensor_bytes < decoded  # the whole step is smaller than its decoded media
    for context in contexts:
        ref = json.loads(context)["refs"][0]
        assert Path(ref["path"]).is_file() and len(ref["sha256"]) == 64
    batch = TrainBatch.from_bus(read)
    logprobs = trainer.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item() < 1e-4
    metrics = trainer.train_step(batch)
    assert metrics["updates"] == 1.0 and torch.isfinite(torch.tensor(metrics["loss"]))


def bad_audio_data(folder: Path) -> Path:
    """Six audio questions; sample 2 points at a truncated WAV file, sample 4 holds an empty inline
    clip (inline items are only checked when the run reads them)."""
    import wave

    import numpy as np

    folder.mkdir()
    t = np.arange(8000) / 16000
    with wave.open(str(folder / "tone.wav"), "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16000)
        clip.writeframes((0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes())
    whole = (folder / "tone.wav").read_bytes()
    (folder / "cut.wav").write_bytes(whole[: len(whole) // 2])
    lines = [{"prompt": "Higher tone?", "answer": "first", "audio": "tone.wav"} for _ in range(6)]
    lines[2]["audio"] = "cut.wav"
    lines[4]["audio"] = []
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return data


def bad_audio_overrides(data: Path, policy: str) -> list[str]:
    return [f"data.train={{source: '{data}'}}", "data.shuffle=false", "data.media_keys={audio: audio}",
            "data.media_options={audio: {sample_rate: 16000, max_seconds: 5.0}}", f"data.on_bad_sample={policy}",
            "model.modalities=[text, audio]", "trainer.steps=2", "algorithm.prompts_per_step=3",
            "algorithm.samples_per_prompt=2", "roles.actor.micro_batch_size=6"]


def test_bad_media_under_error_is_refused_at_validation_or_stops_the_run(tmp_path, capsys):
    from relax.spec import SpecError

    data = bad_audio_data(tmp_path / "data")
    overrides = bad_audio_overrides(data, "error")
    # The truncated file is named by the data file: validation reports it with its sample and column.
    with pytest.raises(SpecError, match=r"sample 2, column 'audio'.*truncated WAV"):
        tiny_spec(tmp_path, "bad", *overrides, preset="tiny-omni-cpu")
    # Without it, the empty inline clip of sample 4 stops the run when the rollout reads it.
    lines = data.read_text().splitlines()
    lines[2] = lines[0]
    data.write_text("\n".join(lines) + "\n")
    with local_ray():
        code, rows, _ = tiny_run(tmp_path, "bad", *overrides, preset="tiny-omni-cpu")
    assert code == 1
    assert "sample 4, column 'audio'" in capsys.readouterr().err
    assert len(rows) <= 1  # step 1 (rows 0-2) may finish; step 2 never trains


def test_bad_media_under_skip_are_replaced_and_counted(tmp_path):
    data = bad_audio_data(tmp_path / "data")
    with local_ray():
        code, rows, printed = tiny_run(tmp_path, "skip", *bad_audio_overrides(data, "skip"), preset="tiny-omni-cpu")
    assert code == 0, printed
    # Step 1 reads rows 0-2 (2 is replaced by 3), step 2 rows 3-5 (4 is replaced by 5).
    assert [r["data/skipped_samples"] for r in rows] == [1, 1]
