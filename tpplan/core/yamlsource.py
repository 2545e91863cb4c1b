"""Safe YAML parsing that remembers where every key and value came from.

PyYAML keeps the last of two duplicate keys and constructs whatever a tag asks
for; plans must do neither. We compose the node graph with the SafeLoader and
build plain Python data ourselves, so every value keeps its source position and
nothing but plain scalars, lists and mappings can come out of a plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .problems import PlanError, Problem, error
from .yamlerrors import syntax_error

Path = tuple  # of str keys and int indices, as pydantic error locations

_SCALAR_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null")}
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_MAP_TAG, _SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
# Aliases can expand exponentially ("billion laughs"); no real plan comes close.
MAX_NODES = 200_000


@dataclass
class SourceMap:
    """1-based (line, column) of each value and each mapping key, by path."""

    file: str
    values: dict[Path, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path, tuple[int, int]] = field(default_factory=dict)
    quoted_keys: set[Path] = field(default_factory=set)  # their text starts one column later

    def locate(self, path: Path, *, key: bool = False) -> tuple[int, int]:
        """Position of `path`, or of its closest ancestor that exists."""
        path = tuple(path)
        while True:
            if key and path in self.keys:
                return self.keys[path]
            if path in self.values:
                return self.values[path]
            if not path:
                return (1, 1)
            path = path[:-1]


def _pos(node: Node) -> tuple[int, int]:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


class _Builder:
    def __init__(self, loader: yaml.SafeLoader, source: SourceMap):
        self.loader = loader
        self.source = source
        self.problems: dict[Problem, None] = {}  # ordered and de-duplicated in constant time
        self.count = 0
        self.open_nodes: set[int] = set()  # ids of the collections being built, for alias cycles

    def problem(self, code: str, message: str, node: Node) -> None:
        found = error(code, message, self.source.file, *_pos(node))
        self.problems[found] = None  # an alias revisits its anchor's node: report that once

    def build(self, node: Node, path: Path) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise _TooLarge(node)
        self.source.values.setdefault(path, _pos(node))
        if isinstance(node, (MappingNode, SequenceNode)):
            if id(node) in self.open_nodes:  # `a: &x [*x]` would recurse forever
                self.problem("TP014", "this anchor contains an alias to itself: a plan cannot be recursive", node)
                return None
            self.open_nodes.add(id(node))
            try:
                return self.build_collection(node, path)
            finally:
                self.open_nodes.discard(id(node))
        if node.tag == _TIMESTAMP_TAG and node.style is None:
            return node.value  # an unquoted date in a name or description is just text
        if node.tag not in _SCALAR_TAGS:
            return self.bad_tag(node)
        return self.scalar(node)

    def scalar(self, node: ScalarNode) -> Any:
        # An explicit tag can ask for the impossible (`!!float colwise`, `!!bool null`),
        # and so can an integer past Python's 4300-digit limit: PyYAML then raises
        # plain ValueError/KeyError. Calling the constructor directly (not
        # construct_object) keeps a failed node out of the loader's caches.
        try:
            value = self.loader.yaml_constructors[node.tag](self.loader, node)
        except (ValueError, KeyError, IndexError) as exc:  # IndexError: an empty `!!int`
            kind = node.tag.rsplit(":", 1)[-1]
            if "digits" in str(exc):
                message = f"a number of {len(node.value)} characters is too long to read: no plan needs one"
            else:
                shown = node.value if len(node.value) <= 40 else node.value[:40] + "..."
                message = f"{shown!r} cannot be read as {kind}: fix the value or remove the '!!{kind}' tag"
            self.problem("TP012", message, node)
            return None
        return _whole_characters(value, node, self) if isinstance(value, str) else value

    def build_collection(self, node: MappingNode | SequenceNode, path: Path) -> Any:
        if isinstance(node, MappingNode):
            return self.build_mapping(node, path)
        if node.tag != _SEQ_TAG:
            return self.bad_tag(node)
        return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]

    def build_mapping(self, node: MappingNode, path: Path) -> dict | None:
        if node.tag != _MAP_TAG:
            return self.bad_tag(node)
        out: dict = {}
        first_seen: dict = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag not in _SCALAR_TAGS:
                self.problem("TP012", "mapping keys must be plain scalars (no lists, mappings, tags or '<<' merges)", key_node)
                continue
            key = self.scalar(key_node)
            if key in first_seen:
                self.problem(
                    "TP011",
                    f"duplicate key {key!r} (first defined at line {first_seen[key]}); "
                    "YAML would silently keep only the last one: merge or remove one",
                    key_node,
                )
                continue
            first_seen[key] = key_node.start_mark.line + 1
            self.source.keys[path + (key,)] = _pos(key_node)
            if key_node.style in ("'", '"'):
                self.source.quoted_keys.add(path + (key,))
            out[key] = self.build(value_node, path + (key,))
        return out

    def bad_tag(self, node: Node) -> None:
        self.problem(
            "TP012",
            f"tag {node.tag!r} is not allowed: plans hold only plain strings, numbers, "
            "booleans, null, lists and mappings (plans never construct objects or run code)",
            node,
        )
        return None


def _whole_characters(value: str, node: ScalarNode, builder: _Builder) -> str | None:
    """PyYAML decodes each `\\uD83D\\uDE00` escape on its own, leaving surrogate halves in the
    string (JSON writes characters beyond U+FFFF so): join each pair into its character;
    a lone half is no character at all."""
    if not any("\ud800" <= c <= "\udfff" for c in value):
        return value
    try:
        return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError:
        builder.problem("TP012", "this string holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF), which is no character", node)
        return None


class _TooLarge(Exception):
    def __init__(self, node: Node):
        self.node = node


def parse_yaml(text: str, file: str) -> tuple[Any, SourceMap]:
    """Parse one YAML document into plain data and its SourceMap; PlanError on any problem."""
    source = SourceMap(file)
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None, source
        builder = _Builder(loader, source)
        data = builder.build(node, ())
    except yaml.MarkedYAMLError as exc:
        line, col, what = syntax_error(exc, text)
        raise PlanError([error("TP010", f"YAML syntax error: {what}", file, line, col)]) from None
    except yaml.YAMLError as exc:  # e.g. ReaderError: control characters in the text
        line, col = _reader_position(exc, text)
        raise PlanError([error("TP010", f"YAML syntax error: {exc}".splitlines()[0], file, line, col)]) from None
    except _TooLarge as exc:
        line, col = _pos(exc.node)
        raise PlanError([error("TP014", f"the document expands to more than {MAX_NODES} nodes (alias bomb?)", file, line, col)]) from None
    except RecursionError:
        raise PlanError([error("TP014", "the document is nested too deeply", file)]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if builder.problems:
        raise PlanError(list(builder.problems))
    return data, source


def _reader_position(exc: yaml.YAMLError, text: str) -> tuple[int, int]:
    position = getattr(exc, "position", None)
    return (1, 1) if position is None else text_position(text, position)


# The line breaks of YAML 1.1, which PyYAML's marks count (not only '\n').
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


def text_position(text: str, index: int) -> tuple[int, int]:
    """1-based (line, column) of `text[index]`, counting lines as PyYAML does."""
    lines = _LINE_BREAK.split(text[:index])
    return (len(lines), len(lines[-1]) + 1)
