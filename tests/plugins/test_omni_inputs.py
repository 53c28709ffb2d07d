"""Rollout and trainer build identical model inputs for the same multimodal sample, per modality.

Both the ``hf`` rollout and the ``torch`` trainer go through ``relax_plugins.processing`` from the
sample's media references; these tests check the consequences on the real backends and the tiny
omni model: the same token ids (placeholders expanded), the same media tensors, log-probs that
agree to float32 round-off, references (not media) in the bus columns, and a loud failure when a
medium changes or the trainer would see other tokens than the rollout did."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from relax.spec import validate_spec  # before relax.registry (import order of the package)
from relax.algo.batch import TrainBatch
from relax.contracts import PluginKind
from relax.plan.contexts import algorithm_context, rollout_context, trainer_context
from relax.media import MediaError, MediaSet, dumps_context, loads_context
from relax.registry import get_registry
from relax.runtime.worker.rows import rollout_columns
from relax_plugins.datasets.omni import PROMPTS, encode_media, omni_problem
from relax_plugins.processing import batch_media, encode_sample

KEYS = {"image": "image", "audio": "audio", "video": "video"}
N = 3
#: Processor outputs of each modality (besides the token ids).
TENSORS = {"image": {"pixel_values", "image_grid_thw"},
           "audio": {"input_features", "feature_attention_mask"},
           "video": {"pixel_values_videos", "video_grid_thw", "video_second_per_grid"}}


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory):
    """A tiny-omni folder with random weights (no warm-up: inputs, not answers, are tested)."""
    cls = get_registry().load(PluginKind.models, "tiny-omni")
    return cls(cls.Config(warmup_steps=0, warmup_pool=3)).materialize(str(tmp_path_factory.mktemp("omni-cache")))


@pytest.fixture(scope="module")
def spec(omni_path):
    return validate_spec({
        "name": "omni-inputs",
        "model": {"path": omni_path, "modalities": ["text", "image", "audio", "video"]},
        "data": {"train": {"source": "synthetic:omni"}, "media_keys": KEYS, "max_prompt_tokens": 128,
                 "media_options": {"video": {"fps": 2.0, "max_frames": 8}}},
        "roles": {"rollout": {"backend": "hf", "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                            "max_new_tokens": 6}},
                  "actor": {"backend": "torch", "micro_batch_size": 4, "optimizer": {"lr": 1e-3}}},
        "tracing": {"exporter": "none"},
    })


@pytest.fixture(scope="module")
def backends(spec, omni_path):
    registry = get_registry()
    rollout = registry.load("rollout", "hf")(registry.build_config("rollout", "hf", {}),
                                             rollout_context(spec, omni_path))
    loss_cls = registry.load("losses", "ppo_clip")
    trainer = registry.load("trainer", "torch")(
        registry.build_config("trainer", "torch", {}),
        trainer_context(spec, "actor", omni_path, loss=loss_cls(loss_cls.Config(), algorithm_context(spec))))
    return rollout, trainer


def sample_of(kind: str, folder, seed: int = 0) -> tuple[str, dict]:
    """A data row of one kind with its media written as a file."""
    import random

    problem = omni_problem(random.Random(f"inputs:{kind}:{seed}"), kind)
    data, suffix = encode_media(kind, problem["media"])
    path = folder / f"{kind}-{seed}{suffix}"
    path.write_bytes(data)
    return problem["prompt"], {kind: str(path)}


def roll(spec, rollout, prompt, refs):
    """The rollout's generations and bus columns for one sample (N responses)."""
    gens = rollout.generate([prompt], N, spec.roles.rollout.sampling, seed=3, media=[refs])
    columns = rollout_columns(gens, [prompt], ["x"], rollout.pad_token_id, [dumps_context(prompt, refs)])
    return gens, columns


@pytest.mark.parametrize("kind", ["image", "audio", "video"])
def test_rollout_and_trainer_build_the_same_inputs(spec, backends, tmp_path, kind):
    rollout, trainer = backends
    media = MediaSet.from_spec(spec, spill_dir=tmp_path)
    prompt, row = sample_of(kind, tmp_path)
    refs = media.refs(row, 0)
    gens, columns = roll(spec, rollout, prompt, refs)
    batch = TrainBatch.from_columns(columns, [0] * len(gens))
    inputs = trainer.model_inputs(batch)

    # The same token ids: the trainer's prompt part is what the rollout generated from, with the
    # placeholders expanded (one per media token of the processor).
    direct = encode_sample(rollout.encoder.processor, media, prompt, refs)
    prompt_part = batch.attention_mask.bool() & ~batch.response_mask.bool()
    placeholder = {"image": "<|image_pad|>", "audio": "<|audio_pad|>", "video": "<|video_pad|>"}[kind]
    placeholder_id = rollout.tokenizer.convert_tokens_to_ids(placeholder)
    for i, g in enumerate(gens):
        assert g.prompt_ids == direct.prompt_ids == inputs["input_ids"][i][prompt_part[i]].tolist()
        assert direct.prompt_ids.count(placeholder_id) >= 1
    # The same media tensors, once per row.
    assert set(inputs) - {"input_ids", "attention_mask"} == TENSORS[kind]
    expected = batch_media([direct] * N)
    for key in TENSORS[kind]:
        assert torch.equal(inputs[key], expected[key]), key
    # Hence the same distribution: the recomputed log-probs equal the behaviour log-probs.
    logprobs = trainer.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    assert mask.any()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item() < 1e-4


