# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The rerank graph's two guards, written into every rerank ``graph.pbtxt`` and read back
(:func:`retrieval_graph_guards`, :func:`retrieval_graph_guards_check`), and the device and
streams every graph was exported for (:func:`retrieval_graph_settings_check`); pure
functions, no I/O, from seed ``000`` ("Retrieval on the idle iGPUs", its September update).

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._pbtxt import (
    Message,
    ParseError,
    Parser,
    integer,
    unquote,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    _NUM_STREAMS_VARIABLE,
    DEFAULT_MAX_ALLOWED_CHUNKS,
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    DEFAULT_NUM_STREAMS,
    GUARD_VARIABLES,
    RetrievalError,
    RetrievalTypeError,
    _chunks,
    _positions,
    _streams,
)

__all__ = [
    "RERANK_CALCULATOR",
    "retrieval_graph_guards",
    "retrieval_graph_guards_check",
    "retrieval_graph_settings_check",
]

OVMS_DEFAULT_MAX_ALLOWED_CHUNKS = 10000

RERANK_CALCULATOR = "RerankCalculatorOV"
_OPTIONS_TYPE = "mediapipe.RerankCalculatorOVOptions"


@dataclass
class _RerankNode:
    label: str
    blocks: list[Message]


def _calculator(node: Message) -> str | None:
    for item in node.fields:
        if item.name == "calculator" and item.scalar and item.scalar[0].kind == "string":
            return unquote(item.scalar)
    return None


def _is_rerank_options(name: str) -> bool:
    if not name.startswith("["):
        return False
    inner = name[1:-1]
    return inner == f"{_OPTIONS_TYPE}.ext" or inner.endswith(f"/{_OPTIONS_TYPE}")


def _option_blocks(node: Message) -> Iterator[Message]:
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
    root = Parser(text).document()
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
                unquote(entry.scalar)
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
    except ParseError as err:
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
                    value = integer(found[0].scalar)
                    scalar = found[0].scalar
                    got = graph[scalar[0].start : scalar[-1].end] if scalar else "a block or list"
                    if value is None:
                        problems.append(f"{where} is not a whole number ({got}), expected {want}")
                    elif value != want:
                        problems.append(f"{where} is {value}, expected {want}")
    return problems


def _indent(text: str, block: Message) -> str:
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


def _insertions(text: str, block: Message, missing: list[str]) -> list[tuple[int, str]]:
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
    except ParseError as err:
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
                if integer(item.scalar) != want:
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


def _all_option_blocks(root: Message) -> Iterator[tuple[str, Message]]:
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


def _string_field(block: Message, name: str) -> str | None:
    for item in block.fields:
        if item.name == name and item.scalar and item.scalar[0].kind == "string":
            return unquote(item.scalar)
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
        root = Parser(text).document() if isinstance(text, str) else None
    except ParseError as err:
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
