"""What run files, trackers and printed specs show in place of secrets.

A spec may pull a credential from the environment (``X-Api-Key: ${oc.env:JUDGE_KEY}``) or hold one
under a key named for it (``api_key: ...``). The runtime needs the real value; nothing a run writes
or prints needs it, and each copy of it (``spec.yaml``, ``plan.json``, TensorBoard, MLflow, wandb)
would be one more file to keep secret. So the loader records what came from ``${oc.env:...}``
(``Redactions``), the spec carries that record (``attach``/``redactions_of``), and every writer asks
for a redacted view:

- A value that came from ``${oc.env:...}`` is shown as its expression (``${oc.env:JUDGE_KEY}``, or
  ``Bearer ${oc.env:JUDGE_TOKEN}`` where the expression was part of a string). A ``spec.yaml``
  written that way resolves again from the environment: ``relax run RUN/spec.yaml`` repeats the run.
- A value under a key named like a credential (``is_secret_name``) that did not come from the
  environment is shown as ``REDACTED``; the loader refuses a spec holding that marker, with what to
  do, rather than send it to a service.
- Where the spec's paths are unknown (the plan, messages), every string equal to an
  environment-derived value of the spec, and every occurrence of an environment variable's value
  the spec read (``MIN_SCRUBBED_CHARS`` or longer), is replaced by its expression.

The name rule (``is_secret_name``): a key, lower-cased with ``-`` read as ``_``, is a credential
when its last word is ``token``, ``secret``, ``password``, ``passwd``, ``passphrase``,
``credential(s)``, ``authorization`` or ``cookie``; when its last two words are ``api key``,
``access key``, ``secret key``, ``private key`` or ``auth key``; or when it is ``apikey``. So
``token``, ``hf_token``, ``X-Api-Key``, ``Authorization``, ``client_secret`` and
``openai_api_key`` are; ``prompt_key``, ``label_key``, ``reward_key``, ``media_keys``,
``max_tokens``, ``token_env``, the tokenizer's ``pad_token`` (and ``eos``, ``bos``, ``unk``,
``sep``, ``cls``, ``mask``) and a bare ``key`` (an id in Relax: a reward's key, a column) are not. A key ending in
``_env`` names environment variables
(``token_env``, ``headers_env``), so nothing under it is a secret.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax.errors import SpecError
    from relax.spec.models import RunSpec

#: What a credential that did not come from the environment is written as.
REDACTED = "<redacted>"
#: Shortest environment value replaced wherever it occurs inside a longer text: shorter ones
#: ("1", "true") would rewrite unrelated text, and are replaced only as whole values.
MIN_SCRUBBED_CHARS = 6
#: ``${oc.env:NAME`` (the name, then ``}`` or ``,default}``).
_ENV_EXPRESSION = re.compile(r"\$\{oc\.env:([^,}]+)")
_SECRET_LAST_WORDS = frozenset({"token", "secret", "password", "passwd", "passphrase", "credential",
                                "credentials", "authorization", "cookie"})
_SECRET_LAST_TWO = frozenset({("api", "key"), ("access", "key"), ("secret", "key"), ("private", "key"),
                              ("auth", "key")})
_SECRET_WHOLE = frozenset({"apikey"})
#: Tokenizer special tokens: text such as ``<pad>``, never a credential.
_NOT_SECRET = frozenset(f"{name}_token" for name in ("pad", "eos", "bos", "unk", "sep", "cls", "mask"))

Path_ = tuple[str | int, ...]


def is_secret_name(key: str) -> bool:
    """Whether a mapping key names a credential (the rule in the module docstring)."""
    name = str(key).lower().replace("-", "_")
    if name in _NOT_SECRET:
        return False
    words = [w for w in name.split("_") if w]
    if not words:
        return False
    return (name in _SECRET_WHOLE or words[-1] in _SECRET_LAST_WORDS
            or tuple(words[-2:]) in _SECRET_LAST_TWO)


def _names_env_variables(key: str) -> bool:
    return str(key).lower().endswith("_env")


@dataclass(frozen=True)
class Redactions:
    """What of one loaded spec must not be shown (see the module docstring).

    ``paths``: the spec's leaves (as key paths) whose value came from ``${oc.env:...}``, each with
    the text to show instead. ``values``: the value of each environment variable the spec read,
    with its expression (``{"s3cr3t": "${oc.env:JUDGE_KEY}"}``). ``leaves``: the resolved string
    of each of ``paths`` (and each of ``values``), with what to show: a plan or a row holding one
    as a whole string shows that instead."""

    paths: Mapping[Path_, Any] = field(default_factory=dict)
    values: Mapping[str, str] = field(default_factory=dict)
    leaves: Mapping[str, str] = field(default_factory=dict)

    def spec_view(self, data: dict[str, Any]) -> dict[str, Any]:
        """A spec as a plain dict (``RunSpec.model_dump(mode="json")`` or a loader's dict), for
        writing or printing: environment-derived leaves as their expressions, credentials by name
        redacted, and any leftover environment value scrubbed."""
        view = copy.deepcopy(data)
        for path, shown in self.paths.items():
            _set_at(view, path, copy.deepcopy(shown))
        return self.data_view(view)

    def data_view(self, data: Any) -> Any:
        """Any JSON-like structure (a plan, a row) with credentials by name redacted and
        environment-derived strings replaced by their expressions (paths unknown)."""
        return self._walk(data, secret=False)

    def text_view(self, text: str) -> str:
        """A text (a message, a rendered table) with every environment value the spec read
        replaced by its expression."""
        for value, expression in sorted(self.values.items(), key=lambda item: -len(item[0])):
            if len(value) >= MIN_SCRUBBED_CHARS:
                text = text.replace(value, expression)
        return text

    def _walk(self, value: Any, *, secret: bool) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if _names_env_variables(key):
                    out[key] = copy.deepcopy(item)
                else:
                    out[key] = self._walk(item, secret=secret or is_secret_name(key))
            return out
        if isinstance(value, list):
            return [self._walk(item, secret=secret) for item in value]
        if isinstance(value, str):
            shown = self._scrub(value)
            if secret and value and "${oc.env:" not in shown:
                return REDACTED
            return shown
        if secret and value is not None and not isinstance(value, bool):
            return REDACTED
        return value

    def _scrub(self, text: str) -> str:
        if text in self.leaves:
            return self.leaves[text]
        return self.text_view(text)

    def is_empty(self) -> bool:
        return not self.paths and not self.values


NONE = Redactions()


def from_resolution(unresolved: dict[str, Any], resolved: dict[str, Any], shown: dict[str, Any] | None,
                    environ: Mapping[str, str] | None = None) -> Redactions:
    """The redactions of a spec: ``unresolved`` is its merged tree before ``${...}`` resolution,
    ``resolved`` after it, and ``shown`` the tree resolved with every ``${oc.env:...}`` kept as
    text (``escape_env_expressions``; None when that could not be resolved: then each leaf whose
    text uses ``oc.env`` is shown as written)."""
    environ = os.environ if environ is None else environ
    names = sorted({name.strip() for text in strings_in(unresolved) for name in _ENV_EXPRESSION.findall(text)})
    values = {environ[name]: f"${{oc.env:{name}}}" for name in names if environ.get(name)}
    paths: dict[Path_, Any] = dict(_differences((), resolved, shown)) if shown is not None else {}
    for path, text in _leaf_items((), unresolved):
        if isinstance(text, str) and "oc.env" in text and path not in paths:
            paths[path] = text
    leaves = dict(values)
    for path, text in paths.items():
        real = _get_at(resolved, path)
        if isinstance(real, str) and isinstance(text, str) and real != text:
            leaves[real] = text
    return Redactions(paths=paths, values=values, leaves=leaves)


def escape_env_expressions(value: Any) -> Any:
    """``value`` (an unresolved spec tree) with every ``${oc.env:...}`` escaped (``\\${``, and each
    ``${`` inside it), so that omegaconf resolves it to its own text while resolving the rest."""
    if isinstance(value, dict):
        return {key: escape_env_expressions(item) for key, item in value.items()}
    if isinstance(value, list):
        return [escape_env_expressions(item) for item in value]
    if isinstance(value, str) and "${oc.env:" in value:
        return _escape(value)
    return value


def _escape(text: str) -> str:
    out, i = [], 0
    while (start := text.find("${oc.env:", i)) != -1:
        if start > 0 and text[start - 1] == "\\":  # already a literal
            out.append(text[i:start + 2])
            i = start + 2
            continue
        depth, end = 0, start
        while end < len(text):
            if text.startswith("${", end):
                depth += 1
                end += 2
                continue
            if text[end] == "}":
                depth -= 1
                if depth == 0:
                    break
            end += 1
        span = text[start:end + 1]
        out.append(text[i:start] + span.replace("${", "\\${"))
        i = end + 1
    out.append(text[i:])
    return "".join(out)


def holds_redacted(value: Any, path: Path_ = ()) -> Path_ | None:
    """The path of the first ``REDACTED`` marker in a loaded spec, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if (found := holds_redacted(item, (*path, key))) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := holds_redacted(item, (*path, index))) is not None:
                return found
    elif value == REDACTED:
        return path
    return None


def dotted(path: Path_) -> str:
    """``("rewards", 0, "options")`` as ``rewards[0].options``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def scrubbed_error(error: SpecError, redactions: Redactions) -> SpecError:
    """``error`` with every environment value the spec read replaced by its expression in its
    messages, remedies and fixes: a validation message quotes the value it refuses."""
    if redactions.is_empty():
        return error
    issues = [dataclasses.replace(issue, message=redactions.text_view(issue.message),
                                  remedy=redactions.text_view(issue.remedy),
                                  fix=tuple(redactions.text_view(item) for item in issue.fix))
              for issue in error.issues]
    return type(error)(issues)


def attach(spec: RunSpec, redactions: Redactions) -> RunSpec:
    """Give ``spec`` the redactions of the file it was loaded from (returns it). They ride on the
    instance as an undeclared private attribute (pydantic keeps it out of dumps, comparisons and
    the schema, and pickling keeps it), so the spec's fields stay exactly the file's."""
    spec._relax_redactions = redactions
    return spec


def redactions_of(spec: RunSpec) -> Redactions:
    """The redactions ``spec`` carries (none for a spec that was not loaded from a file: the name
    rule still applies)."""
    found = getattr(spec, "_relax_redactions", None)
    return found if isinstance(found, Redactions) else NONE


def spec_view(spec: RunSpec) -> dict[str, Any]:
    """``spec`` as written to run files and trackers: ``model_dump(mode="json")``, redacted."""
    return redactions_of(spec).spec_view(spec.model_dump(mode="json"))


def strings_in(value: Any) -> list[str]:
    """Every string leaf of a JSON-like tree."""
    return [leaf for _, leaf in _leaf_items((), value) if isinstance(leaf, str)]


def _leaf_items(path: Path_, value: Any) -> list[tuple[Path_, Any]]:
    if isinstance(value, dict):
        return [item for key, inner in value.items() for item in _leaf_items((*path, key), inner)]
    if isinstance(value, list):
        return [item for index, inner in enumerate(value) for item in _leaf_items((*path, index), inner)]
    return [(path, value)]


def _differences(path: Path_, real: Any, shown: Any) -> list[tuple[Path_, Any]]:
    """The paths where ``shown`` differs from ``real``, with ``shown``'s value there."""
    if isinstance(real, dict) and isinstance(shown, dict) and real.keys() == shown.keys():
        return [item for key in real for item in _differences((*path, key), real[key], shown[key])]
    if isinstance(real, list) and isinstance(shown, list) and len(real) == len(shown):
        return [item for index, (a, b) in enumerate(zip(real, shown)) for item in _differences((*path, index), a, b)]
    return [] if real == shown and type(real) is type(shown) else [(path, shown)]


def _get_at(data: Any, path: Path_) -> Any:
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _set_at(data: Any, path: Path_, value: Any) -> None:
    """Set ``value`` at ``path`` when the path exists in ``data`` (a spec dump may have turned a
    shorthand into another shape; then the value stays as it is and ``data_view`` scrubs it)."""
    if not path:
        return
    parent = _get_at(data, path[:-1])
    last = path[-1]
    if isinstance(parent, dict) and last in parent:
        parent[last] = value
    elif isinstance(parent, list) and isinstance(last, int) and 0 <= last < len(parent):
        parent[last] = value
