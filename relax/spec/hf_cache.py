"""Hub model ids found in the local Hugging Face cache, without the network and without importing
``huggingface_hub``.

A ``model.path`` like ``Qwen/Qwen3-8B`` is accepted when the cache on this machine already holds
the model's ``config.json``: ``relax validate`` reads its architecture from there, and ``relax run``
hands the workers the cached snapshot folder. Relax never downloads a model; the message of
``download_hint`` says how to put one in the cache.

The cache is read by hand, following the layout and lookup that ``huggingface_hub`` itself uses
(``constants.HF_HUB_CACHE`` and ``file_download.try_to_load_from_cache``, huggingface_hub 0.2x-2.x):

- the cache folder is ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, with
  ``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface`` and that to ``~/.cache/huggingface``;
- a model ``ORG/NAME`` lives in ``models--ORG--NAME/``, its default revision ``main`` is named by
  ``refs/main`` (a commit hash), and its files are under ``snapshots/<hash>/``.

Why not call ``try_to_load_from_cache``: importing it pulls in ``huggingface_hub``'s HTTP stack
(httpx and friends, about 0.1 s), which ``relax validate`` has no use for; and reading the folders
is a few ``stat`` calls. A test checks that both lookups agree on the same cache.

``HF_HUB_OFFLINE`` changes nothing here: this lookup never goes online, whether it is set or not.
Set it on the nodes of a cluster all the same, so that anything else loading from the hub (a
judge's tokenizer, say) cannot try to.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

#: ``org/name`` as the hub spells model ids (one slash; letters, digits, ``-``, ``_``, ``.``).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: Files of which a Hugging Face model folder needs one for its tokenizer to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")
#: The revision ``from_pretrained`` and ``hf download`` use when none is given.
DEFAULT_REVISION = "main"


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The folder of the hub cache, resolved from the environment as ``huggingface_hub`` does."""
    env = os.environ if env is None else env
    cache_home = env.get("XDG_CACHE_HOME") or os.path.join(_expand("~", env), ".cache")
    home = _expand(env.get("HF_HOME") or os.path.join(cache_home, "huggingface"), env)
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(_expand(cache, env))


def _expand(path: str, env: Mapping[str, str]) -> str:
    """``os.path.expandvars(os.path.expanduser(path))`` with ``env`` for the environment (the
    variables of a cluster node's environment can be checked from anywhere)."""
    if path == "~" or path.startswith("~/"):
        path = (env.get("HOME") or os.path.expanduser("~")) + path[1:]
    return _VARIABLE.sub(lambda m: env.get(m[1] or m[2], m[0]), path)


#: ``$NAME`` or ``${NAME}``, as ``os.path.expandvars`` reads them (unknown ones are left as written).
_VARIABLE = re.compile(r"\$(?:(\w+)|\{([^}]*)\})")


def repo_folder(model_id: str, env: Mapping[str, str] | None = None) -> Path:
    """Where the cache keeps ``model_id`` (``models--ORG--NAME``), whether it exists or not."""
    return hub_cache_dir(env) / "--".join(["models", *model_id.split("/")])


def cached_snapshot(model_id: str, env: Mapping[str, str] | None = None) -> Path | None:
    """The snapshot folder of ``model_id``'s default revision whose ``config.json`` is cached, or
    None. ``refs/main`` names the snapshot, as in ``try_to_load_from_cache``: a cache holding only
    other snapshots is not taken to hold the model (which revision would it be?)."""
    if not HUB_ID.match(model_id):
        return None
    repo = repo_folder(model_id, env)
    revision = DEFAULT_REVISION
    ref = repo / "refs" / DEFAULT_REVISION
    try:
        if ref.is_file():
            revision = ref.read_text().strip()
    except OSError:
        return None
    if not revision or "/" in revision or revision in (".", ".."):
        return None
    snapshot = repo / "snapshots" / revision
    return snapshot if (snapshot / "config.json").is_file() else None


def download_hint(model_id: str, env: Mapping[str, str] | None = None) -> str:
    """What to run to put ``model_id`` where ``cached_snapshot`` finds it, naming this cache."""
    return (f"on a machine that can reach the hub, run `hf download {model_id}` (the whole model, needed to train) "
            f"or `hf download {model_id} --include config.json` (enough for relax validate and plan); "
            f"with huggingface_hub older than 0.34 the command is `huggingface-cli download`. It goes to "
            f"$HF_HOME/hub (here {hub_cache_dir(env)}): copy that folder to the same place here, or point "
            "HF_HOME at a copy; or give model.path as a model folder (`hf download ... --local-dir DIR`)")


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` (a model folder or a cached snapshot) holds one of ``TOKENIZER_FILES``."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)
