"""YAML and JSON reading with caps that hold *before* anything is expanded.

A spec of a few hundred bytes can describe a billion nodes with nested aliases (``&a [*b, *b, ...]``,
the "billion laughs"): PyYAML composes it cheaply, as shared nodes, but every consumer that copies
it (``OmegaConf.create``, pydantic) expands each reference. So the composer here counts, for every
node it builds, the size of the tree it stands for, an alias counting the size of what it points
to, and stops as soon as the document's count passes ``max_nodes``. It also caps nesting depth, so
a list nested hundreds deep is a clear error instead of a ``RecursionError`` further down.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

#: A spec file larger than this is not a spec (the largest preset is a few KiB).
MAX_SPEC_BYTES = 2 * 1024 * 1024
#: Nodes (scalars, lists, mappings) a spec may hold once aliases are expanded.
MAX_SPEC_NODES = 100_000
#: How deeply lists and mappings may nest (a run spec needs fewer than ten levels).
MAX_SPEC_DEPTH = 64


@dataclass(frozen=True)
class Limits:
    """The caps of one read; the defaults are those of a run spec."""

    max_bytes: int = MAX_SPEC_BYTES
    max_nodes: int = MAX_SPEC_NODES
    max_depth: int = MAX_SPEC_DEPTH


class LimitExceeded(ValueError):
    """A document past a cap: the message says which cap and by how much."""


class _CountingLoader(yaml.SafeLoader):
    """PyYAML's safe loader whose composer sizes every node as it is built (see the module doc)."""

    def __init__(self, stream: str, limits: Limits) -> None:
        super().__init__(stream)
        self._limits = limits
        self._sizes: dict[int, int] = {}
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > self._limits.max_depth:
                raise LimitExceeded(f"lists and mappings nest more than {self._limits.max_depth} deep "
                                    f"(line {self.peek_event().start_mark.line + 1})")
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        size = self._sizes.get(id(node))
        if size is None:
            size = self._size_of(node)
            self._sizes[id(node)] = size
        if size > self._limits.max_nodes:
            raise LimitExceeded(f"it expands to more than {self._limits.max_nodes} nodes (line "
                                f"{node.start_mark.line + 1}: {size} nodes once its aliases are expanded)")
        return node

    def _size_of(self, node: Node) -> int:
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            return 1
        total = 1
        for child in children:
            size = self._sizes.get(id(child))
            if size is None:  # an alias to a node still being composed: the node contains itself
                raise LimitExceeded(f"an alias at line {child.start_mark.line + 1} refers to a node that "
                                    "contains it (a recursive structure)")
            total += size
        return total


def load_yaml(text: str, limits: Limits = Limits()) -> Any:
    """``yaml.safe_load(text)`` within ``limits`` (``LimitExceeded`` past one, ``yaml.YAMLError``
    for bad syntax)."""
    loader = _CountingLoader(text, limits)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def check_json_shape(data: Any, limits: Limits = Limits()) -> None:
    """JSON has no aliases, but may nest deeply: the same node and depth caps, walked without
    recursion."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > limits.max_nodes:
            raise LimitExceeded(f"it holds more than {limits.max_nodes} nodes")
        if isinstance(value, (dict, list)):
            if depth > limits.max_depth:
                raise LimitExceeded(f"lists and mappings nest more than {limits.max_depth} deep")
            items = [v for pair in value.items() for v in pair] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


def read_text_within(path: Path, limits: Limits = Limits()) -> str:
    """The file as UTF-8 text; ``LimitExceeded`` past ``max_bytes`` (checked before reading) and
    ``UnicodeDecodeError`` for bytes that are not UTF-8."""
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise LimitExceeded(f"it is {size} bytes, more than the {limits.max_bytes} a spec file may hold")
    return path.read_bytes().decode("utf-8")


def load_json(text: str, limits: Limits = Limits()) -> Any:
    """``json.loads(text)`` within ``limits``; Python's JSON parser itself raises ``RecursionError``
    on nesting in the thousands, reported like the depth cap."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise LimitExceeded(f"lists and mappings nest more than {limits.max_depth} deep") from None
    check_json_shape(data, limits)
    return data
