"""The genrm reward's options and verdict parsing (the judge itself runs in tests/runtime/test_genrm.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from relax.registry import get_registry
from relax_plugins.rewards.genrm import VerdictParser


@pytest.mark.parametrize(("reply", "expected"), [
    ("yes", 1.0), ("Yes, it is correct.", 1.0), ("NO", 0.0), ("no<eos>", 0.0), ("  yes yes", 1.0),
    ("no, not yes", 0.0),            # the first verdict counts
    ("maybe", -1.0), ("", -1.0), ("yesterday", -1.0),
])
def test_yes_no_verdicts(reply, expected):
    assert VerdictParser(r"(?i)\b(yes|no)\b", {"yes": 1.0, "no": 0.0}, -1.0)(reply) == expected


@pytest.mark.parametrize(("reply", "expected"), [
    ("Score: 7", 7.0), ("reasoning... Score: 2.5\n", 2.5), ("Score: high", 0.0), ("no score", 0.0),
])
def test_numeric_verdicts(reply, expected):
    assert VerdictParser(r"Score:\s*(\S+)", {}, 0.0)(reply) == expected


def test_graded_verdicts_with_a_score_map():
    parse = VerdictParser(r"\[\[(A|B|C)\]\]", {"a": 1.0, "b": 0.5, "c": 0.0}, 0.0)
    assert [parse(r) for r in ("[[A]]", "so [[B]]", "[[C]]", "[[D]]")] == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize(("options", "message"), [
    ({"template": "{question}: {response}"}, "unknown field(s) ['question']"),
    ({"template": "{prompt} and {label}"}, "include {response}"),
    ({"template": "{response"}, "not a valid template"),
    ({"verdict_pattern": "yes|no"}, "needs a capturing group"),
    ({"verdict_pattern": "(yes"}, "not a valid regular expression"),
    ({"dtype": "float8"}, "dtype"),
    ({"votes": 0}, "votes"),
])
def test_bad_options_are_rejected_when_validated(options, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace("{", r"\{").replace("}", r"\}")):
        get_registry().build_config("rewards", "genrm", options)


def test_literal_braces_are_allowed_in_templates():
    config = get_registry().build_config("rewards", "genrm", {"template": '{{"answer": "{response}"}}'})
    assert config.template.format(prompt="", response="4", label="") == '{"answer": "4"}'
