"""Hostile-input catalogue, careless input and the user's data (issue 21): what a user can hand
``relax`` by mistake or on purpose, and what must come back: the exit code, words of the message,
and which of their files must be left exactly as they were.

``TABLE`` runs ``python -m relax ...`` in a fresh project folder holding the row's files; no row
starts Ray (each is refused before anything starts). Cases with a setup of their own follow it:

- ``test_a_folder_from_an_earlier_run_is_renamed_as_before``: a folder with the run marker is kept
  as ``<name>.1``; a marked folder that holds the current directory is refused, not renamed.
- ``test_a_fresh_run_is_not_blocked_by_a_corrupt_meta_json``: without ``--resume`` no checkpoint
  is read; the old folder is kept aside.
- ``test_resume_keeps_each_metrics_row_once``, ``test_pruning_keeps_the_checkpoint_a_resume_needs``
  and ``test_a_checkpoint_past_every_row_starts_over``: the ``--resume`` metrics gap.
- ``test_a_png_bomb_is_refused_from_its_header``: a 10000 x 10000 PNG is a ``MediaError`` before
  decoding (no large allocation); ``test_a_folder_as_media_is_a_media_error`` (image and video).
- ``test_prompts_that_are_not_text_are_refused_with_file_and_line``: null and integer prompts.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from relax.runtime.checkpoint import META, checkpoint_root, checkpoints_to_remove, resume_checkpoint
from relax.runtime.driver.launch import RUN_MARKER, OutputFolderError, keep_previous_run, resume_point
from relax.runtime.metrics import MetricsLog

ROOT = Path(__file__).resolve().parents[2]


def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs": each level is a list of nine aliases of the one before (9**levels)."""
    lines = ["name: bomb", 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def flow_alias_bomb(levels: int = 9) -> str:
    """The same bomb as one flow mapping, for a command-line override."""
    items = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    items += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "{" + ", ".join(items) + "}"


def extends_chain(depth: int) -> dict[str, str]:
    files = {"s0.yaml": "extends: tiny-cpu\nname: s0\n"}
    files.update({f"s{i}.yaml": f"extends: s{i - 1}.yaml\nname: s{i}\n" for i in range(1, depth + 1)})
    return files


def saved_run(spec_yaml: str, meta: str = '{"step": 2}', rows: int = 2) -> dict[str, str]:
    """The files of an earlier run in ``out/``: marker, spec, a checkpoint at step 2, metrics rows."""
    return {f"out/{RUN_MARKER}": "{}\n", "out/spec.yaml": spec_yaml,
            "out/checkpoints/step-2/meta.json": meta,
            "out/metrics.jsonl": "".join(json.dumps({"step": s}) + "\n" for s in range(1, rows + 1))}


def tiny_saved_spec() -> str:
    """``spec.yaml`` as ``relax run tiny-cpu trainer.output_dir=out`` writes it."""
    from omegaconf import OmegaConf

    from relax.config import load_spec_dict
    from relax.spec import validate_spec

    raw, base = load_spec_dict("tiny-cpu", ["trainer.output_dir=out"])
    spec = validate_spec(raw, base_dir=base)
    return OmegaConf.to_yaml(OmegaConf.create(spec.model_dump(mode="json")))


USER_FILES = {"out/notes.txt": "my notes\n", "out/data.jsonl": '{"prompt": "1+1=", "answer": "2"}\n'}
PROJECT = {"spec.yaml": "extends: tiny-cpu\nname: proj\ntrainer: {output_dir: .}\n",
           "data.jsonl": '{"prompt": "1+1=", "answer": "2"}\n'}
MEDIA_ROW = {"prompt": "Colour?", "answer": "red", "image": "pics", "audio": None, "video": None}


@dataclass(frozen=True)
class Case:
    name: str
    files: dict[str, str | bytes]
    """Written under the project folder the command runs in."""
    args: tuple[str, ...]
    code: int
    words: tuple[str, ...]
    """Each must appear in stderr."""
    unchanged: tuple[str, ...] = ()
    """Files of ``files`` that must still hold the same bytes (nothing renamed or lost)."""
    absent: tuple[str, ...] = ()
    """Paths that must not exist afterwards (a rename would create them)."""
    within_s: float = 60.0


TABLE = [
    Case("alias bomb", {"bomb.yaml": alias_bomb()}, ("validate", "bomb.yaml"), 2,
         ("bomb.yaml", "more than 100000 nodes"), within_s=5.0),
    # Hydra's override grammar has no YAML aliases: the bomb is a malformed override, refused at once.
    Case("alias bomb in an override", {}, ("validate", "tiny-cpu", "name=" + flow_alias_bomb()), 2,
         ("override 'name={l0: &l0", "is not of the form a.b.c=value"), within_s=5.0),
    Case("override nested 3000 deep", {}, ("validate", "tiny-cpu", "name=" + "[" * 3000 + "]" * 3000), 2,
         ("name: override value is refused", "nest more than 64 deep"), within_s=5.0),
    Case("override nested 150 deep", {}, ("validate", "tiny-cpu", "name=" + "[" * 150 + "]" * 150), 2,
         ("name: override value is refused", "nest more than 64 deep"), within_s=5.0),
    Case("list nested 150 deep", {"deep.yaml": "name: deep\nx: " + "[" * 150 + "]" * 150 + "\n"},
         ("validate", "deep.yaml"), 2, ("deep.yaml", "nest more than 64 deep")),
    Case("JSON nested 150 deep", {"deep.json": '{"name": "d", "x": ' + "[" * 150 + "]" * 150 + "}"},
         ("validate", "deep.json"), 2, ("deep.json", "nest more than 64 deep")),
    Case("spec file over 2 MiB", {"big.yaml": "name: big\n" + "#" * (2 * 1024 * 1024) + "\n"},
         ("validate", "big.yaml"), 2, ("big.yaml", "2097152")),
    Case("non-UTF-8 spec", {"latin1.yaml": "name: caf\xe9\n".encode("latin-1")}, ("validate", "latin1.yaml"), 2,
         ("latin1.yaml", "not UTF-8", "byte 9", "0xe9")),
    Case("a folder as the spec", {"specdir/x": ""}, ("validate", "specdir"), 2, ("specdir", "neither a file")),
    Case("extends chain 40 deep", extends_chain(40), ("validate", "s40.yaml"), 2,
         ("too deep", "depth limit of 16", "not a loop")),
    Case("extends= override", {}, ("validate", "tiny-cpu", "extends=tiny-agent-cpu"), 2,
         ("extends cannot be set on the command line", "in the spec file")),
    Case("seed past 2**32", {}, ("validate", "tiny-cpu", f"seed={2**32}"), 2, ("seed:", "4294967295")),
    Case("huge prompts_per_step", {}, ("validate", "tiny-cpu", "algorithm.prompts_per_step=10000000"), 2,
         ("algorithm.prompts_per_step", "100000")),
    Case("cluster too small", {}, ("validate", "qwen3-4b-grpo-async", "cluster.address=ray://head:10001",
                                   "cluster.gpus_per_node=4"), 2,
         ("roles.actor.gpus=4", "roles.rollout", "cluster.gpus_per_node", "1 x 4 = 4")),
    Case("a folder as a media path", {"data.jsonl": json.dumps(MEDIA_ROW) + "\n", "pics/a.txt": "",
                                      "omni.yaml": "extends: tiny-omni-cpu\nname: omni\n"},
         ("validate", "omni.yaml", "data.train={source: data.jsonl}"), 2,
         ("column 'image'", "media path pics is a folder, not a file")),
    Case("output_dir is a file", {"out": "a file of mine\n"}, ("run", "tiny-cpu", "trainer.output_dir=out"), 2,
         ("out is a file, not a folder", "choose another trainer.output_dir"), unchanged=("out",)),
    Case("output_dir holds user files", USER_FILES, ("run", "tiny-cpu", "trainer.output_dir=out"), 2,
         ("not empty and was not written by a Relax run", "Choose another trainer.output_dir", "empty that folder"),
         unchanged=tuple(USER_FILES), absent=("out.1", f"out/{RUN_MARKER}", "out/spec.yaml")),
    Case("output_dir . in a project folder", PROJECT, ("run", "spec.yaml"), 2,
         ("not written by a Relax run",), unchanged=tuple(PROJECT), absent=(RUN_MARKER, "plan.json")),
    Case("corrupt meta.json with --resume", saved_run("name: x\n", meta="{not json"),
         ("run", "tiny-cpu", "trainer.output_dir=out", "--resume"), 2,
         ("meta.json is corrupt", "step-2", "run without --resume"),
         unchanged=("out/checkpoints/step-2/meta.json", "out/metrics.jsonl")),
]


def test_the_catalogue_names_distinct_cases() -> None:
    assert len({case.name for case in TABLE}) == len(TABLE)


@pytest.mark.parametrize("case", TABLE, ids=[c.name for c in TABLE])
def test_careless_input(case: Case, tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    for name, content in case.files.items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = {name: (project / name).read_bytes() for name in case.unchanged}
    result, took = relax(project, *case.args)
    assert result.returncode == case.code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for word in case.words:
        assert word in result.stderr, (word, result.stderr)
    assert took < case.within_s, f"{case.name} took {took:.1f} s"
    for name, content in before.items():
        assert (project / name).read_bytes() == content, f"{name} changed"
    for name in case.absent:
        assert not (project / name).exists(), f"{name} was created"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]  # the project folder was not renamed


def relax(cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "relax", *args], capture_output=True, text=True, cwd=cwd,
                            env=env, timeout=120)
    return result, time.monotonic() - started


