"""Module-path globs (SPEC §2), matched one dot-separated segment at a time.

Within a segment: `*`, `?`, `[abc]`, `[!abc]`, `{a,b}`. A whole segment `**`
matches zero or more segments; the empty pattern is the root module.

Matching walks a tree of module names rather than testing every name against
every rule, so a literal segment is one dict lookup: resolving a plan against a
model of 12,000 modules costs milliseconds, not a regex per (rule, module).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable


class GlobSyntaxError(ValueError):
    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset  # 0-based position in the pattern


@dataclass(frozen=True)
class Segment:
    text: str
    regex: re.Pattern | None  # None: a literal segment, matched by lookup

    @property
    def is_any_depth(self) -> bool:
        return self.text == "**"

    def matches(self, name: str) -> bool:
        return name == self.text if self.regex is None else self.regex.fullmatch(name) is not None


@dataclass(frozen=True)
class Glob:
    pattern: str
    segments: tuple[Segment, ...]


def _class_end(text: str, start: int, offset: int) -> int:
    """Index of the ']' closing the class opened at `start` (a ']' first in the class is literal)."""
    first = start + (2 if text.startswith("[!", start) else 1)
    end = text.find("]", first + 1)
    if end < 0:
        raise GlobSyntaxError("'[' without a matching ']'", offset + start)
    return end


def _split_segments(pattern: str) -> list[tuple[str, int]]:
    """Split on dots outside braces and brackets; returns (segment, offset) pairs."""
    segments, start, brace, i = [], 0, None, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "[":
            i = _class_end(pattern, i, 0)
        elif ch == "{":
            if brace is not None:
                raise GlobSyntaxError("nested '{' is not supported", i)
            brace = i
        elif ch == "}":
            if brace is None:
                raise GlobSyntaxError("'}' without a matching '{'", i)
            brace = None
        elif ch == "." and brace is not None:
            raise GlobSyntaxError("'{...}' alternatives stay within one segment: no '.' inside braces", i)
        elif ch == ".":
            segments.append((pattern[start:i], start))
            start = i + 1
        i += 1
    if brace is not None:
        raise GlobSyntaxError("'{' without a matching '}'", brace)
    segments.append((pattern[start:], start))
    return segments


def _class_body(body: str) -> str:
    """A glob class body as a regex class body: ranges 'a-z' kept, every other
    character escaped ('[', '&', '~', '|', '--' are set syntax to `re`)."""
    out, j = [], 0
    while j < len(body):
        if j + 2 < len(body) and body[j + 1] == "-":
            out.append(f"{re.escape(body[j])}-{re.escape(body[j + 2])}")
            j += 3
        else:
            out.append(re.escape(body[j]))
            j += 1
    return "".join(out)


def _segment_regex(text: str, offset: int) -> str:
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == "*":
            if text.startswith("**", i):
                raise GlobSyntaxError("'**' must be a whole segment (e.g. 'a.**.b')", offset + i)
            out.append("[^.]*")
        elif ch == "?":
            out.append("[^.]")
        elif ch == "[":
            end = _class_end(text, i, offset)
            body = text[i + 1 : end]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            char_class = ("[^" if negate else "[") + _class_body(body) + "]"
            try:
                re.compile(char_class)
            except re.error as exc:  # e.g. a reversed range '[z-a]'
                raise GlobSyntaxError(f"bad character class '{text[i : end + 1]}': {exc.msg}", offset + i) from None
            out.append(char_class)
            i = end
        elif ch == "{":
            end = text.index("}", i)
            alternatives = text[i + 1 : end].split(",")
            if alternatives == [""]:
                raise GlobSyntaxError("empty alternatives '{}'", offset + i)
            regexes, at = [], i + 1  # `at`: where each alternative starts, for error offsets
            for alternative in alternatives:
                regexes.append(_segment_regex(alternative, offset + at))
                at += len(alternative) + 1
            out.append("(?:" + "|".join(regexes) + ")")
            i = end
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def compile_glob(pattern: str) -> Glob:
    """Compile a module-path glob; GlobSyntaxError (with its offset) on bad syntax."""
    if pattern == "":
        return Glob(pattern, ())
    segments = []
    for text, offset in _split_segments(pattern):
        if text == "":
            # point at the '.' itself (a trailing one leaves the empty segment past the end)
            raise GlobSyntaxError("empty path segment (a leading, trailing or doubled '.')", min(offset, len(pattern) - 1))
        if text == "**":
            segments.append(Segment(text, None))
        elif any(c in text for c in "*?[{"):
            segments.append(Segment(text, re.compile(_segment_regex(text, offset))))
        else:
            segments.append(Segment(text, None))
    return Glob(pattern, tuple(segments))


def generalize(fqn: str) -> str:
    """A glob for a module and its siblings in other blocks: layers.3.mlp -> layers.*.mlp
    (each all-digit segment, an index into a ModuleList, becomes `*`)."""
    return ".".join("*" if part.isdecimal() else part for part in fqn.split("."))


@dataclass
class _Node:
    fqn: str
    children: dict[str, "_Node"] = field(default_factory=dict)


class ModuleTree:
    """The names of `model.named_modules()` as a tree, in module order."""

    def __init__(self, names: Iterable[str]):
        self.order: dict[str, int] = {}
        self.root = _Node("")
        for index, name in enumerate(names):
            self.order[name] = index
            if name == "":
                continue
            node = self.root
            for part in name.split("."):
                child = node.children.get(part)
                if child is None:
                    child = node.children[part] = _Node(f"{node.fqn}.{part}" if node.fqn else part)
                node = child

    def match(self, glob: Glob, under: str = "") -> list[str]:
        """Concrete module paths the glob matches, in module order; with `under`, the glob
        is relative to that module (the paths returned are still whole)."""
        found: dict[str, None] = {}
        self._walk(self.node(under), glob.segments, found, set())
        return sorted((f for f in found if f in self.order), key=self.order.__getitem__)

    def node(self, fqn: str) -> _Node:
        """The node of a module path that is in the tree."""
        node = self.root
        for part in fqn.split(".") if fqn else ():
            node = node.children[part]
        return node

    def _walk(self, node: _Node, segments: tuple[Segment, ...], found: dict, seen: set) -> None:
        key = (node.fqn, len(segments))
        if key in seen:  # several '**' can reach the same place by different routes
            return
        seen.add(key)
        if not segments:
            found[node.fqn] = None
            return
        head, rest = segments[0], segments[1:]
        if head.is_any_depth:
            self._walk(node, rest, found, seen)
            for child in node.children.values():
                self._walk(child, segments, found, seen)
        elif head.regex is None:
            child = node.children.get(head.text)
            if child is not None:
                self._walk(child, rest, found, seen)
        else:
            for name, child in node.children.items():
                if head.regex.fullmatch(name):
                    self._walk(child, rest, found, seen)

    def explain_no_match(self, glob: Glob, under: str = "") -> str:
        """Why a glob matches nothing (relative to `under`, as `match`): the first segment
        that fails, and the closest names there."""
        from difflib import get_close_matches  # error path only: keep start-up lean

        wrapper = None if under else self._wrapper_of(glob)
        if wrapper is not None:
            prefix, found = wrapper
            return (f"the model is wrapped (peft's get_peft_model and the like): under '{prefix}' it matches {found}; "
                    f"did you mean '{prefix}.{glob.pattern}'?")
        nodes = [self.node(under)]
        for i, segment in enumerate(glob.segments):
            if segment.is_any_depth:
                return self._closest_below(nodes, glob.segments[i + 1 :])
            next_nodes = [c for n in nodes for name, c in n.children.items() if segment.matches(name)]
            if not next_nodes:
                prefix = ".".join(s.text for s in glob.segments[:i])
                names = sorted({name for n in nodes for name in n.children})
                where = f"modules matching '{prefix}'" if prefix else f"'{under}'" if under else "the root module"
                if not names:
                    return f"{where} {'have' if prefix else 'has'} no submodules"
                close = get_close_matches(segment.text, names, n=3, cutoff=0.5)
                hint = " or ".join(
                    repr(".".join([*(s.text for s in glob.segments[:i]), c, *(s.text for s in glob.segments[i + 1 :])]))
                    for c in close
                )
                listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
                return (f"no child of {where} matches '{segment.text}' (children: {listed})"
                        + (f"; did you mean {hint}?" if hint else ""))
            nodes = next_nodes
        return "closest module paths: none"  # only a root pattern '' on a name list without the root

    def _wrapper_of(self, glob: Glob, depth: int = 4) -> tuple[str, str] | None:
        """(prefix, first match) when the glob matches below a wrapper's prefix (peft's
        `base_model.model`): the shallowest such module, within `depth` levels."""
        if not glob.segments or glob.segments[0].is_any_depth:
            return None
        level = list(self.root.children.values())
        for _ in range(depth):
            for node in level:
                found: dict[str, None] = {}
                self._walk(node, glob.segments, found, set())
                if found:
                    return node.fqn, next(iter(found))
            level = [c for n in level for c in n.children.values()]
        return None

    def _closest_below(self, nodes: list[_Node], tail: tuple[Segment, ...]) -> str:
        """Past '**' any depth is possible: compare what follows it with the same
        number of trailing segments of each path below, and name those paths."""
        from difflib import get_close_matches
        wanted = ".".join(s.text for s in tail)
        first_path_by_tail: dict[str, str] = {}
        stack = [c for n in reversed(nodes) for c in reversed(list(n.children.values()))]
        while stack and len(first_path_by_tail) < 5000:  # bounded: a hint, not a search
            node = stack.pop()
            parts = node.fqn.split(".")
            if len(parts) >= len(tail):
                first_path_by_tail.setdefault(".".join(parts[len(parts) - len(tail) :]), node.fqn)
            stack.extend(reversed(list(node.children.values())))
        close = get_close_matches(wanted, list(first_path_by_tail), n=3, cutoff=0.5)
        return "closest module paths: " + (", ".join(first_path_by_tail[c] for c in close) if close else "none")
