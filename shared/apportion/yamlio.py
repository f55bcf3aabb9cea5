"""YAML input (budget files): PyYAML's safe loader, refusing a key given twice in one mapping.

YAML requires the keys of a mapping to be unique, but PyYAML keeps the last
value silently: a budget pasted twice with two shares would lose one of them
without a word. Every budget file the project reads goes through
:func:`load_yaml`.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["UniqueKeyLoader", "load_yaml", "problem", "where"]


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings raise ``ConstructorError`` ("found duplicate key") on a repeated key."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping of ``node``; raises ``yaml.constructor.ConstructorError`` at the second copy of a key."""
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                dup = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                dup = False
            if dup:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, UniqueKeyLoader.construct_mapping)


def load_yaml(text: str) -> Any:
    """Parse YAML ``text`` with :class:`UniqueKeyLoader` (safe: plain data only).

    Raises:
        yaml.YAMLError: a syntax error or a duplicate key (``problem_mark`` gives the line and column).
    """
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass


def where(exc: yaml.YAMLError) -> str:
    """``":<line>:<column>"`` (1-based) of an error of :func:`load_yaml`, ``""`` when unknown."""
    mark = getattr(exc, "problem_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def problem(exc: yaml.YAMLError) -> str:
    """What is wrong, in one line (``"found duplicate key 'lab/a'"``)."""
    return str(getattr(exc, "problem", None) or str(exc).splitlines()[0])