def test_resume_with_another_algorithm_is_refused_naming_the_fields(tmp_path: Path) -> None:
    for name, content in saved_run(tiny_saved_spec()).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    result, _ = relax(tmp_path, "run", "tiny-cpu", "trainer.output_dir=out", "algorithm.name=dapo", "--resume")
    assert result.returncode == 2, result.stderr
    assert "--resume: this spec differs" in result.stderr
    assert 'algorithm.name: "grpo" -> "dapo"' in result.stderr
    assert (tmp_path / "out" / "spec.yaml").read_text() == tiny_saved_spec()  # not overwritten


# -- output folders ---------------------------------------------------------------------------------


def test_a_folder_from_an_earlier_run_is_renamed_as_before(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    assert keep_previous_run(folder) is None
    (folder / "checkpoints" / "step-2").mkdir(parents=True)
    (folder / RUN_MARKER).write_text("{}\n")
    assert keep_previous_run(folder) == tmp_path / "run.1" and not folder.exists()
    assert (tmp_path / "run.1" / "checkpoints" / "step-2").is_dir()
    # a marked folder that holds the current directory (output_dir: . after an earlier run there)
    folder.mkdir()
    (folder / RUN_MARKER).write_text("{}\n")
    with pytest.raises(OutputFolderError, match="will not rename it"):
        keep_previous_run(folder, protected=(folder / "sub",))
    assert folder.is_dir() and not (tmp_path / "run.2").exists()


def test_a_fresh_run_is_not_blocked_by_a_corrupt_meta_json(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    (checkpoint_root(folder) / "step-2").mkdir(parents=True)
    (checkpoint_root(folder) / "step-2" / META).write_text("{torn")
    (folder / RUN_MARKER).write_text("{}\n")
    assert resume_point(folder, resume=False) == (0, None)
    assert keep_previous_run(folder) == tmp_path / "out.1"
    with pytest.raises(OutputFolderError, match=r"meta.json is corrupt .*run without --resume"):
        resume_point(tmp_path / "out.1", resume=True)


# -- --resume and metrics.jsonl ---------------------------------------------------------------------


def write_run(folder: Path, checkpoints: list[int], rows: list[int], torn: bool = False) -> Path:
    for step in checkpoints:
        (checkpoint_root(folder) / f"step-{step}").mkdir(parents=True)
        (checkpoint_root(folder) / f"step-{step}" / META).write_text(json.dumps({"step": step}))
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in rows)
    (folder / "metrics.jsonl").write_text(text + ('{"step": 9, "rew' if torn else ""))
    return folder


def test_resume_keeps_each_metrics_row_once(tmp_path: Path) -> None:
    # killed after row 5 (and a torn row 6); the checkpoint of step 4 is the resume point
    folder = write_run(tmp_path, checkpoints=[4], rows=[1, 2, 3, 4, 5], torn=True)
    start, _ = resume_checkpoint(folder)
    log = MetricsLog(folder, start)
    for step in range(start + 1, 8):  # what the resumed run writes: the step after the checkpoint first
        log.append({"step": step})
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7]


