"""Which box takes a request, and the fleet's one mode: pure, no sockets."""

from __future__ import annotations

from collections import Counter

import pytest

from cardshare.proxy.config import Box
from cardshare.proxy.fleet import BoxState, fleet_mode, known_model, pick, request_model
from cardshare.proxy.mode import ModeView, on_arbiter_answer, on_arbiter_down


def state(n: int, mode: str = "llm", models: tuple[str, ...] = ("m",), weight: int = 1) -> BoxState:
    box = Box(f"box-{n}", f"http://h{n}:8000", f"http://h{n}:8090", models, weight)
    return BoxState(box, n, on_arbiter_answer(ModeView(), mode, 1.0, 2.0))


def route(boxes: list[BoxState], model: str | None, n: int) -> Counter[str]:
    """Send ``n`` requests that stay in flight; where each went."""
    seen: Counter[str] = Counter()
    for _ in range(n):
        box = pick(boxes, model, True)
        assert box is not None
        box.in_flight += 1
        box.routed += 1
        seen[box.box.name] += 1
    return seen


def test_least_outstanding_by_weight() -> None:
    boxes = [state(0, weight=1), state(1, weight=3)]
    assert route(boxes, "m", 8) == {"box-0": 2, "box-1": 6}


def test_idle_boxes_take_turns() -> None:
    boxes = [state(0), state(1)]
    order = []
    for _ in range(4):
        box = pick(boxes, "m", True)
        assert box is not None
        box.routed += 1  # finished at once: in_flight stays 0
        order.append(box.index)
    assert order == [0, 1, 0, 1]


def test_only_boxes_in_llm_serving_the_model() -> None:
    boxes = [state(0, "image"), state(1, models=("other",)), state(2, "swapping"), state(3)]
    assert route(boxes, "m", 3) == {"box-3": 3}
    assert pick(boxes, "nothing", True) is None
    # a request naming no model goes to any box in rotation
    assert {pick(boxes, None, True).index} <= {1, 3}  # type: ignore[union-attr]


def test_out_of_rotation_when_the_arbiter_fails_or_vllm_refused() -> None:
    down = state(0)
    down.view = on_arbiter_down(down.view, "TimeoutError", trust_last_known=True)
    refused = state(1)
    refused.upstream_error = "ClientConnectorError"
    never = BoxState(Box("box-2", "http://h2:8000", "http://h2:8090", ("m",)), 2)
    boxes = [down, refused, never]
    assert [b.in_rotation(True) for b in boxes] == [False, False, False]
    assert (down.error, refused.error) == (
        "arbiter: TimeoutError",
        "upstream: ClientConnectorError",
    )
    assert pick(boxes, "m", True) is None
    assert fleet_mode(boxes) == "swapping"
    # one box (no boxes): the last known mode is trusted, as before the fleet
    assert down.in_rotation(False) and never.in_rotation(False)


@pytest.mark.parametrize(
    ("modes", "expected"),
    [
        (("llm", "image"), "llm"),
        (("image", "swapping"), "image"),
        (("swapping", "swapping"), "swapping"),
    ],
)
def test_fleet_mode(modes: tuple[str, str], expected: str) -> None:
    assert fleet_mode([state(n, m) for n, m in enumerate(modes)]) == expected


def test_fleet_mode_for_a_model() -> None:
    boxes = [state(0, "llm", ("a",)), state(1, "image", ("b",))]
    assert (fleet_mode(boxes, "a"), fleet_mode(boxes, "b"), fleet_mode(boxes)) == (
        "llm",
        "image",
        "llm",
    )
    assert (known_model(boxes, "b"), known_model(boxes, "c"), known_model(boxes, None)) == (
        True,
        False,
        True,
    )


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (b'{"model": "qwen3-8b", "messages": []}', "qwen3-8b"),
        (b'{"messages": []}', None),
        (b'{"model": 3}', None),
        (b"[1, 2]", None),
        (b"not json", None),
        (b"\xff\xfe", None),
        (b"", None),
    ],
)
def test_request_model(body: bytes, model: str | None) -> None:
    assert request_model(body) == model
