"""The image, audio and video modality plugins: decoding, checks against the budgets, bad media
(corrupt, truncated, empty, missing) under both ``data.on_bad_sample`` policies, references with
checksums, and the validation of media files a data file names."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relax.spec import SpecError, validate_spec  # before relax.registry (import order of the package)
from relax.contracts import PluginKind
from relax.media import BadSample, MediaError, MediaSet, loads_context
from relax.registry import get_registry
from relax.runtime.worker.data import prompt_rows

KEYS = {"image": "image", "audio": "audio", "video": "video"}


def plugin(modality: str, **options):
    registry = get_registry()
    return registry.load(PluginKind.modalities, modality)(registry.build_config(PluginKind.modalities, modality, options))


def png(path: Path, size=(32, 24), colour=(200, 10, 10)) -> Path:
    Image.new("RGB", size, colour).save(path, format="PNG")
    return path


def wav(path: Path, seconds=0.5, rate=16000, freq=440.0) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(pcm.tobytes())
    return path


def frames(count=4, side=32) -> np.ndarray:
    video = np.zeros((count, side, side, 3), dtype=np.uint8)
    video[:, 4:10, 4:10] = 255
    return video


def truncate(path: Path, keep: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


# -- the entry points --------------------------------------------------------------------------


def test_the_three_modalities_are_registered_with_the_contract():
    names = set(get_registry().entries(PluginKind.modalities))
    assert {"image", "audio", "video"} <= names
    for name in ("image", "audio", "video"):
        get_registry().load(PluginKind.modalities, name)  # passes the hook check of relax.contracts


# -- image -------------------------------------------------------------------------------------


def test_image_from_a_path_bytes_and_an_inline_array_decode_to_the_same_pixels(tmp_path):
    image = plugin("image")
    path = png(tmp_path / "red.png")
    from_path = image.load(path)
    from_bytes = image.load(path.read_bytes())
    from_array = image.load(np.asarray(Image.open(path)))
    assert from_path.meta == {"width": 32, "height": 24, "tokens": 1}
    for other in (from_bytes, from_array):
        assert np.array_equal(np.asarray(other.data), np.asarray(from_path.data))
    assert np.asarray(from_path.data)[0, 0].tolist() == [200, 10, 10]


def test_image_budgets_reject_too_many_pixels_and_tokens(tmp_path):
    path = png(tmp_path / "big.png", size=(100, 100))
    with pytest.raises(MediaError, match="over max_pixels=5000"):
        plugin("image", max_pixels=5000).load(path)
    with pytest.raises(MediaError, match=r"about 16 tokens, over max_tokens=8"):
        plugin("image", max_tokens=8).load(path)


def test_corrupt_truncated_and_missing_images_are_errors_that_say_so(tmp_path):
    image = plugin("image")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    with pytest.raises(MediaError, match="not a decodable image"):
        image.load(corrupt)
    truncated = truncate(png(tmp_path / "cut.png", size=(64, 64), colour=(1, 2, 3)), 0.6)
    with pytest.raises(MediaError):
        image.load(truncated)
    with pytest.raises(MediaError, match="does not exist"):
        image.load(tmp_path / "nowhere.png")
    assert "truncated PNG" in image.probe(truncated)
    assert image.probe(png(tmp_path / "fine.png")) is None


# -- audio -------------------------------------------------------------------------------------


def test_audio_wav_is_mono_float_at_the_model_rate_and_other_rates_are_resampled(tmp_path):
    audio = plugin("audio", sample_rate=16000)
    clip = audio.load(wav(tmp_path / "a.wav", seconds=0.5))
    assert clip.data.dtype == np.float32 and clip.data.shape == (8000,)
    assert clip.meta["seconds"] == 0.5 and abs(float(np.abs(clip.data).max()) - 0.5) < 0.01
    slow = audio.load(wav(tmp_path / "b.wav", seconds=0.5, rate=8000))
    assert slow.data.shape == (8000,) and slow.meta["source_rate"] == 8000
    with pytest.raises(MediaError, match="8000 Hz but the model takes 16000 Hz"):
        plugin("audio", resample=False).load(tmp_path / "b.wav")


def test_audio_duration_budget_and_truncated_or_empty_clips(tmp_path):
    with pytest.raises(MediaError, match="longer than max_seconds=0.25"):
        plugin("audio", max_seconds=0.25).load(wav(tmp_path / "long.wav", seconds=0.5))
    truncated = truncate(wav(tmp_path / "cut.wav", seconds=0.5), 0.5)
    with pytest.raises(MediaError, match="truncated WAV"):
        plugin("audio").load(truncated)
    assert "truncated WAV" in plugin("audio").probe(truncated)
    with pytest.raises(MediaError, match="shorter than min_seconds"):
        plugin("audio").load(np.zeros(0, dtype=np.float32))
    with pytest.raises(MediaError, match="not a readable WAV"):
        plugin("audio").load(b"RIFF-not-really")


# -- video -------------------------------------------------------------------------------------


def test_video_from_npy_a_frame_folder_and_inline_agree(tmp_path):
    video = plugin("video", fps=2.0)
    clip = frames()
    np.save(tmp_path / "clip.npy", clip)
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(clip):
        Image.fromarray(frame).save(folder / f"{i:03d}.png")
    loaded = [video.load(tmp_path / "clip.npy"), video.load(folder), video.load(clip)]
    for item in loaded:
        assert np.array_equal(item.data, clip)
    assert loaded[0].meta == {"frames": 4, "width": 32, "height": 32, "fps": 2.0}


def test_video_frame_budget_and_empty_or_truncated_clips(tmp_path):
    with pytest.raises(MediaError, match="over max_frames=3"):
        plugin("video", max_frames=3).load(frames(4))
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros((0, 32, 32, 3), dtype=np.uint8))
    with pytest.raises(MediaError, match="empty"):
        plugin("video").load(empty)
    assert "empty array" in plugin("video").probe(empty)
    np.save(tmp_path / "cut.npy", frames())
    truncated = truncate(tmp_path / "cut.npy", 0.5)
    with pytest.raises(MediaError, match="truncated"):
        plugin("video").load(truncated)
    assert "truncated" in plugin("video").probe(truncated)
    (tmp_path / "noframes").mkdir()
    with pytest.raises(MediaError, match="holds no frames"):
        plugin("video").load(tmp_path / "noframes")


# -- references --------------------------------------------------------------------------------


def test_references_hold_a_path_and_checksum_never_the_decoded_media(tmp_path):
    media = MediaSet(KEYS, {}, base_dir=tmp_path, spill_dir=tmp_path / "spill")
    png(tmp_path / "p.png")
    row = {"image": "p.png", "audio": np.zeros(1600, dtype=np.float32), "video": frames()}
    refs = media.refs(row, 7)
    assert [r.modality for r in refs] == ["image", "audio", "video"]
    for ref in refs:
        assert Path(ref.path).is_file()
        assert len(json.dumps(ref.to_dict())) < 400  # a reference, not pixels or samples
    assert refs[0].path == str(tmp_path / "p.png")
    assert Path(refs[1].path).parent == tmp_path / "spill" and refs[1].path.endswith(".wav")
    assert refs[1].meta["seconds"] == 0.1
    assert np.array_equal(media.load(refs[2]).data, frames())
    # The same inline item is written once (content-addressed).
    assert media.refs(row, 7)[2].path == refs[2].path


def test_a_cell_may_hold_several_items_and_nested_lists_are_one_inline_item(tmp_path):
    media = MediaSet(KEYS, {}, base_dir=tmp_path, spill_dir=tmp_path / "spill")
    png(tmp_path / "a.png")
    png(tmp_path / "b.png", colour=(0, 0, 200))
    two_paths = media.refs({"image": ["a.png", "b.png"]}, 0)
    two_arrays = media.refs({"video": [frames(2), frames(3)]}, 1)
    nested = media.refs({"image": np.zeros((4, 5, 3), dtype=np.uint8).tolist()}, 2)
    assert [r.path for r in two_paths] == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    assert [r.meta["frames"] for r in two_arrays] == [2, 3]
    assert len(nested) == 1 and nested[0].meta["width"] == 5
    assert media.refs({"image": None, "audio": None}, 3) == []


def test_a_changed_file_fails_its_checksum(tmp_path):
    media = MediaSet(KEYS, {}, base_dir=tmp_path)
    ref = media.refs({"image": str(png(tmp_path / "p.png"))}, 0)[0]
    png(tmp_path / "p.png", colour=(0, 0, 255))
    with pytest.raises(MediaError, match="changed since the sample was generated"):
        media.load(ref)


class Rows:
    """A data set of rows given as a list (the map-style protocol of the dataset plugins)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def bad_media_rows(tmp_path: Path) -> tuple[list[dict], dict[str, int]]:
    """Rows 0-3 good, then one bad item per modality and a missing path; returns the rows and the
    bad row of each kind."""
    good = png(tmp_path / "good.png")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not an image at all")
    truncated = truncate(wav(tmp_path / "cut.wav"), 0.5)
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros((0, 8, 8, 3), dtype=np.uint8))
    rows = [{"prompt": f"q{i}", "answer": "a", "image": str(good)} for i in range(4)]
    bad = {"image": len(rows), "audio": len(rows) + 1, "video": len(rows) + 2, "missing": len(rows) + 3}
    rows += [{"prompt": "corrupt", "answer": "a", "image": str(corrupt)},
             {"prompt": "truncated", "answer": "a", "audio": str(truncated)},
             {"prompt": "empty", "answer": "a", "video": str(empty)},
             {"prompt": "missing", "answer": "a", "image": str(tmp_path / "gone.png")},
             {"prompt": "last", "answer": "b", "image": str(good)}]
    return rows, bad