def test_pruning_keeps_the_checkpoint_a_resume_needs(tmp_path: Path) -> None:
    found = [(2, tmp_path / "step-2"), (4, tmp_path / "step-4"), (6, tmp_path / "step-6")]
    # keep 1: step 6 was saved, its row (and step 4's) not yet written: step 2 is what a resume needs
    assert checkpoints_to_remove(found, keep=1, last_row=3) == [tmp_path / "step-4"]
    assert checkpoints_to_remove(found, keep=1, last_row=6) == [tmp_path / "step-2", tmp_path / "step-4"]
    assert checkpoints_to_remove(found, keep=2, last_row=None) == [tmp_path / "step-2"]


def test_a_checkpoint_past_every_row_starts_over(tmp_path: Path, capsys) -> None:
    # the only checkpoint is of a step whose row was never written: resuming from it would leave a gap
    folder = write_run(tmp_path / "a", checkpoints=[5], rows=[1, 2, 3, 4])
    assert resume_point(folder, resume=True) == (0, None)
    assert "starts over from step 0" in capsys.readouterr().err
    # a run folder without metrics.jsonl at all: the newest checkpoint, as before
    folder = write_run(tmp_path / "b", checkpoints=[5], rows=[])
    (folder / "metrics.jsonl").unlink()
    assert resume_point(folder, resume=True)[0] == 5


