# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Protobuf text format, as far as the ``retrieval`` role reads and edits OVMS graphs (pure
functions, no I/O): a tokeniser (comments and strings included, so that a commented-out
field or one inside a string is not mistaken for a real one) and a parser that keeps each
field's offsets in the text, so that a value can be read or replaced in place.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Field", "Message", "ParseError", "Parser", "Token", "integer", "unquote"]

# Protobuf text format, as MediaPipe's graph parser reads it: '#' comments to the end of the
# line; strings in single or double quotes (no newline inside); identifiers, numbers and
# dotted names; punctuation.  A word also takes '+' and '-' so that '-1' is one token.
_TOKEN_RE = re.compile(
    r"""(?P<space>\s+)
      | (?P<comment>\#[^\n]*)
      | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
      | (?P<word>[A-Za-z0-9_.+\-]+)
      | (?P<punct>[{}\[\]<>:,;/])""",
    re.VERBOSE,
)
_CLOSING = {"{": "}", "<": ">"}
_INTEGER_RE = re.compile(r"^(?:0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)$")
_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "v": "\v",
    "\\": "\\",
    "'": "'",
    '"': '"',
    "?": "?",
}


class ParseError(Exception):
    """The graph is not protobuf text as far as the guards need to read it."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    start: int
    end: int


@dataclass
class Message:
    """A ``{ ... }`` (or ``< ... >``) block: its braces' offsets and its fields."""

    open: int
    close: int
    fields: list[Field] = field(default_factory=list)


@dataclass
class Field:
    """One field: its name (``[...]`` for an extension or ``Any``), its value, its span."""

    name: str
    start: int
    end: int  # after the value
    separator: str  # ',' or ';' when one follows, else ''
    after: int  # after the separator (== end without one)
    message: Message | None = None
    scalar: list[Token] = field(default_factory=list)


def _tokens(text: str) -> list[Token]:
    result: list[Token] = []
    position = 0
    while position < len(text):
        match = _TOKEN_RE.match(text, position)
        if match is None:
            line = text.count("\n", 0, position) + 1
            snippet = text[position : position + 10].split("\n", 1)[0]
            if text[position] in "'\"":
                raise ParseError(f"line {line}: unterminated string {snippet!r}")
            raise ParseError(f"line {line}: unexpected {snippet!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            result.append(Token(kind, match.group(), match.start(), match.end()))
        position = match.end()
    return result


class Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = [token for token in _tokens(text) if token.kind != "comment"]
        self.index = 0

    def _line(self, offset: int) -> int:
        return self.text.count("\n", 0, offset) + 1

    def _peek(self) -> Token | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def _next(self, what: str) -> Token:
        token = self._peek()
        if token is None:
            raise ParseError(f"the text ends where {what} was expected")
        self.index += 1
        return token

    def _fail(self, token: Token, what: str) -> ParseError:
        return ParseError(f"line {self._line(token.start)}: expected {what}, got {token.text!r}")

    def document(self) -> Message:
        root = Message(open=-1, close=len(self.text))
        root.fields = self._fields(None)
        return root

    def _fields(self, closing: str | None) -> list[Field]:
        fields: list[Field] = []
        while True:
            token = self._peek()
            if token is None:
                if closing is None:
                    return fields
                raise ParseError(f"the text ends inside a block: {closing!r} is missing")
            if closing is not None and token.text == closing:
                return fields
            fields.append(self._field())

    def _field(self) -> Field:
        first = self._next("a field name")
        if first.kind == "word":
            name = first.text
        elif first.text == "[":
            parts: list[str] = []
            while True:
                part = self._next("']'")
                if part.text == "]":
                    break
                if part.kind != "word" and part.text != "/":
                    raise self._fail(part, "an extension or type name")
                parts.append(part.text)
            name = "[" + "".join(parts) + "]"
        else:
            raise self._fail(first, "a field name")
        token = self._peek()
        if token is not None and token.text == ":":
            self.index += 1
        item = Field(name=name, start=first.start, end=first.end, separator="", after=0)
        self._value(item)
        token = self._peek()
        if token is not None and token.text in {",", ";"}:
            self.index += 1
            item.separator = token.text
            item.after = token.end
        else:
            item.after = item.end
        return item

    def _value(self, item: Field) -> None:
        token = self._next(f"a value for {item.name}")
        if token.text in _CLOSING:
            item.message = self._message(token)
            item.end = item.message.close + 1
        elif token.text == "[":
            item.end = self._list(token)
        elif token.kind == "string":
            item.scalar = [token]
            while (more := self._peek()) is not None and more.kind == "string":
                item.scalar.append(more)
                self.index += 1
            item.end = item.scalar[-1].end
        elif token.kind == "word":
            item.scalar = [token]
            item.end = token.end
        else:
            raise self._fail(token, f"a value for {item.name}")

    def _message(self, opening: Token) -> Message:
        closing = _CLOSING[opening.text]
        fields = self._fields(closing)
        end = self._next(repr(closing))
        return Message(open=opening.start, close=end.start, fields=fields)

    def _list(self, opening: Token) -> int:
        """Skip a ``[a, b]`` list value (no guard is a list); the offset after its ``]``."""
        while True:
            token = self._next("']'")
            if token.text == "]":
                return token.end
            if token.text in _CLOSING:
                self._message(token)
            elif token.kind not in {"word", "string"} and token.text != ",":
                raise self._fail(token, "a list element")


_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{1,2}|[0-7]{1,3}|.)")


def _unescape(match: re.Match[str]) -> str:
    code = match.group(1)
    if code[0] == "x":
        return chr(int(code[1:], 16))
    if code[0] in "01234567":
        return chr(int(code, 8))
    return _ESCAPES.get(code, match.group(0))


def unquote(tokens: Sequence[Token]) -> str:
    """The value of adjacent string literals (C escapes, as protobuf text reads them)."""
    return "".join(_ESCAPE_RE.sub(_unescape, token.text[1:-1]) for token in tokens)


def integer(tokens: Sequence[Token]) -> int | None:
    """The integer a scalar spells as protobuf reads an unsigned one (dec, hex, octal)."""
    if len(tokens) != 1 or tokens[0].kind != "word" or not _INTEGER_RE.match(tokens[0].text):
        return None
    text = tokens[0].text
    if text[:2] in {"0x", "0X"}:
        return int(text, 16)
    if len(text) > 1 and text[0] == "0":
        return int(text, 8)
    return int(text)