@pytest.mark.parametrize("kind, key, message", [("image", "image", "not a decodable image"),
                                                ("audio", "audio", "truncated WAV"),
                                                ("video", "video", "empty"),
                                                ("missing", "image", "does not exist")])
def test_bad_media_under_error_stops_with_the_sample_and_the_column(tmp_path, kind, key, message):
    rows, bad = bad_media_rows(tmp_path)
    media = MediaSet(KEYS, {}, spill_dir=tmp_path / "spill", on_bad_sample="error")
    with pytest.raises(BadSample, match=rf"sample {bad[kind]}, column '{key}': .*{message}") as info:
        prompt_rows(Rows(rows), [0, bad[kind], 1], "prompt", "answer", media=media)
    assert info.value.index == bad[kind] and info.value.key == key


@pytest.mark.parametrize("kind", ["image", "audio", "video", "missing"])
def test_bad_media_under_skip_is_replaced_counted_and_loses_nothing_else(tmp_path, kind):
    rows, bad = bad_media_rows(tmp_path)
    media = MediaSet(KEYS, {}, spill_dir=tmp_path / "spill", on_bad_sample="skip")
    picked = prompt_rows(Rows(rows), [0, bad[kind], 1], "prompt", "answer", media=media)
    assert [r["prompt"] for r in picked][::2] == ["q0", "q1"]  # the good rows are untouched
    assert picked[1]["prompt"] == "last" and picked[1]["index"] == 8  # the next usable row stands in
    assert media.skipped == 4 - list(bad).index(kind)  # every bad row it passed over is counted
    prompt, refs = loads_context(picked[1]["media"])
    assert prompt == "last" and refs[0].key == "image"


