"""Budget-file YAML: a key given twice is an error with its line and column, not a silent last-wins."""

from __future__ import annotations

import pytest
import yaml

from apportion.yamlio import load_yaml, problem, where


def test_plain_mappings_load_as_safe_load_does() -> None:
    text = "budgets:\n  lab: 1.0\n  lab/a: {share: 0.5, members: [alice]}\nlist: [1, 2]\n"
    assert load_yaml(text) == yaml.safe_load(text)


def test_duplicate_key_names_the_second_copy() -> None:
    with pytest.raises(yaml.YAMLError) as info:
        load_yaml("budgets:\n  lab: 1.0\n  lab/a: 0.5\n  lab/a: 0.7\n")
    assert (where(info.value), problem(info.value)) == (":4:3", "found duplicate key 'lab/a'")


def test_duplicate_keys_are_checked_in_nested_and_flow_mappings() -> None:
    with pytest.raises(yaml.YAMLError) as info:
        load_yaml("cluster: [{prefix: n, count: 1, count: 2}]\n")
    assert (where(info.value), problem(info.value)) == (":1:33", "found duplicate key 'count'")


def test_no_python_objects() -> None:
    with pytest.raises(yaml.YAMLError):
        load_yaml("!!python/object/apply:os.system ['true']\n")
