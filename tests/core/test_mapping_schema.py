"""A mapping file is checked before it is trusted: values of the wrong type are one clear error, never misread."""

from __future__ import annotations

import pytest

from tensordiff.errors import MappingError
from tensordiff.mapping import RenameRules

HEAD = "tensordiff_mapping: 1\n"


@pytest.mark.parametrize(("body", "message"), [
    ("order_fallback: 'no'\nrules: []\n", "order_fallback must be true or false, unquoted (got 'no')"),
    ("order_fallback: 0\nrules: []\n", "order_fallback must be true or false, unquoted (got 0)"),
    ("rules:\n  - {a: decoder, b: [1]}\n", "rule 1: 'a:' must be a module name and 'b:' a regex or a list of them"),
    ("rules:\n  - {a: 7, b: 'x'}\n", "rule 1: 'a:' must be a module name"),
    ("rules:\n  - {a: decoder, b: 'x', kinds: output}\n", "rule 1: 'kinds:' must be a list"),
    ("ignore_a:\n  - [1, 2]\nrules: []\n", "ignore_a: an entry is a module regex (text)"),
])
def test_a_value_of_the_wrong_type_is_named(body, message):
    with pytest.raises(MappingError) as err:
        RenameRules.from_text(HEAD + body, "m.yaml")
    assert str(err.value).startswith("m.yaml: ") and message in str(err.value)


def test_a_false_order_fallback_is_read_as_false():
    assert RenameRules.from_text(HEAD + "order_fallback: false\nrules: []\n", "m.yaml").order_fallback is False