def test_skip_with_no_usable_sample_is_an_error(tmp_path):
    rows, bad = bad_media_rows(tmp_path)
    only_bad = [rows[i] for i in bad.values()]
    media = MediaSet(KEYS, {}, on_bad_sample="skip")
    with pytest.raises(ValueError, match="every one of the 4 training samples has bad media"):
        prompt_rows(Rows(only_bad), [0], "prompt", "answer", media=media)


# -- validation of the media files a data file names -------------------------------------------


def omni_spec(data_file: Path, policy: str = "error", **media_options) -> dict:
    return {"name": "media-check", "model": {"path": "builtin:tiny-omni",
                                             "modalities": ["text", "image", "audio", "video"]},
            "data": {"train": {"source": str(data_file)}, "media_keys": KEYS, "on_bad_sample": policy,
                     "media_options": media_options},
            "tracing": {"exporter": "none"}}


def test_validate_names_each_bad_media_file_with_its_sample_and_column(tmp_path):
    rows, bad = bad_media_rows(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SpecError) as info:
        validate_spec(omni_spec(data), base_dir=tmp_path)
    text = str(info.value)
    assert f"sample {bad['image']}, column 'image'" in text and "not an image file" in text
    assert f"sample {bad['audio']}, column 'audio'" in text and "truncated WAV" in text
    assert f"sample {bad['video']}, column 'video'" in text and "empty array" in text
    assert f"sample {bad['missing']}, column 'image'" in text and "does not exist" in text
    assert "sample 0," not in text
    # Under skip the same file validates: the run skips those samples and counts them.
    validate_spec(omni_spec(data, policy="skip"), base_dir=tmp_path)


def test_validate_checks_media_budgets_against_the_plugin_config(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    raw = omni_spec(data, image={"max_pixels": 0}, audio={"sample_rat": 16000})
    with pytest.raises(SpecError) as info:
        validate_spec(raw, base_dir=tmp_path)
    text = str(info.value)
    assert "data.media_options.image.max_pixels" in text and "data.media_options.audio" in text
