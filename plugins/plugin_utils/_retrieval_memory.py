# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``retrieval`` role's memory (pure functions, no I/O), from seed ``000`` ("Retrieval on
the idle iGPUs", its September update): the OVMS container's memory cap, computed from the
rerank graph's two guards with the seed's measured cost model (:func:`retrieval_memory_plan`),
and the card's reservation for the tier (:func:`retrieval_reservation_check`).

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    _HEADROOM_VARIABLE,
    _LIMIT_VARIABLE,
    _NUM_STREAMS_VARIABLE,
    _WATCHDOG_VARIABLE,
    DEFAULT_HEADROOM,
    DEFAULT_MAX_ALLOWED_CHUNKS,
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    DEFAULT_NUM_STREAMS,
    GUARD_VARIABLES,
    SPECIAL_TOKENS,
    RetrievalError,
    RetrievalTypeError,
    _chunks,
    _converted,
    _headroom,
    _limit,
    _positions,
    _size,
    _streams,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    human_size,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_utilization import (
    parse_reservations,
)

__all__ = [
    "BASELINE_BYTES",
    "CALIBRATION_TOLERANCE",
    "call_bytes",
    "retrieval_memory_plan",
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
