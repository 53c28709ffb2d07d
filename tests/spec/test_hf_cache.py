"""Hub model ids read from the local Hugging Face cache (``relax.spec.hf_cache``): the cache
folder and lookup agree with ``huggingface_hub``'s own, ``relax validate`` and ``relax plan``
estimate memory from a cached ``config.json``, a model in neither the cache nor a folder is refused
with the command that downloads it, and nothing of it reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax.config import load_spec_dict
from relax.config.loader import PRESETS_DIR
from relax.plan import make_plan
from relax.registry import get_registry
from relax.spec import SpecError, validate_spec
from relax.spec.hf_cache import cached_snapshot, hub_cache_dir, repo_folder
from relax.spec.validate import resolve_architecture

ROOT = Path(__file__).resolve().parents[2]
MODEL_ID = "acme/Qwen3-1.7B-test"
REVISION = "0123456789abcdef0123456789abcdef01234567"
#: The shape of Qwen3-1.7B's config.json, written by hand (only what the estimate reads, and the
#: keys every Qwen3 config has besides).
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
#: P = L (attn + mlp + 2h) + tied embedding + h, by hand: attn = 2 * 2048 * 16 * 128 + 2 * 2048 * 8 * 128,
#: mlp = 3 * 2048 * 6144.
QWEN3_PARAMS = 28 * (8_388_608 + 4_194_304 + 37_748_736 + 2 * 2048) + 151936 * 2048 + 2048
#: The env variables that move the cache; each test sets its own.
CACHE_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")


def cache_model(hub: Path, model_id: str, files: dict[str, str], revision: str = REVISION,
                ref: str | None = "main") -> Path:
    """A model in ``hub`` laid out as ``hf download`` leaves it: the files' contents in ``blobs/``
    (named by their hash), the snapshot's entries as relative links to them, ``refs/<ref>`` naming
    the revision. Returns the snapshot folder."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, text in files.items():
        blob = repo / "blobs" / hashlib.sha256(text.encode()).hexdigest()
        blob.write_text(text)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(revision)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty cache under ``HF_HOME`` in tmp (whatever cache this machine has is out of sight)."""
    for name in CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = tmp_path / "hf" / "hub"
    folder.mkdir(parents=True)
    return folder


def gpu_cluster_spec(model: str, *extra: str) -> dict:
    """The async Qwen3 preset on a cluster given by address, with ``model`` as its model (its data
    path is taken from ``PRESETS_DIR``, the spec's folder)."""
    raw, _ = load_spec_dict("qwen3-4b-grpo-async", [f"model.path={model}", "cluster.address=auto", *extra])
    return raw


def issues_of(raw: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, base_dir=PRESETS_DIR, runnable=True)
    return {issue.path: str(issue) for issue in caught.value.issues}


# -- where the cache is, and what counts as cached ---------------------------------------------------


ENV_CASES = {
    "defaults": {"HOME": "/home/u"},
    "xdg": {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"},
    "hf_home": {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg", "HF_HOME": "/data/hf"},
    "hf_home_tilde": {"HOME": "/home/u", "HF_HOME": "~/hf"},
    "legacy_cache": {"HOME": "/home/u", "HF_HOME": "/data/hf", "HUGGINGFACE_HUB_CACHE": "/legacy"},
    "hub_cache_wins": {"HOME": "/home/u", "HF_HOME": "/data/hf", "HUGGINGFACE_HUB_CACHE": "/legacy",
                       "HF_HUB_CACHE": "/new"},
    "variables": {"HOME": "/home/u", "SCRATCH": "/scratch/u", "HF_HOME": "$SCRATCH/hf", "HF_HUB_CACHE": "${HF_HOME}/x"},
}


@pytest.mark.parametrize("case", ENV_CASES, ids=list(ENV_CASES))
def test_the_cache_folder_is_the_one_huggingface_hub_uses(case):
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env.update(ENV_CASES[case])
    probe = "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"
    theirs = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60,
                            check=True).stdout.strip()
    assert str(hub_cache_dir(env)) == theirs


def test_the_lookup_agrees_with_try_to_load_from_cache(hub):
    from huggingface_hub import try_to_load_from_cache  # the reference; relax itself never imports it

    config = json.dumps(QWEN3_CONFIG)
    cache_model(hub, "acme/full", {"config.json": config, "tokenizer.json": "{}"})
    cache_model(hub, "acme/no-config", {"tokenizer.json": "{}"})
    cache_model(hub, "acme/no-ref", {"config.json": config}, ref=None)  # a snapshot main does not name
    cache_model(hub, "acme/other-branch", {"config.json": config}, ref="dev")
    (repo_folder("acme/dangling") / "refs").mkdir(parents=True)  # refs/main names a snapshot not there
    (repo_folder("acme/dangling") / "refs" / "main").write_text(REVISION)
    for model_id in ("acme/full", "acme/no-config", "acme/no-ref", "acme/other-branch", "acme/dangling",
                     "acme/absent"):
        theirs = try_to_load_from_cache(model_id, "config.json", cache_dir=hub)
        ours = cached_snapshot(model_id)
        assert (str(ours / "config.json") if ours else None) == (theirs if isinstance(theirs, str) else None), model_id
    assert cached_snapshot("acme/full") == hub / "models--acme--full" / "snapshots" / REVISION


# -- validate and plan --------------------------------------------------------------------------------


def test_a_cached_config_gives_the_architecture_and_a_memory_estimate(hub, tmp_path):
    cache_model(hub, MODEL_ID, {"config.json": json.dumps(QWEN3_CONFIG)})  # config.json only
    arch, issues = resolve_architecture(MODEL_ID, tmp_path, get_registry())
    assert issues == [] and arch is not None
    assert (arch.num_layers, arch.hidden_size, arch.num_kv_heads, arch.head_dim) == (28, 2048, 8, 128)
    assert arch.params_total() == QWEN3_PARAMS == 1_720_567_808
    # a cluster spec validates with the config alone (the weights are on the cluster's nodes) ...
    spec = validate_spec(gpu_cluster_spec(MODEL_ID), base_dir=PRESETS_DIR, runnable=True)
    plan = make_plan(spec, base_dir=PRESETS_DIR)
    weights = [item for device in plan.memory for item in device.items if item.what == "weights"]
    assert weights and not any("is unknown here" in note for note in plan.notes)
    # bf16 weights of the whole model on an actor GPU (the torch trainer keeps a full replica)
    assert max(item.gib for item in weights) == pytest.approx(QWEN3_PARAMS * 2 / 2**30, rel=0.01)


def test_the_cached_config_wins_over_a_shipped_card(hub, tmp_path):
    cache_model(hub, "Qwen/Qwen3-4B", {"config.json": json.dumps(QWEN3_CONFIG)})
    arch, _ = resolve_architecture("Qwen/Qwen3-4B", tmp_path, get_registry())
    assert arch.params_total() == QWEN3_PARAMS  # not the card's 36 layers of 2560


def test_a_run_here_needs_the_whole_model_in_the_cache(hub, tmp_path):
    snapshot = cache_model(hub, MODEL_ID, {"config.json": json.dumps(QWEN3_CONFIG)})
    raw = gpu_cluster_spec(MODEL_ID, "cluster.address=null")
    issue = issues_of(raw)["model.path"]
    assert f"its snapshot {snapshot} has a config.json but no tokenizer files" in issue
    assert f"`hf download {MODEL_ID}`" in issue
    blob = snapshot.parent.parent / "blobs" / "tok"
    blob.write_text("{}")
    (snapshot / "tokenizer.json").symlink_to(Path("..", "..", "blobs", "tok"))
    assert "model.path" not in issues_of(raw)  # only this machine's lack of GPUs is left


def test_a_model_in_neither_the_cache_nor_a_folder_says_how_to_download_it(hub, tmp_path):
    issue = issues_of(gpu_cluster_spec("acme/never-downloaded"))["model.path"]
    assert issue.startswith(f"model.path: no such folder: {PRESETS_DIR / 'acme' / 'never-downloaded'}, and the "
                            f"Hugging Face cache at {hub} has no config.json for 'acme/never-downloaded'")
    assert "Relax never downloads a model" in issue
    assert "`hf download acme/never-downloaded --include config.json`" in issue
    assert "`hf download acme/never-downloaded`" in issue and "$HF_HOME/hub" in issue
    # relax plan lays it out all the same, and says what it could not estimate and why
    spec = validate_spec(gpu_cluster_spec("acme/never-downloaded"), base_dir=PRESETS_DIR)
    note = next(n for n in make_plan(spec, base_dir=PRESETS_DIR).notes if "is unknown here" in n)
    assert "no config.json in the Hugging Face cache" in note and "hf download acme/never-downloaded" in note


def test_a_card_id_not_in_the_cache_still_validates(hub, tmp_path):
    """The presets' ids keep their shipped numbers: a laptop validates them with an empty cache."""
    spec = validate_spec(gpu_cluster_spec("Qwen/Qwen3-4B"), base_dir=PRESETS_DIR, runnable=True)
    assert make_plan(spec, base_dir=PRESETS_DIR).memory


def test_a_card_id_not_in_the_cache_is_a_note_for_validate_and_refused_for_a_run_here(hub, tmp_path):
    """On this machine (no cluster.address) a run would have to download the model: ``relax run``
    and ``relax validate --here`` refuse it; ``relax validate`` notes it. Cached, it is neither."""
    from relax.spec.validate import machine_notes

    raw = gpu_cluster_spec("Qwen/Qwen3-4B", "cluster.address=null", "roles.actor.gpus=0",
                           "roles.rollout.gpus_per_replica=0")
    spec = validate_spec(raw, base_dir=PRESETS_DIR, runnable=True, here=False)
    [note] = [n for n in machine_notes(spec, base_dir=PRESETS_DIR) if n.path == "model.path"]
    assert f"'Qwen/Qwen3-4B' is not in this machine's Hugging Face cache ({hub})" in str(note)
    assert "Relax never downloads a model" in str(note) and "`hf download Qwen/Qwen3-4B`" in str(note)
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, base_dir=PRESETS_DIR, runnable=True, here=True)
    assert [i for i in caught.value.issues if i.path == "model.path" and "not in this machine's" in str(i)]
    cache_model(hub, "Qwen/Qwen3-4B", {"config.json": json.dumps(QWEN3_CONFIG), "tokenizer.json": "{}"})
    assert not [n for n in machine_notes(spec, base_dir=PRESETS_DIR) if n.path == "model.path"]


def test_the_run_hands_the_workers_the_cached_snapshot(hub, tmp_path):
    from relax.runtime.model_files import materialize_path

    snapshot = cache_model(hub, MODEL_ID, {"config.json": json.dumps(QWEN3_CONFIG), "tokenizer.json": "{}"})
    assert materialize_path(MODEL_ID, {}, tmp_path) == str(snapshot)
    assert materialize_path("acme/absent", {}, tmp_path) == "acme/absent"  # as before: the id itself
    (tmp_path / "acme" / "Qwen3-1.7B-test").mkdir(parents=True)  # a folder of that name wins
    assert materialize_path(MODEL_ID, {}, tmp_path) == str(tmp_path / MODEL_ID)


# -- nothing reaches the network --------------------------------------------------------------------------

AUDIT_PROBE = textwrap.dedent("""
    import json, sys

    reached = []

    def audit(event, args):
        if event in ("socket.connect", "socket.sendto", "socket.getaddrinfo", "socket.gethostbyname"):
            reached.append([event, repr(args[1:] if event.startswith("socket.c") or event == "socket.sendto"
                                        else args)])

    sys.addaudithook(audit)
    from relax.cli import main

    rc = main(sys.argv[1:])
    loaded = sorted({m.split(".")[0] for m in sys.modules} & {"huggingface_hub", "torch", "transformers", "ray"})
    print("\\n" + json.dumps({"rc": rc, "reached": reached, "loaded": loaded}))
""")


@pytest.mark.parametrize("command", [["validate"], ["plan"]])
@pytest.mark.parametrize("model", [MODEL_ID, "acme/never-downloaded"], ids=["cached", "missing"])
def test_validate_and_plan_of_a_hub_id_open_no_socket(hub, tmp_path, command, model):
    """Every socket connection and name lookup is an audit event: with ``HF_HUB_OFFLINE`` unset
    (nothing relies on it), validate and plan make none, and import no hub or model library."""
    cache_model(hub, MODEL_ID, {"config.json": json.dumps(QWEN3_CONFIG)})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).strip(os.pathsep)  # this checkout
    argv = [command[0], "qwen3-4b-grpo-async", f"model.path={model}", "cluster.address=auto"]
    result = subprocess.run([sys.executable, "-c", AUDIT_PROBE, *argv], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=120)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["reached"] == [] and report["loaded"] == [], report
    refused = command == ["validate"] and model != MODEL_ID
    assert report["rc"] == (2 if refused else 0), result.stderr
    if refused:
        assert "hf download acme/never-downloaded --include config.json" in result.stderr


def test_a_cluster_folder_missing_here_says_where_to_validate(hub):
    issue = issues_of(gpu_cluster_spec("/shared/models/Qwen3-4B"))["model.path"]
    assert issue.startswith("model.path: no such folder: /shared/models/Qwen3-4B (/shared/models/Qwen3-4B is no "
                            "hub id and no builtin:<name> either)")
    assert "validate such a spec on a node of the cluster" in issue