def test_a_mixed_batch_of_all_three_modalities_matches_too(spec, backends, tmp_path):
    rollout, trainer = backends
    media = MediaSet.from_spec(spec, spill_dir=tmp_path)
    prompts, refs = [], []
    for i, kind in enumerate(("image", "audio", "video")):
        prompt, row = sample_of(kind, tmp_path, seed=10 + i)
        prompts.append(prompt)
        refs.append(media.refs(row, i))
    prompts.append("Plain text?")
    refs.append([])
    gens = rollout.generate(prompts, 2, spec.roles.rollout.sampling, seed=5, media=refs)
    columns = rollout_columns(gens, prompts, ["x"] * 4, rollout.pad_token_id,
                              [dumps_context(p, r) for p, r in zip(prompts, refs)])
    batch = TrainBatch.from_columns(columns, [0] * len(gens))
    logprobs = trainer.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item() < 1e-4
    # A micro-batch keeps its rows' media (select keeps the contexts aligned with the rows).
    part = batch.select([2, 3]).trim()
    assert part.media == batch.media[2:4] and loads_context(part.media[0])[1][0].modality == "audio"


@pytest.mark.parametrize("kind", ["image", "audio", "video"])
def test_the_bus_columns_carry_references_not_media(spec, backends, tmp_path, kind):
    rollout, _ = backends
    media = MediaSet.from_spec(spec, spill_dir=tmp_path)
    prompt, row = sample_of(kind, tmp_path)
    refs = media.refs(row, 0)
    gens, columns = roll(spec, rollout, prompt, refs)
    decoded = media.load(refs[0]).data
    decoded_bytes = np.asarray(decoded).nbytes
    assert set(columns) == {"prompt", "response", "label", "input_ids", "rollout_logprobs", "lengths", "media"}
    for name, value in columns.items():
        if isinstance(value, torch.Tensor):  # token tensors only: rows x columns, never pixels/samples
            assert value.shape[0] == N and value.ndim <= 2, name
    for cell in columns["media"]:
        assert isinstance(cell, str) and len(cell) < 600 < decoded_bytes
        context = json.loads(cell)
        assert context["prompt"] == prompt
        (ref,) = context["refs"]
        assert ref["path"] == row[kind] and len(ref["sha256"]) == 64 and ref["modality"] == kind


def test_a_medium_changed_after_the_rollout_is_caught_by_its_checksum(spec, backends, tmp_path):
    rollout, trainer = backends
    media = MediaSet.from_spec(spec, spill_dir=tmp_path)
    prompt, row = sample_of("image", tmp_path, seed=99)
    refs = media.refs(row, 0)
    gens, columns = roll(spec, rollout, prompt, refs)
    from PIL import Image

    Image.new("RGB", (32, 32), (0, 0, 0)).save(row["image"])  # same size, other pixels
    with pytest.raises(MediaError, match="changed since the sample was generated"):
        trainer.compute_logprobs(TrainBatch.from_columns(columns, [0] * N))


def test_the_trainer_refuses_tokens_the_rollout_did_not_generate_from(spec, backends, tmp_path):
    rollout, trainer = backends
    media = MediaSet.from_spec(spec, spill_dir=tmp_path)
    prompt, row = sample_of("video", tmp_path, seed=7)
    gens, columns = roll(spec, rollout, prompt, media.refs(row, 0))
    batch = TrainBatch.from_columns(columns, [0] * N)
    # A context naming another sample (an image question): its prompt tokens differ from the row's.
    swapped = TrainBatch(**{**batch.__dict__, "media": [dumps_context(PROMPTS["image"], media.refs(
        sample_of("image", tmp_path, seed=1)[1], 1))] * N})
    with pytest.raises(RuntimeError, match="rebuilt .* different ones"):
        trainer.compute_logprobs(swapped)


def test_a_multimodal_batch_without_its_media_column_is_refused_not_trained_text_only(spec, backends, tmp_path):
    rollout, trainer = backends
    media = MediaSet.from_spec(spec, spill_dir=tmp_path)
    prompt, row = sample_of("audio", tmp_path, seed=4)
    gens, columns = roll(spec, rollout, prompt, media.refs(row, 0))
    del columns["media"]  # what a runtime that dropped the media between rollout and training would hand over
    with pytest.raises(ValueError, match="no media contexts; the 'media' column did not reach the trainer"):
        trainer.compute_logprobs(TrainBatch.from_columns(columns, [0] * N))
