"""Where a YAML syntax error is: the line to fix, not the place PyYAML gave up.

PyYAML stops where it can no longer go on, which is often a line after the
mistake: an unclosed `{`, `[` or quote runs to the end of the file, a key
without its ':' is found out on the next line. Its error carries a second mark,
the context (the `{` it was parsing, the quote it was scanning, the key it was
reading), and its tokens show what came before; this module turns the two into
the position of the mistake and says where the parser stopped.
"""

from __future__ import annotations

import re

import yaml

_FLOW = re.compile(r"while parsing a flow (mapping|sequence)")
_CLOSER = {"mapping": "}", "sequence": "]"}


def syntax_error(exc: yaml.MarkedYAMLError, text: str) -> tuple[int, int, str]:
    """(line, column, message) of a YAML syntax error, 1-based, at the offending line."""
    problem, context = exc.problem_mark, exc.context_mark
    what = " ".join(s for s in (exc.context, exc.problem) if s)
    if problem is None:
        return (context.line + 1, context.column + 1, what) if context else (1, 1, what)
    stopped = f"{problem.line + 1}:{problem.column + 1}"
    at_end = any(end in (exc.problem or "") for end in ("end of stream", "<stream end>"))
    flow = _FLOW.match(exc.context or "")
    if flow and context is not None and (at_end or problem.line > context.line):
        opener = "{" if flow.group(1) == "mapping" else "["
        closer = _CLOSER[flow.group(1)]
        if at_end or _has_content_after(text, context):
            return (context.line + 1, context.column + 1,
                    f"this '{opener}' is never closed: {exc.problem} at {stopped}; close it with '{closer}'")
        tokens = _tokens_before(text, problem.index)
        if tokens:  # a flow collection written over lines: a ',' missing at the end of a line
            line, column = _end_of_first_line(text, tokens[-1])
            return (line, column,
                    f"{what} at {stopped}: a ',' missing here, or the '{opener}' at "
                    f"{context.line + 1}:{context.column + 1} not closed with '{closer}'")
    if exc.context and exc.context.startswith("while scanning") and context is not None and problem.line > context.line:
        # an unclosed quote, a key with no ':' found before the next line: the thing being scanned
        if exc.context == "while scanning a quoted scalar" and at_end:
            what = "this quoted string is never closed: " + exc.problem
        return (context.line + 1, context.column + 1, f"{what} (at {stopped})")
    if exc.problem == "mapping values are not allowed here":
        runaway = _plain_text_begun_on_an_earlier_line(text, problem)
        if runaway is not None:
            written = text[runaway.start_mark.index:].split("\n", 1)[0].rstrip()
            return (runaway.start_mark.line + 1, runaway.start_mark.column + 1,
                    f"{what} (the ':' at {stopped}): {written!r} has no ':' after its key, so YAML reads "
                    "it and the next line as one text; add the ':'")
    if "'\\t'" in (exc.problem or ""):
        what += " (YAML indents with spaces; a tab cannot start a key or a value)"
    return problem.line + 1, problem.column + 1, what


def _has_content_after(text: str, mark: yaml.Mark) -> bool:
    """Whether anything but a comment follows the mark's character on its line."""
    line = text[mark.index + 1:].split("\n", 1)[0]
    return bool(line.split(" #", 1)[0].strip()) and not line.lstrip().startswith("#")


def _tokens_before(text: str, index: int) -> list[yaml.Token]:
    """The tokens that end at or before `index`, scanned until the scanner stops."""
    tokens = []
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if token.end_mark.index > index:
                break
            tokens.append(token)
    except yaml.YAMLError:  # the scanner's own error: the tokens before it are what we need
        pass
    return tokens


def _end_of_first_line(text: str, token: yaml.Token) -> tuple[int, int]:
    """1-based position just after the token's text on its first line (a plain scalar in
    a flow collection runs on over line breaks: `colwise` / `b` is one scalar)."""
    start = token.start_mark
    line = text[start.index:].split("\n", 1)[0] if start.line < token.end_mark.line else text[start.index:token.end_mark.index]
    return start.line + 1, start.column + 1 + len(line.rstrip())


def _plain_text_begun_on_an_earlier_line(text: str, problem: yaml.Mark) -> yaml.ScalarToken | None:
    """The plain scalar just before a misplaced ':', when it began an earlier line: a key
    written without its ':', which YAML joined with the next line (`a colwise` / `b: x`)."""
    tokens = _tokens_before(text, problem.index)
    if not tokens or not isinstance(tokens[-1], yaml.ScalarToken) or not tokens[-1].plain:
        return None
    scalar = tokens[-1]
    if scalar.start_mark.line >= problem.line:
        return None
    line_start = text.rfind("\n", 0, scalar.start_mark.index) + 1
    before = text[line_start:scalar.start_mark.index]
    return scalar if before.strip() in ("", "-") else None