# -- data and media ---------------------------------------------------------------------------------


def test_a_png_bomb_is_refused_from_its_header(tmp_path: Path, monkeypatch) -> None:
    from PIL import Image, ImageFile

    from relax.media import MediaError
    from relax_plugins.modalities.image import ImageModality

    path = tmp_path / "bomb.png"
    Image.new("1", (10_000, 10_000)).save(path, optimize=True)  # one colour: a few KB on disk
    assert path.stat().st_size < 100_000
    decoded = []
    real_load = ImageFile.ImageFile.load

    def load(image):  # Pillow decodes in load(); Image.open reads only the header
        decoded.append(image.size)
        return real_load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    plugin = ImageModality(ImageModality.Config(max_pixels=1024 * 1024))
    started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MediaError, match=r"10000x10000 = 100000000 pixels is over max_pixels.*not decoded"):
        plugin.load(path)
    assert decoded == []
    # ru_maxrss is in KiB on Linux; decoding would take 100 MB (mode 1 as bytes) to 300 MB (RGB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - started < 50 * 1024
    # past Pillow's own bomb limit too (2 x 89 M pixels): a MediaError, not DecompressionBombError
    huge = tmp_path / "huge.png"
    Image.new("1", (20_000, 10_000)).save(huge, optimize=True)
    with pytest.raises(MediaError, match="decompression bomb"):
        ImageModality(ImageModality.Config(max_pixels=10**9)).load(huge)
    assert decoded == []
    # and a small image still decodes
    small = tmp_path / "small.png"
    Image.new("RGB", (64, 32), "red").save(small)
    assert plugin.load(small).data.size == (64, 32) and set(decoded) == {(64, 32)}


def test_a_folder_as_media_is_a_media_error(tmp_path: Path) -> None:
    from relax.media import MediaError
    from relax_plugins.modalities.image import ImageModality
    from relax_plugins.modalities.video import VideoModality

    with pytest.raises(MediaError, match="is a folder, not a image file"):
        ImageModality(ImageModality.Config()).load(tmp_path)
    with pytest.raises(MediaError, match="holds no frames"):  # video takes a folder of frames
        VideoModality(VideoModality.Config()).load(tmp_path)


@pytest.mark.parametrize(("prompt", "shown"), [(None, "null"), (42, "42"), (["a"], '["a"]')])
def test_prompts_that_are_not_text_are_refused_with_file_and_line(tmp_path: Path, prompt, shown) -> None:
    from relax_plugins.datasets.files import DatasetFileError, JsonlDataset

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n\n"
                    + json.dumps({"prompt": prompt, "answer": "2"}) + "\n")
    expected = re.escape(f"d.jsonl:3: the prompt ('prompt', data.prompt_key) is {shown}, not text")
    with pytest.raises(DatasetFileError, match=expected):
        JsonlDataset(JsonlDataset.Config(path=str(data), prompt_key="prompt"))
    assert len(JsonlDataset(JsonlDataset.Config(path=str(data)))) == 2  # without the key: unchecked, as before
