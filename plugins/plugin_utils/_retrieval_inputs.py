# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``retrieval`` role's inputs: its guards and memory settings read and checked, and the
errors that name the variable, the value and the fix (pure functions, no I/O).  Sizes and
numbers are read by the ``vllm`` role's parsers (``_vllm_inputs``), their errors turned into
this role's.
"""

from __future__ import annotations

from fractions import Fraction

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    parse_number,
    parse_size,
)

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_MAX_ALLOWED_CHUNKS",
    "DEFAULT_MAX_POSITION_EMBEDDINGS",
    "DEFAULT_NUM_STREAMS",
    "GUARD_VARIABLES",
    "RetrievalError",
    "RetrievalTypeError",
]

DEFAULT_MAX_ALLOWED_CHUNKS = 64
DEFAULT_MAX_POSITION_EMBEDDINGS = 640
DEFAULT_NUM_STREAMS = 1
DEFAULT_HEADROOM = 0.70

# rerank_calculator_ov.cc: NUMBER_OF_SPECIAL_TOKENS = 4; Open() refuses a
# max_position_embeddings of 2 x 4 or less for a tokenizer that adds a BOS token.
SPECIAL_TOKENS = 4

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
