"""Controller-side computations for the ``retrieval`` role (pure functions, no I/O).

Two jobs, both from seed ``000`` ("Retrieval on the idle iGPUs", its September update):

* the OVMS container's memory cap, computed from the rerank graph's two guards with the
  seed's measured cost model (:func:`retrieval_memory_plan`);
* the two guards themselves, written into every rerank ``graph.pbtxt`` and read back
  (:func:`retrieval_graph_guards`, :func:`retrieval_graph_guards_check`).

The cost model
==============

On an integrated GPU every allocation OpenVINO makes is a pinned, unevictable shmem page
charged to the container's cgroup, so the container's memory limit *is* the GPU's memory
budget.  The seed measured, with the cgroup's own ``memory.peak`` read inside the container:

* one rerank call is one ``rows x T`` tensor (``T`` is the width of the longest, padded
  row); its pool costs about ``0.0202 GiB x (T / 332) ** 1.78`` per row (seed table:
  64 x 332 -> 1.29 GiB, 40 x 498 -> 1.69 GiB, 50 x 511 -> 2.17 GiB);
* the weights stay pinned after load: a baseline of 1.71 GiB;
* the pool never shrinks (only a restart resets it), and when a larger call comes the
  older pool is still held while the new one is allocated: the ascending sequence 20, 40,
  64 documents peaked at 8.49 GiB where one call of 64 on a fresh pool peaked at 5.67 GiB.

Under the guards, ``rows <= max_allowed_chunks`` (OVMS refuses a request whose documents
chunk into more, with HTTP 400) and ``T <= max_position_embeddings`` (each row is the query,
four special tokens and a chunk, cut to fit that width; ``rerank_calculator_ov.cc``).  So
the largest call costs ``C = max_allowed_chunks x 0.0202 GiB x (max_position_embeddings /
332) ** 1.78`` and:

* one largest call on a fresh pool peaks at ``B + C`` (also the highest resident floor the
  guards allow);
* a call that is larger than the pool held allocates its own pool while the held one is
  still there, so a sequence peaks at ``B + held + next``; the worst sequence is a call just
  below the largest followed by the largest: ``B + 2 C`` (a supremum; ``64 x 639`` then
  ``64 x 640`` comes within 0.3 % of it).  The seed's 20, 40, 64 sequence is one instance
  (``B + C(40) + C(64)``), and the cap is sized for the worst one, not for that one.

Reproduction (``T = max_position_embeddings = 640`` for the two totals): the table's three
points within -1.6 % .. +0.3 %, the sequence 8.49 GiB as 8.47 GiB (-0.3 %), the single call
5.67 GiB as 5.87 GiB (+3.5 %, on the safe side).  Every point is within
:data:`CALIBRATION_TOLERANCE` (4 %).  The model is calibrated on 20 to 64 rows and widths
332 to 640 tokens; outside that it extrapolates (:func:`retrieval_memory_plan` says so).

What the model does not hold: the embeddings servable's request pools (the seed measured
none; ``bge-m3``'s weights are in the baseline), and more than one stream.

``NUM_STREAMS``.  The seed did not measure it; it says each stream "carries its own set of
those pinned, unevictable buffers: more streams multiply the peak".  Assumed here: the pools
multiply by the number of streams (each stream can run its own largest call with its own
ratchet) while the weights are compiled and held once: ``B + 2 x streams x C``.  That is an
assumption, not a measurement; measure a batch curve before raising ``NUM_STREAMS``.

The guards
==========

``RerankCalculatorOVOptions`` (``src/rerank/rerank_calculator_ov.proto`` of OVMS) carries
``max_allowed_chunks`` (default 10000) and ``max_position_embeddings`` (default: the model's
``config.json``).  ``export_model.py rerank_ov`` writes neither into the graph, so the role
sets both, and re-reads each graph after writing: a substitution that silently matched
nothing would otherwise ship a graph without its guard while every other signal says green.
The graph is protobuf text; it is tokenised here (comments and strings included), so a
commented-out guard or one inside a string is not mistaken for the real field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    human_size,
    parse_number,
    parse_size,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_utilization import (
    parse_reservations,
)

__all__ = [
    "BASELINE_BYTES",
    "CALIBRATION_TOLERANCE",
    "DEFAULT_HEADROOM",
    "DEFAULT_MAX_ALLOWED_CHUNKS",
    "DEFAULT_MAX_POSITION_EMBEDDINGS",
    "DEFAULT_NUM_STREAMS",
    "GUARD_VARIABLES",
    "RERANK_CALCULATOR",
    "RetrievalError",
    "RetrievalTypeError",
    "call_bytes",
    "retrieval_graph_guards",
    "retrieval_graph_guards_check",
    "retrieval_graph_settings_check",
    "retrieval_memory_plan",
    "retrieval_rerank_probe",
    "retrieval_reservation_check",
    "sequence_peak_bytes",
]

KIB = 1024
MIB = 1024**2
GIB = 1024**3

# The seed's cost model (September update of seed 000), see the module docstring.
ROW_COST_GIB = 0.0202  # one row of the rerank tensor at the reference width
REFERENCE_TOKENS = 332  # the width the per-row cost was measured at (64 x 332 -> 1.29 GiB)
TOKEN_EXPONENT = 1.78  # near-quadratic in the width: attention is rows x heads x T x T
BASELINE_GIB = 1.71  # pinned after load: the weights ("Baseline after load is 1.71 GiB")
BASELINE_BYTES = math.ceil(BASELINE_GIB * GIB)
# Every seed measurement is reproduced within this relative error (tests show it).
CALIBRATION_TOLERANCE = 0.04
# The measured domain: rows 20 (the sequence's first call) to 64, widths 332 to 640.
CALIBRATED_ROWS = (20, 64)
CALIBRATED_TOKENS = (332, 640)

DEFAULT_MAX_ALLOWED_CHUNKS = 64
DEFAULT_MAX_POSITION_EMBEDDINGS = 640
DEFAULT_NUM_STREAMS = 1
DEFAULT_HEADROOM = 0.70

# rerank_calculator_ov.cc: NUMBER_OF_SPECIAL_TOKENS = 4; Open() refuses a
# max_position_embeddings of 2 x 4 or less for a tokenizer that adds a BOS token.
SPECIAL_TOKENS = 4
OVMS_DEFAULT_MAX_ALLOWED_CHUNKS = 10000

RERANK_CALCULATOR = "RerankCalculatorOV"
_OPTIONS_TYPE = "mediapipe.RerankCalculatorOVOptions"

# The role's variables, named in messages.
GUARD_VARIABLES = {
    "max_allowed_chunks": "retrieval_max_allowed_chunks",
    "max_position_embeddings": "retrieval_max_position_embeddings",
}
_NUM_STREAMS_VARIABLE = "retrieval_num_streams"
_HEADROOM_VARIABLE = "retrieval_memory_headroom"
_LIMIT_VARIABLE = "retrieval_memory_limit"
_WATCHDOG_VARIABLE = "retrieval_watchdog_bound"


class RetrievalError(ValueError):
    """A value the role cannot use; the message names the variable, the value and the fix."""


class RetrievalTypeError(RetrievalError, TypeError):
    """A value of the wrong type; the message names the variable and what it got."""


def _converted(err: VllmTuningError) -> RetrievalError:
    """The shared parsers' error as this module's, with the same message."""
    kind = RetrievalTypeError if isinstance(err, TypeError) else RetrievalError
    return kind(str(err))


# --------------------------------------------------------------------------- inputs


def _whole(value: object, variable: str, expected: str, example: str, minimum: int) -> int:
    try:
        number = parse_number(value, variable, expected, example, whole=True)
    except VllmTuningError as err:
        raise _converted(err) from err
    if number < minimum:
        raise RetrievalError(f"{variable}: expected {expected}, got {number!r}")
    return number


def _chunks(value: object) -> int:
    return _whole(
        value,
        GUARD_VARIABLES["max_allowed_chunks"],
        "a whole number of chunks per request, 1 or more",
        str(DEFAULT_MAX_ALLOWED_CHUNKS),
        1,
    )


def _positions(value: object) -> int:
    variable = GUARD_VARIABLES["max_position_embeddings"]
    number = _whole(
        value,
        variable,
        "a whole number of tokens per row, 1 or more",
        str(DEFAULT_MAX_POSITION_EMBEDDINGS),
        1,
    )
    if number <= 2 * SPECIAL_TOKENS:
        raise RetrievalError(
            f"{variable}: {number} tokens leaves no room for a document: OVMS refuses a "
            f"max_position_embeddings of {2 * SPECIAL_TOKENS} or less (four special tokens "
            f"and the query share each row); the seed's guard is "
            f"{DEFAULT_MAX_POSITION_EMBEDDINGS}"
        )
    return number


def _streams(value: object) -> int:
    return _whole(value, _NUM_STREAMS_VARIABLE, "a whole number of streams, 1 or more", "1", 1)


def _headroom(value: object) -> Fraction:
    expected = "the largest share of the cap the worst sequence may use, in (0, 1]"
    try:
        number = parse_number(value, _HEADROOM_VARIABLE, expected, str(DEFAULT_HEADROOM))
    except VllmTuningError as err:
        raise _converted(err) from err
    if not 0 < number <= 1:
        raise RetrievalError(
            f"{_HEADROOM_VARIABLE}: expected {expected}, got {number!r}; the seed's test plan "
            f"held the peak under {DEFAULT_HEADROOM:.0%} of the cap"
        )
    return Fraction(str(number))


def _limit(value: object) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value, _LIMIT_VARIABLE)
    except VllmTuningError as err:
        raise _converted(err) from err


def _size(value: object, variable: str) -> int:
    try:
        return parse_size(value, variable)
    except VllmTuningError as err:
        raise _converted(err) from err


# --------------------------------------------------------------------------- memory


def call_bytes(rows: int, tokens: int) -> int:
    """The pool one rerank call of ``rows x tokens`` allocates, in bytes (seed's model)."""
    per_row = ROW_COST_GIB * float((tokens / REFERENCE_TOKENS) ** TOKEN_EXPONENT)
    return math.ceil(rows * per_row * GIB)


def sequence_peak_bytes(calls: Sequence[tuple[int, int]]) -> int:
    """The peak of ``calls`` (``(rows, tokens)`` each, in order) on a fresh server, one stream.

    The pool held is that of the largest call so far; a larger call allocates its own pool
    while the held one is still there (peak ``baseline + held + new``) and then replaces it;
    a call that is not larger reuses the pool held.
    """
    held = 0
    peak = BASELINE_BYTES
    for rows, tokens in calls:
        cost = call_bytes(rows, tokens)
        if cost > held:
            peak = max(peak, BASELINE_BYTES + held + cost)
            held = cost
    return peak


def _worst(chunks: int, positions: int, streams: int) -> int:
    return BASELINE_BYTES + 2 * streams * call_bytes(chunks, positions)


def _fits(chunks: int, positions: int, streams: int, headroom: Fraction, limit: int) -> bool:
    return _worst(chunks, positions, streams) <= headroom * limit


def _largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest ``n`` in ``[low, high]`` with ``fits(n)`` (monotonic), or None."""
    if low > high or not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _ceil_mib(size: int | Fraction) -> int:
    return math.ceil(Fraction(size) / MIB) * MIB


def retrieval_memory_plan(
    max_allowed_chunks: object = DEFAULT_MAX_ALLOWED_CHUNKS,
    max_position_embeddings: object = DEFAULT_MAX_POSITION_EMBEDDINGS,
    num_streams: object = DEFAULT_NUM_STREAMS,
    headroom: object = DEFAULT_HEADROOM,
    memory_limit: object = None,
    watchdog_bound: object = None,
) -> dict[str, object]:
    """The OVMS container's memory cap for the rerank guards, or a check of a given cap.

    Returns the guards and settings as read, ``baseline_bytes`` (pinned weights),
    ``call_bytes`` (the largest call's pool, one stream), ``single_call_peak_bytes`` (one
    largest call per stream on a fresh pool: also the highest floor the guards allow),
    ``worst_sequence_peak_bytes``, ``required_memory_limit_bytes`` (the smallest cap, in
    whole MiB, that keeps the worst sequence within ``headroom``), ``memory_limit_bytes``
    (``memory_limit`` when given, else the required cap), ``memory_limit_computed``,
    ``worst_sequence_fraction`` (of the cap), ``floor_bound_bytes`` (the highest resident
    floor under which one more largest call per stream still stays within ``headroom`` of
    the cap: the ratchet watchdog's bound; with the computed cap it is the single call's
    peak), ``watchdog_bound_bytes`` (``watchdog_bound`` when given, else the floor bound;
    a given bound at or below the pinned weights is refused: the watchdog would restart the
    server on every run) and ``within_calibration`` (false when the
    guards lie outside the measured 20..64 rows and 332..640 tokens: the model then
    extrapolates).  A given ``memory_limit`` that cannot hold the worst sequence within
    ``headroom`` is refused, naming the variables, their values, the need and the fix.
    """
    chunks = _chunks(max_allowed_chunks)
    positions = _positions(max_position_embeddings)
    streams = _streams(num_streams)
    share = _headroom(headroom)
    given = _limit(memory_limit)

    bound = None if watchdog_bound is None else _size(watchdog_bound, _WATCHDOG_VARIABLE)
    if bound is not None and bound <= BASELINE_BYTES:
        raise RetrievalError(
            f"{_WATCHDOG_VARIABLE}: {human_size(bound)} is at or below the pinned weights "
            f"({human_size(BASELINE_BYTES)}), so the watchdog would restart the server on every "
            f"run; give more, or null for the plan's bound"
        )
    call = call_bytes(chunks, positions)
    worst = _worst(chunks, positions, streams)
    required = _ceil_mib(worst / share)
    limit = required if given is None else given
    floor_bound = math.floor(share * limit) - streams * call
    if given is not None and not _fits(chunks, positions, streams, share, given):
        raise RetrievalError(_refusal(chunks, positions, streams, share, given, required))
    return {
        "max_allowed_chunks": chunks,
        "max_position_embeddings": positions,
        "num_streams": streams,
        "headroom": float(share),
        "baseline_bytes": BASELINE_BYTES,
        "call_bytes": call,
        "single_call_peak_bytes": BASELINE_BYTES + streams * call,
        "worst_sequence_peak_bytes": worst,
        "required_memory_limit_bytes": required,
        "memory_limit_bytes": limit,
        "memory_limit_computed": given is None,
        "worst_sequence_fraction": round(worst / limit, 4),
        "floor_bound_bytes": floor_bound,
        "watchdog_bound_bytes": floor_bound if bound is None else bound,
        "within_calibration": (
            CALIBRATED_ROWS[0] <= chunks <= CALIBRATED_ROWS[1]
            and CALIBRATED_TOKENS[0] <= positions <= CALIBRATED_TOKENS[1]
        ),
    }


def _percent(fraction: float | Fraction) -> str:
    return f"{float(fraction) * 100:.1f}".rstrip("0").rstrip(".") + "%"


def _refusal(
    chunks: int, positions: int, streams: int, share: Fraction, limit: int, required: int
) -> str:
    chunks_var = GUARD_VARIABLES["max_allowed_chunks"]
    positions_var = GUARD_VARIABLES["max_position_embeddings"]
    call = call_bytes(chunks, positions)
    worst = _worst(chunks, positions, streams)
    pools = "the held pool and the next" if streams == 1 else f"{streams} streams x 2 pools"
    message = (
        f"{_LIMIT_VARIABLE}: {human_size(limit)} cannot hold the rerank guards' worst "
        f"sequence within {_HEADROOM_VARIABLE} ({_percent(share)} of the cap): with "
        f"{chunks_var}={chunks} and {positions_var}={positions} "
        f"({_NUM_STREAMS_VARIABLE}={streams}) it peaks at about {human_size(worst)} (the "
        f"pinned weights {human_size(BASELINE_BYTES)} + {pools} of {human_size(call)} each, "
        f"the older pool still held while the next is allocated), {_percent(worst / limit)} "
        f"of the cap; that needs {human_size(required)} or more. Raise {_LIMIT_VARIABLE} to "
        f"'{required // MIB}m' (or leave it null to have it computed)"
    )
    lower: list[str] = []
    fitting_chunks = _largest_fitting(
        1, chunks - 1, lambda n: _fits(n, positions, streams, share, limit)
    )
    if fitting_chunks is not None:
        lower.append(f"{chunks_var} to {fitting_chunks}")
    fitting_positions = _largest_fitting(
        2 * SPECIAL_TOKENS + 1, positions - 1, lambda n: _fits(chunks, n, streams, share, limit)
    )
    if fitting_positions is not None:
        lower.append(f"{positions_var} to {fitting_positions}")
    if streams > 1 and _fits(chunks, positions, 1, share, limit):
        lower.append(f"{_NUM_STREAMS_VARIABLE} to 1")
    if lower:
        message += ", or lower " + " or ".join(lower) + ", which fit under this cap"
    elif share * limit < BASELINE_BYTES:
        message += (
            f"; this cap is below even the pinned weights ({human_size(BASELINE_BYTES)}) "
            "within the headroom"
        )
    return (
        message + ". Seed lesson: a single call on a fresh pool (5.67 GiB) sized the 10Gi cap; "
        "the ascending sequence 20, 40, 64 documents peaked at 8.49 GiB, 84.9% of it."
    )


# --------------------------------------------------------------------------- protobuf text

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


class _ParseError(Exception):
    """The graph is not protobuf text as far as the guards need to read it."""


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    start: int
    end: int


@dataclass
class _Message:
    """A ``{ ... }`` (or ``< ... >``) block: its braces' offsets and its fields."""

    open: int
    close: int
    fields: list[_Field] = field(default_factory=list)


@dataclass
class _Field:
    """One field: its name (``[...]`` for an extension or ``Any``), its value, its span."""

    name: str
    start: int
    end: int  # after the value
    separator: str  # ',' or ';' when one follows, else ''
    after: int  # after the separator (== end without one)
    message: _Message | None = None
    scalar: list[_Token] = field(default_factory=list)


def _tokens(text: str) -> list[_Token]:
    result: list[_Token] = []
    position = 0
    while position < len(text):
        match = _TOKEN_RE.match(text, position)
        if match is None:
            line = text.count("\n", 0, position) + 1
            snippet = text[position : position + 10].split("\n", 1)[0]
            if text[position] in "'\"":
                raise _ParseError(f"line {line}: unterminated string {snippet!r}")
            raise _ParseError(f"line {line}: unexpected {snippet!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            result.append(_Token(kind, match.group(), match.start(), match.end()))
        position = match.end()
    return result


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = [token for token in _tokens(text) if token.kind != "comment"]
        self.index = 0

    def _line(self, offset: int) -> int:
        return self.text.count("\n", 0, offset) + 1

    def _peek(self) -> _Token | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def _next(self, what: str) -> _Token:
        token = self._peek()
        if token is None:
            raise _ParseError(f"the text ends where {what} was expected")
        self.index += 1
        return token

    def _fail(self, token: _Token, what: str) -> _ParseError:
        return _ParseError(f"line {self._line(token.start)}: expected {what}, got {token.text!r}")

    def document(self) -> _Message:
        root = _Message(open=-1, close=len(self.text))
        root.fields = self._fields(None)
        return root

    def _fields(self, closing: str | None) -> list[_Field]:
        fields: list[_Field] = []
        while True:
            token = self._peek()
            if token is None:
                if closing is None:
                    return fields
                raise _ParseError(f"the text ends inside a block: {closing!r} is missing")
            if closing is not None and token.text == closing:
                return fields
            fields.append(self._field())

    def _field(self) -> _Field:
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
        item = _Field(name=name, start=first.start, end=first.end, separator="", after=0)
        self._value(item)
        token = self._peek()
        if token is not None and token.text in {",", ";"}:
            self.index += 1
            item.separator = token.text
            item.after = token.end
        else:
            item.after = item.end
        return item

    def _value(self, item: _Field) -> None:
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

    def _message(self, opening: _Token) -> _Message:
        closing = _CLOSING[opening.text]
        fields = self._fields(closing)
        end = self._next(repr(closing))
        return _Message(open=opening.start, close=end.start, fields=fields)

    def _list(self, opening: _Token) -> int:
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


def _unquote(tokens: Sequence[_Token]) -> str:
    """The value of adjacent string literals (C escapes, as protobuf text reads them)."""
    return "".join(_ESCAPE_RE.sub(_unescape, token.text[1:-1]) for token in tokens)


def _integer(tokens: Sequence[_Token]) -> int | None:
    """The integer a scalar spells as protobuf reads an unsigned one (dec, hex, octal)."""
    if len(tokens) != 1 or tokens[0].kind != "word" or not _INTEGER_RE.match(tokens[0].text):
        return None
    text = tokens[0].text
    if text[:2] in {"0x", "0X"}:
        return int(text, 16)
    if len(text) > 1 and text[0] == "0":
        return int(text, 8)
    return int(text)


@dataclass
class _RerankNode:
    label: str
    blocks: list[_Message]


def _calculator(node: _Message) -> str | None:
    for item in node.fields:
        if item.name == "calculator" and item.scalar and item.scalar[0].kind == "string":
            return _unquote(item.scalar)
    return None


def _is_rerank_options(name: str) -> bool:
    if not name.startswith("["):
        return False
    inner = name[1:-1]
    return inner == f"{_OPTIONS_TYPE}.ext" or inner.endswith(f"/{_OPTIONS_TYPE}")


def _option_blocks(node: _Message) -> Iterator[_Message]:
    """``node_options { [type.googleapis.com/...Options] {...} }`` or ``options { [...ext] }``."""
    for item in node.fields:
        if item.name in {"node_options", "options"} and item.message is not None:
            for inner in item.message.fields:
                if inner.message is not None and _is_rerank_options(inner.name):
                    yield inner.message


def _graph(text: object) -> tuple[str, list[_RerankNode], list[str]]:
    """Parse ``text``: the text, its rerank nodes and the calculators of all its nodes."""
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise RetrievalTypeError(
            f"graph: expected the text of a graph.pbtxt (a string), got {kind}"
        )
    root = _Parser(text).document()
    nodes: list[_RerankNode] = []
    calculators: list[str] = []
    for index, item in enumerate(entry for entry in root.fields if entry.name == "node"):
        if item.message is None:
            continue
        calculator = _calculator(item.message)
        calculators.append(calculator or "?")
        if calculator != RERANK_CALCULATOR:
            continue
        name = next(
            (
                _unquote(entry.scalar)
                for entry in item.message.fields
                if entry.name == "name" and entry.scalar and entry.scalar[0].kind == "string"
            ),
            None,
        )
        label = f"node {name!r}" if name else f"node #{index + 1}"
        nodes.append(_RerankNode(label=label, blocks=list(_option_blocks(item.message))))
    return text, nodes, calculators


def _guards(max_allowed_chunks: object, max_position_embeddings: object) -> dict[str, int]:
    return {
        "max_allowed_chunks": _chunks(max_allowed_chunks),
        "max_position_embeddings": _positions(max_position_embeddings),
    }


def _no_rerank(calculators: Sequence[str]) -> str:
    found = ", ".join(calculators) if calculators else "none"
    return (
        f"graph: no {RERANK_CALCULATOR} node (the graph's calculators: {found}); the guards "
        "belong in the rerank model's graph.pbtxt as export_model.py rerank_ov writes it"
    )


def _no_block(label: str) -> str:
    return (
        f"graph: the {RERANK_CALCULATOR} {label} has no [type.googleapis.com/{_OPTIONS_TYPE}] "
        "options block to hold the guards; re-export the model with export_model.py rerank_ov"
    )


def _default_note(name: str) -> str:
    if name == "max_allowed_chunks":
        return f"OVMS then allows {OVMS_DEFAULT_MAX_ALLOWED_CHUNKS} chunks"
    return "OVMS then takes the model's own, from its config.json"


def retrieval_graph_guards_check(
    text: object,
    max_allowed_chunks: object = DEFAULT_MAX_ALLOWED_CHUNKS,
    max_position_embeddings: object = DEFAULT_MAX_POSITION_EMBEDDINGS,
) -> list[str]:
    """What is wrong with the guards of a rerank ``graph.pbtxt``; empty when both are right.

    Each problem names the node, the guard and its role variable, what was found and what
    was expected: a graph that is not protobuf text, no ``RerankCalculatorOV`` node, a rerank
    node without its options block, a guard absent, given more than once (OVMS refuses such
    a graph), not a whole number, or different.  Bad guard values raise.
    """
    expected = _guards(max_allowed_chunks, max_position_embeddings)
    try:
        graph, nodes, calculators = _graph(text)
    except _ParseError as err:
        return [f"graph: cannot read it as protobuf text: {err}"]
    if not nodes:
        return [_no_rerank(calculators)]
    problems: list[str] = []
    for node in nodes:
        if not node.blocks:
            problems.append(_no_block(node.label))
        for block in node.blocks:
            for name, want in expected.items():
                where = f"graph: {node.label}: {name} ({GUARD_VARIABLES[name]})"
                found = [item for item in block.fields if item.name == name]
                if not found:
                    problems.append(f"{where} is absent, expected {want}; {_default_note(name)}")
                elif len(found) > 1:
                    problems.append(
                        f"{where} is given {len(found)} times, expected once with {want}; "
                        "OVMS refuses a graph that sets a field twice"
                    )
                else:
                    value = _integer(found[0].scalar)
                    scalar = found[0].scalar
                    got = graph[scalar[0].start : scalar[-1].end] if scalar else "a block or list"
                    if value is None:
                        problems.append(f"{where} is not a whole number ({got}), expected {want}")
                    elif value != want:
                        problems.append(f"{where} is {value}, expected {want}")
    return problems


def _indent(text: str, block: _Message) -> str:
    """The indentation of the block's fields: its first field's, else its brace's + 2."""
    if block.fields:
        start = text.rfind("\n", 0, block.fields[0].start) + 1
        prefix = text[start : block.fields[0].start]
        if not prefix.strip():
            return prefix
    start = text.rfind("\n", 0, block.close) + 1
    prefix = text[start : block.close]
    base = prefix if not prefix.strip() else prefix[: len(prefix) - len(prefix.lstrip())]
    return base + "  "


def _insertions(text: str, block: _Message, missing: list[str]) -> list[tuple[int, str]]:
    """Insertions, in order, that add ``missing`` (``name: value`` each) at the end of ``block``.

    Two insertions may share an offset (a separator after the last field, then the fields):
    they apply in the order given.
    """
    separators = {item.separator for item in block.fields if item.separator}
    separator = "," if "," in separators else ";" if ";" in separators else ""
    last = block.fields[-1] if block.fields else None
    trailing = last is not None and last.separator != ""
    edits: list[tuple[int, str]] = []
    if last is not None and not trailing and separator:
        edits.append((last.end, separator))
    between = separator
    tail = separator if trailing else ""
    brace_line = text.rfind("\n", 0, block.close) + 1
    if text[brace_line : block.close].strip():
        # The closing brace shares its line with the last field (or the opening brace):
        # add the fields on that line, before the brace.
        anchor = len(text[: block.close].rstrip(" \t"))
        added = (between + " ").join(missing) if between else " ".join(missing)
        edits.append((anchor, " " + added + tail))
        return edits
    # The closing brace is on its own line: add a line per field after the last field's
    # line (after any comment on it), or after the opening brace's line.
    after = last.after if last is not None else block.open + 1
    line_end = text.find("\n", after)
    line_end = block.close if line_end == -1 or line_end > block.close else line_end
    newline = "\n"
    if text[line_end - 1 : line_end] == "\r":  # a CRLF file keeps its line ends
        line_end -= 1
        newline = "\r\n"
    indent = _indent(text, block)
    lines = [
        newline + indent + entry + (between if position < len(missing) - 1 else tail)
        for position, entry in enumerate(missing)
    ]
    edits.append((line_end, "".join(lines)))
    return edits


def retrieval_graph_guards(
    text: object,
    max_allowed_chunks: object = DEFAULT_MAX_ALLOWED_CHUNKS,
    max_position_embeddings: object = DEFAULT_MAX_POSITION_EMBEDDINGS,
) -> str:
    """``text`` with both guards set in every ``RerankCalculatorOV`` node's options block.

    A guard with another value gets the new value in place; a missing one is added at the
    end of the block, on a line of its own in the block's indentation and with its
    separator style (``,``, ``;`` or none).  Nothing else changes: comments, whitespace,
    other fields, other nodes and a value already right (``0x40`` for 64 included) stay as
    they are, so a second run returns the same text.  Refused, naming the problem: a text
    that is not protobuf text, a graph without a ``RerankCalculatorOV`` node (an embeddings
    graph, say), a rerank node without its options block, a guard given twice or whose
    value is a block or a list, and bad guard values.
    """
    expected = _guards(max_allowed_chunks, max_position_embeddings)
    try:
        graph, nodes, calculators = _graph(text)
    except _ParseError as err:
        raise RetrievalError(f"graph: cannot read it as protobuf text: {err}") from err
    if not nodes:
        raise RetrievalError(_no_rerank(calculators))
    # (offset, order at that offset, replaced length, replacement)
    edits: list[tuple[int, int, int, str]] = []
    for node in nodes:
        if not node.blocks:
            raise RetrievalError(_no_block(node.label))
        for block in node.blocks:
            missing: list[str] = []
            for name, want in expected.items():
                found = [item for item in block.fields if item.name == name]
                where = f"graph: {node.label}: {name} ({GUARD_VARIABLES[name]})"
                if len(found) > 1:
                    raise RetrievalError(
                        f"{where} is given {len(found)} times; OVMS refuses a graph that sets "
                        "a field twice: keep one line and run again"
                    )
                if not found:
                    missing.append(f"{name}: {want}")
                    continue
                item = found[0]
                if not item.scalar:
                    raise RetrievalError(
                        f"{where} holds a block or a list, not a number; write it as {name}: {want}"
                    )
                if _integer(item.scalar) != want:
                    start, end = item.scalar[0].start, item.scalar[-1].end
                    edits.append((start, 0, end - start, str(want)))
            if missing:
                for order, (offset, insertion) in enumerate(_insertions(graph, block, missing)):
                    edits.append((offset, order, 0, insertion))
    # From the end backwards, so offsets stay valid; at one offset the later insertion
    # goes first, so that the earlier one ends up before it.
    result = graph
    for offset, _order, length, replacement in sorted(edits, reverse=True):
        result = result[:offset] + replacement + result[offset + length :]
    return result


# --------------------------------------------------------------------------- graph settings


def _all_option_blocks(root: _Message) -> Iterator[tuple[str, _Message]]:
    """Every calculator node's options blocks (any options type), with the node's label."""
    for index, item in enumerate(entry for entry in root.fields if entry.name == "node"):
        if item.message is None:
            continue
        calculator = _calculator(item.message) or f"node #{index + 1}"
        for option in item.message.fields:
            if option.name in {"node_options", "options"} and option.message is not None:
                for inner in option.message.fields:
                    if inner.message is not None and inner.name.startswith("["):
                        yield calculator, inner.message


def _string_field(block: _Message, name: str) -> str | None:
    for item in block.fields:
        if item.name == name and item.scalar and item.scalar[0].kind == "string":
            return _unquote(item.scalar)
    return None


def retrieval_graph_settings_check(
    text: object, num_streams: object = DEFAULT_NUM_STREAMS, target_device: object = "GPU"
) -> list[str]:
    """What is wrong with a ``graph.pbtxt``'s device and streams; empty when both are right.

    ``export_model.py`` bakes ``target_device`` and ``plugin_config``'s ``NUM_STREAMS`` into
    every graph at export time, so the server's device and its streams are read from the
    graphs, not set at run time.  Each calculator's options block must name
    ``target_device`` (``GPU`` or ``CPU``: a CPU export given as the card's tree serves on the
    CPU without a word); a graph that names none passes for the CPU (``ovms --pull`` writes
    no ``target_device`` line unless one is asked for since 2026.3; the field's default is
    ``CPU`` up to 2026.2, and a server without a GPU has nothing else) and is refused for the
    GPU (from 2026.3 the server would choose a device itself, a discrete card before the
    iGPU).  Each block must carry ``NUM_STREAMS`` equal to ``num_streams``
    (``retrieval_num_streams``), which the memory plan assumes: each stream holds its own
    pinned pools.
    """
    streams = _streams(num_streams)
    if target_device not in ("GPU", "CPU"):
        raise RetrievalError(f"target_device: got {target_device!r}; give 'GPU' or 'CPU'")
    try:
        root = _Parser(text).document() if isinstance(text, str) else None
    except _ParseError as err:
        return [f"graph: cannot read it as protobuf text: {err}"]
    if root is None:
        kind = "null" if text is None else type(text).__name__
        raise RetrievalTypeError(
            f"graph: expected the text of a graph.pbtxt (a string), got {kind}"
        )
    blocks = list(_all_option_blocks(root))
    if not blocks:
        return ["graph: no calculator options block (target_device, plugin_config); re-export it"]
    problems: list[str] = []
    for calculator, block in blocks:
        device = _string_field(block, "target_device")
        if device is None and target_device == "CPU":
            pass  # CPU: the field's default up to 2026.2, and the only device a CPU server has
        elif device is None:
            problems.append(
                f"graph: {calculator}: sets no target_device, expected {target_device!r}; OVMS up "
                "to 2026.2 serves such a graph on the CPU (the field's default), later releases on "
                "whichever GPU they find first (a discrete card before the iGPU): re-export with "
                f"--target_device {target_device}"
            )
        elif device != target_device:
            problems.append(
                f"graph: {calculator}: target_device is {device!r}, expected {target_device!r}; "
                f"this tree was exported for another device: give the {target_device.lower()}/ "
                "tree of the export"
            )
        config = _string_field(block, "plugin_config")
        try:
            parsed = json.loads(config) if config is not None else {}
        except ValueError:
            problems.append(f"graph: {calculator}: plugin_config is not JSON: {config!r}")
            continue
        found = parsed.get("NUM_STREAMS") if isinstance(parsed, dict) else None
        if found is None:
            problems.append(
                f"graph: {calculator}: plugin_config sets no NUM_STREAMS, so the device plugin "
                f"chooses (each stream holds its own pinned pools); re-export with "
                f"--num_streams {streams} ({_NUM_STREAMS_VARIABLE})"
            )
        elif str(found).strip() != str(streams):
            problems.append(
                f"graph: {calculator}: NUM_STREAMS is {found!r}, but {_NUM_STREAMS_VARIABLE} is "
                f"{streams} (the memory plan's assumption); re-export with --num_streams "
                f"{streams}, or set {_NUM_STREAMS_VARIABLE} to {found}"
            )
    return problems


# --------------------------------------------------------------------------- the probe

NOISE_SCORE = 1e-6  # an LLM-style reranker in a cross-encoder slot scores about 1e-9..1e-12
MIN_SEPARATION = 0.1


def retrieval_rerank_probe(
    response: object, relevant_index: object, documents: object
) -> list[str]:
    """What is wrong with the answer to the role's fixed rerank probe; empty when it ranks.

    The probe sends one relevant document and several unrelated ones.  A reranker that works
    as a cross-encoder puts the relevant one first with a clear margin.  Refused: an answer
    that is not ``{"results": [{"index", "relevance_score"}]}`` for every document; every
    score below ``1e-6`` (an LLM-style reranker pressed into a cross-encoder slot answers
    1e-9..1e-12 for all); the relevant document not first; a margin over the next below 0.1.
    """
    if not isinstance(documents, int) or isinstance(documents, bool) or documents < 2:
        raise RetrievalError(f"documents: got {documents!r}; the probe sends 2 or more")
    if not isinstance(relevant_index, int) or not 0 <= relevant_index < documents:
        raise RetrievalError(f"relevant_index: got {relevant_index!r}; give 0..{documents - 1}")
    results = response.get("results") if isinstance(response, dict) else None
    if not isinstance(results, list):
        return [f"the answer has no results list: {str(response)[:200]}"]
    scores: dict[int, float] = {}
    for item in results:
        index = item.get("index") if isinstance(item, dict) else None
        score = item.get("relevance_score") if isinstance(item, dict) else None
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or not isinstance(score, (int, float))
            or isinstance(score, bool)
            or not math.isfinite(score)
        ):
            return [f"a result is not {{index, relevance_score}}: {str(item)[:200]}"]
        scores[index] = float(score)
    if sorted(scores) != list(range(documents)):
        return [f"the results score documents {sorted(scores)}, expected 0..{documents - 1}"]
    ranked = sorted(scores, key=lambda i: -scores[i])
    shown = ", ".join(f"{i}: {scores[i]:.3g}" for i in ranked)
    if max(scores.values()) < NOISE_SCORE:
        return [
            f"every score is below {NOISE_SCORE:g} ({shown}): a ranking made of noise, the "
            "signature of an LLM-style reranker in a cross-encoder slot; serve a cross-encoder "
            "(bge-reranker-v2-m3 exported with export_model.py rerank_ov)"
        ]
    problems: list[str] = []
    if ranked[0] != relevant_index:
        problems.append(
            f"the relevant document {relevant_index} is not first (scores by rank: {shown})"
        )
    else:
        margin = scores[ranked[0]] - scores[ranked[1]]
        if margin < MIN_SEPARATION:
            problems.append(
                f"the relevant document leads by {margin:.3g}, less than {MIN_SEPARATION}: no "
                f"separation (scores by rank: {shown})"
            )
    return problems


# --------------------------------------------------------------------------- the reservation

RESERVATION_NAME = "retrieval"


def retrieval_reservation_check(reservations: object, plan: object) -> list[str]:
    """What is wrong with the card's reservation for the tier; empty when it is honest.

    On the card vLLM serves from, the tier's memory is a tenant vLLM must leave room for:
    ``vllm_reservations`` needs an entry named ``retrieval`` of at least the plan's
    ``worst_sequence_peak_bytes`` (the pinned weights plus the held pool and the next).
    """
    if not isinstance(plan, dict) or not isinstance(plan.get("worst_sequence_peak_bytes"), int):
        raise RetrievalTypeError("plan: expected the result of retrieval_memory_plan")
    need = int(plan["worst_sequence_peak_bytes"])
    try:
        tenants = parse_reservations(reservations)
    except VllmTuningError as err:
        raise _converted(err) from err
    entry = (
        f"{{name: {RESERVATION_NAME}, bytes: {math.ceil(need / MIB)}MiB}} (the tier's worst "
        f"sequence, {human_size(need)}: the pinned weights and two rerank pools)"
    )
    mine = [item for item in tenants if item.name == RESERVATION_NAME]
    if not mine:
        return [
            f"vllm_reservations has no entry named {RESERVATION_NAME}, but retrieval_device is "
            f"card: vLLM would plan the tier's memory as its own. Add {entry}"
        ]
    held = sum(item.total for item in mine)
    if held < need:
        return [
            f"vllm_reservations reserves {human_size(held)} for {RESERVATION_NAME}, less than "
            f"the tier can hold; make it {entry}"
        ]
    return []
