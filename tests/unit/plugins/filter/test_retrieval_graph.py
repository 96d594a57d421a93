"""The rerank graph's batch guards (plugins/plugin_utils/_retrieval_graph.py,
retrieval_graph_guards).

Where the fixtures' shape comes from: OpenVINO Model Server release v2026.2.1 (commit
1122f03bfe999ccfb9a3abfdb0f94b8954ee3b31, the release seed 000 serves), file
``demos/common/export_models/export_model.py``: its ``rerank_graph_ov_template`` and
``embedding_graph_ov_template`` as ``export_model.py rerank_ov`` / ``embeddings_ov`` render
them with ``--target_device GPU`` and the default ``--num_streams 1`` (jinja drops the final
newline, so an exported graph has none).  The options are ``RerankCalculatorOVOptions`` of
``src/rerank/rerank_calculator_ov.proto`` at that release: ``models_path``,
``max_allowed_chunks`` (default 10000), ``max_position_embeddings``, ``target_device``,
``plugin_config``.  ``OVMS_TEST_LAYOUT`` follows the release's own test graph
``src/test/rerank/with_params/graph_ov.pbtxt`` (fields on their own lines, no separators).
"""

from __future__ import annotations

import difflib
import re

import pytest
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.retrieval import FilterModule
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_graph import (
    retrieval_graph_guards,
    retrieval_graph_guards_check,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    RetrievalError,
    RetrievalTypeError,
)

FILTERS = FilterModule().filters()

HEADER = """\
# OVMS_GRAPH_QUEUE_MAX_SIZE: AUTO
input_stream: "REQUEST_PAYLOAD:input"
output_stream: "RESPONSE_PAYLOAD:output"
"""
RERANK_NODE_HEAD = """\
node {
  name: "RerankExecutor"
  input_side_packet: "RERANK_NODE_RESOURCES:rerank_servable"
  calculator: "RerankCalculatorOV"
  input_stream: "REQUEST_PAYLOAD:input"
  output_stream: "RESPONSE_PAYLOAD:output"
  node_options: {
    [type.googleapis.com / mediapipe.RerankCalculatorOVOptions]: {
"""
TAIL = """\
    }
  }
}"""

# export_model.py rerank_ov, as exported: no guard.
EXPORTED_RERANK = (
    HEADER
    + RERANK_NODE_HEAD
    + """\
      models_path: "./",
      plugin_config: '{"NUM_STREAMS": "1" }',
      target_device: "GPU"
"""
    + TAIL
)

GUARDED_RERANK = (
    HEADER
    + RERANK_NODE_HEAD
    + """\
      models_path: "./",
      plugin_config: '{"NUM_STREAMS": "1" }',
      target_device: "GPU",
      max_allowed_chunks: 64,
      max_position_embeddings: 640
"""
    + TAIL
)

# export_model.py embeddings_ov, as exported: no rerank calculator.
EXPORTED_EMBEDDINGS = (
    HEADER
    + """\
node {
  name: "EmbeddingsExecutor"
  input_side_packet: "EMBEDDINGS_NODE_RESOURCES:embeddings_servable"
  calculator: "EmbeddingsCalculatorOV"
  input_stream: "REQUEST_PAYLOAD:input"
  output_stream: "RESPONSE_PAYLOAD:output"
  node_options: {
    [type.googleapis.com / mediapipe.EmbeddingsCalculatorOVOptions]: {
      models_path: "./",
      plugin_config: '{"NUM_STREAMS": "1" }',
      normalize_embeddings: true,
      pooling: CLS,
      target_device: "GPU"
"""
    + TAIL
)

# The layout of OVMS's own test graph: fields on their own lines, no separators, other values.
OVMS_TEST_LAYOUT = """\
input_stream: "REQUEST_PAYLOAD:input"
output_stream: "RESPONSE_PAYLOAD:output"

node {
    name: "rerankNode1"
    input_side_packet: "RERANK_NODE_RESOURCES:rerank_servable"
    calculator: "RerankCalculatorOV"
    input_stream: "REQUEST_PAYLOAD:input"
    output_stream: "RESPONSE_PAYLOAD:output"
    node_options: {
      [type.googleapis.com / mediapipe.RerankCalculatorOVOptions]: {
        models_path: "./"
        max_allowed_chunks: 4
        max_position_embeddings: 12
      }
    }
}
"""


def _rerank(body: str) -> str:
    """The exported rerank graph with ``body`` as its options block's contents."""
    return HEADER + RERANK_NODE_HEAD + body + TAIL


ABSENT = "is absent, expected"
CHUNKS = "graph: node 'RerankExecutor': max_allowed_chunks (retrieval_max_allowed_chunks)"
POSITIONS = (
    "graph: node 'RerankExecutor': max_position_embeddings (retrieval_max_position_embeddings)"
)
CHUNKS_ABSENT = f"{CHUNKS} is absent, expected 64; OVMS then allows 10000 chunks"
POSITIONS_ABSENT = (
    f"{POSITIONS} is absent, expected 640; OVMS then takes the model's own, from its config.json"
)
NO_RERANK_EMBEDDINGS = (
    "graph: no RerankCalculatorOV node (the graph's calculators: EmbeddingsCalculatorOV); the "
    "guards belong in the rerank model's graph.pbtxt as export_model.py rerank_ov writes it"
)

# (case id, graph, guarded graph with the defaults 64 / 640)
CASES: list[tuple[str, str, str]] = [
    ("exported, no guard", EXPORTED_RERANK, GUARDED_RERANK),
    ("already guarded", GUARDED_RERANK, GUARDED_RERANK),
    (
        "other values, replaced in place",
        _rerank(
            '      models_path: "./",\n'
            "      max_allowed_chunks: 10000,\n"
            "      max_position_embeddings: 8192,\n"
            '      target_device: "GPU"\n'
        ),
        _rerank(
            '      models_path: "./",\n'
            "      max_allowed_chunks: 64,\n"
            "      max_position_embeddings: 640,\n"
            '      target_device: "GPU"\n'
        ),
    ),
    (
        "one present, one absent",
        _rerank(
            '      models_path: "./",\n'
            "      max_position_embeddings: 512,\n"
            '      target_device: "GPU"\n'
        ),
        _rerank(
            '      models_path: "./",\n'
            "      max_position_embeddings: 640,\n"
            '      target_device: "GPU",\n'
            "      max_allowed_chunks: 64\n"
        ),
    ),
    (
        "OVMS test layout: no separators, other indentation",
        OVMS_TEST_LAYOUT,
        OVMS_TEST_LAYOUT.replace("chunks: 4\n", "chunks: 64\n").replace(
            "embeddings: 12\n", "embeddings: 640\n"
        ),
    ),
    (
        "OVMS test layout without guards",
        OVMS_TEST_LAYOUT.replace("        max_allowed_chunks: 4\n", "").replace(
            "        max_position_embeddings: 12\n", ""
        ),
        OVMS_TEST_LAYOUT.replace("chunks: 4\n", "chunks: 64\n").replace(
            "embeddings: 12\n", "embeddings: 640\n"
        ),
    ),
    (
        "comments: a commented-out guard is not a guard, comments stay",
        _rerank(
            "      # max_allowed_chunks: 64,\n"
            '      models_path: "./",  # the IR beside this graph\n'
            "      # max_position_embeddings: 640\n"
            '      target_device: "GPU"  # the iGPU\n'
            "      # end of the options\n"
        ),
        _rerank(
            "      # max_allowed_chunks: 64,\n"
            '      models_path: "./",  # the IR beside this graph\n'
            "      # max_position_embeddings: 640\n"
            '      target_device: "GPU",  # the iGPU\n'
            "      max_allowed_chunks: 64,\n"
            "      max_position_embeddings: 640\n"
            "      # end of the options\n"
        ),
    ),
    (
        "a guard inside a string is not a guard",
        _rerank('      models_path: "./max_allowed_chunks: 64 max_position_embeddings: 640"\n'),
        _rerank(
            '      models_path: "./max_allowed_chunks: 64 max_position_embeddings: 640"\n'
            "      max_allowed_chunks: 64\n"
            "      max_position_embeddings: 640\n"
        ),
    ),
    (
        "odd whitespace: tabs, no space after the colon, no colon before the block",
        HEADER.replace("\n", "\n\n")
        + 'node {\n\tcalculator:"RerankCalculatorOV"\n\tnode_options {\n'
        "\t\t[ type.googleapis.com/mediapipe.RerankCalculatorOVOptions ] {\n"
        '\t\t\tmodels_path:"./" ;\n'
        "\t\t\tmax_allowed_chunks:10000   ;  \n"
        '\t\t\ttarget_device :  "GPU";\n'
        "\t\t}\n\t}\n}\n",
        HEADER.replace("\n", "\n\n")
        + 'node {\n\tcalculator:"RerankCalculatorOV"\n\tnode_options {\n'
        "\t\t[ type.googleapis.com/mediapipe.RerankCalculatorOVOptions ] {\n"
        '\t\t\tmodels_path:"./" ;\n'
        "\t\t\tmax_allowed_chunks:64   ;  \n"
        '\t\t\ttarget_device :  "GPU";\n'
        "\t\t\tmax_position_embeddings: 640;\n"
        "\t\t}\n\t}\n}\n",
    ),
    (
        "trailing separators",
        _rerank('      models_path: "./",\n      target_device: "GPU",\n'),
        _rerank(
            '      models_path: "./",\n'
            '      target_device: "GPU",\n'
            "      max_allowed_chunks: 64,\n"
            "      max_position_embeddings: 640,\n"
        ),
    ),
    (
        "one line",
        'node { calculator: "RerankCalculatorOV" node_options { '
        '[type.googleapis.com/mediapipe.RerankCalculatorOVOptions] { models_path: "./" } } }',
        'node { calculator: "RerankCalculatorOV" node_options { '
        '[type.googleapis.com/mediapipe.RerankCalculatorOVOptions] { models_path: "./" '
        "max_allowed_chunks: 64 max_position_embeddings: 640 } } }",
    ),
    (
        "one line, comma separated",
        'node { calculator: "RerankCalculatorOV" node_options: { '
        '[type.googleapis.com/mediapipe.RerankCalculatorOVOptions]: { models_path: "./", '
        'target_device: "GPU" } } }',
        'node { calculator: "RerankCalculatorOV" node_options: { '
        '[type.googleapis.com/mediapipe.RerankCalculatorOVOptions]: { models_path: "./", '
        'target_device: "GPU", max_allowed_chunks: 64, max_position_embeddings: 640 } } }',
    ),
    (
        "CRLF line ends are kept",
        EXPORTED_RERANK.replace("\n", "\r\n"),
        GUARDED_RERANK.replace("\n", "\r\n"),
    ),
    (
        "the older options form, [mediapipe.RerankCalculatorOVOptions.ext]",
        'node {\n  calculator: "RerankCalculatorOV"\n  options {\n'
        "    [mediapipe.RerankCalculatorOVOptions.ext] {\n"
        '      models_path: "./"\n    }\n  }\n}\n',
        'node {\n  calculator: "RerankCalculatorOV"\n  options {\n'
        "    [mediapipe.RerankCalculatorOVOptions.ext] {\n"
        '      models_path: "./"\n'
        "      max_allowed_chunks: 64\n"
        "      max_position_embeddings: 640\n    }\n  }\n}\n",
    ),
    (
        "the same values spelled in hex and octal stay as written",
        _rerank(
            '      models_path: "./",\n'
            "      max_allowed_chunks: 0x40,\n"
            "      max_position_embeddings: 01200\n"
        ),
        _rerank(
            '      models_path: "./",\n'
            "      max_allowed_chunks: 0x40,\n"
            "      max_position_embeddings: 01200\n"
        ),
    ),
    (
        "a quoted value is replaced by the number",
        _rerank(
            '      models_path: "./",\n'
            '      max_allowed_chunks: "64",\n'
            "      max_position_embeddings: 640\n"
        ),
        _rerank(
            '      models_path: "./",\n'
            "      max_allowed_chunks: 64,\n"
            "      max_position_embeddings: 640\n"
        ),
    ),
    (
        "an embeddings node beside the rerank node is left alone",
        EXPORTED_EMBEDDINGS + "\n" + RERANK_NODE_HEAD + '      models_path: "./"\n' + TAIL,
        EXPORTED_EMBEDDINGS + "\n" + RERANK_NODE_HEAD + '      models_path: "./"\n'
        "      max_allowed_chunks: 64\n"
        "      max_position_embeddings: 640\n" + TAIL,
    ),
    (
        "two rerank nodes both get the guards",
        EXPORTED_RERANK + "\n" + EXPORTED_RERANK.replace(HEADER, ""),
        GUARDED_RERANK + "\n" + GUARDED_RERANK.replace(HEADER, ""),
    ),
]


@pytest.mark.parametrize(("case", "graph", "expected"), CASES, ids=[case[0] for case in CASES])
def test_guards(case: str, graph: str, expected: str) -> None:
    assert retrieval_graph_guards(graph) == expected


@pytest.mark.parametrize(("case", "graph", "expected"), CASES, ids=[case[0] for case in CASES])
def test_guards_are_idempotent_and_verified(case: str, graph: str, expected: str) -> None:
    once = retrieval_graph_guards(graph)
    assert retrieval_graph_guards(once) == once
    assert retrieval_graph_guards_check(once) == []


_GUARD_LINE = re.compile(r"^\s*(max_allowed_chunks|max_position_embeddings)\s*:")
_SEPARATOR = re.compile(r"^(.*?\S)\s*[,;](\s*(#.*)?)$")


def _without_guards(text: str) -> list[str]:
    """The lines that are not guards, each without a separator after its field."""
    return [
        _SEPARATOR.sub(r"\1\2", line) for line in text.splitlines() if not _GUARD_LINE.match(line)
    ]


MULTILINE = [case for case in CASES if "\n" in case[1]]  # one-liners: see test_guards


@pytest.mark.parametrize(
    ("case", "graph", "expected"), MULTILINE, ids=[case[0] for case in MULTILINE]
)
def test_guards_touch_nothing_else(case: str, graph: str, expected: str) -> None:
    """Line by line, only guard lines change, and a separator may follow the old last field."""
    result = retrieval_graph_guards(graph)
    assert _without_guards(result) == _without_guards(graph)
    changed = [
        line[2:]
        for line in difflib.ndiff(graph.splitlines(), result.splitlines())
        if line[:2] in {"- ", "+ "}
    ]
    # at most: each guard line, and the old last field of each block before and after
    assert len(changed) <= 6 * graph.count('RerankCalculatorOV"')


def test_other_guard_values() -> None:
    assert retrieval_graph_guards(EXPORTED_RERANK, 32, 512) == GUARDED_RERANK.replace(
        "chunks: 64", "chunks: 32"
    ).replace("embeddings: 640", "embeddings: 512")
    # and a graph guarded for 64 / 640 is rewritten in place for other values
    assert retrieval_graph_guards(GUARDED_RERANK, "32", "512") == retrieval_graph_guards(
        EXPORTED_RERANK, 32, 512
    )


# --------------------------------------------------------------------------- the check

CHECKS: list[tuple[str, str, list[str]]] = [
    ("exported: both absent", EXPORTED_RERANK, [CHUNKS_ABSENT, POSITIONS_ABSENT]),
    ("guarded", GUARDED_RERANK, []),
    (
        "other values",
        OVMS_TEST_LAYOUT,
        [
            "graph: node 'rerankNode1': max_allowed_chunks (retrieval_max_allowed_chunks) is 4, "
            "expected 64",
            "graph: node 'rerankNode1': max_position_embeddings "
            "(retrieval_max_position_embeddings) is 12, expected 640",
        ],
    ),
    (
        "commented out",
        _rerank(
            '      models_path: "./"\n'
            "      # max_allowed_chunks: 64\n"
            "      # max_position_embeddings: 640\n"
        ),
        [CHUNKS_ABSENT, POSITIONS_ABSENT],
    ),
    (
        "not a whole number",
        _rerank(
            '      models_path: "./"\n'
            '      max_allowed_chunks: "64"\n'
            "      max_position_embeddings: 6.4e2\n"
        ),
        [
            f'{CHUNKS} is not a whole number ("64"), expected 64',
            f"{POSITIONS} is not a whole number (6.4e2), expected 640",
        ],
    ),
    (
        "given twice",
        _rerank(
            '      models_path: "./"\n      max_allowed_chunks: 64\n      max_allowed_chunks: 64\n'
            "      max_position_embeddings: 640\n"
        ),
        [
            f"{CHUNKS} is given 2 times, expected once with 64; OVMS refuses a graph that sets a "
            "field twice"
        ],
    ),
    (
        "a guard in a nested block is not the option",
        _rerank(
            '      models_path: "./"\n'
            "      extra { max_allowed_chunks: 64 }\n"
            "      max_position_embeddings: 640\n"
        ),
        [CHUNKS_ABSENT],
    ),
    ("embeddings graph", EXPORTED_EMBEDDINGS, [NO_RERANK_EMBEDDINGS]),
    (
        "empty text",
        "",
        [
            "graph: no RerankCalculatorOV node (the graph's calculators: none); the guards "
            "belong in the rerank model's graph.pbtxt as export_model.py rerank_ov writes it"
        ],
    ),
    (
        "rerank node without its options",
        'node {\n  name: "RerankExecutor"\n  calculator: "RerankCalculatorOV"\n}\n',
        [
            "graph: the RerankCalculatorOV node 'RerankExecutor' has no "
            "[type.googleapis.com/mediapipe.RerankCalculatorOVOptions] options block to hold "
            "the guards; re-export the model with export_model.py rerank_ov"
        ],
    ),
    (
        "unbalanced braces",
        EXPORTED_RERANK[:-2],
        ["graph: cannot read it as protobuf text: the text ends inside a block: '}' is missing"],
    ),
    (
        "unterminated string",
        EXPORTED_RERANK.replace('"GPU"', '"GPU'),
        ["graph: cannot read it as protobuf text: line 14: unterminated string '\"GPU'"],
    ),
]


@pytest.mark.parametrize(("case", "graph", "expected"), CHECKS, ids=[case[0] for case in CHECKS])
def test_check(case: str, graph: str, expected: list[str]) -> None:
    assert retrieval_graph_guards_check(graph) == expected


def test_check_other_values() -> None:
    assert retrieval_graph_guards_check(GUARDED_RERANK, 64, 640) == []
    assert retrieval_graph_guards_check(GUARDED_RERANK, 32, 640) == [f"{CHUNKS} is 64, expected 32"]


# --------------------------------------------------------------------------- refusals

REFUSALS: list[tuple[str, object, type[Exception], str]] = [
    ("embeddings graph", EXPORTED_EMBEDDINGS, RetrievalError, NO_RERANK_EMBEDDINGS),
    (
        "rerank node without its options",
        'node {\n  name: "RerankExecutor"\n  calculator: "RerankCalculatorOV"\n'
        "  node_options: {\n    [type.googleapis.com / mediapipe.EmbeddingsCalculatorOVOptions]: "
        '{\n      models_path: "./"\n    }\n  }\n}\n',
        RetrievalError,
        "graph: the RerankCalculatorOV node 'RerankExecutor' has no "
        "[type.googleapis.com/mediapipe.RerankCalculatorOVOptions] options block to hold the "
        "guards; re-export the model with export_model.py rerank_ov",
    ),
    (
        "guard given twice",
        _rerank(
            '      models_path: "./"\n'
            "      max_position_embeddings: 512\n"
            "      max_position_embeddings: 640\n"
        ),
        RetrievalError,
        f"{POSITIONS} is given 2 times; OVMS refuses a graph that sets a field twice: keep one "
        "line and run again",
    ),
    (
        "guard holding a block",
        _rerank('      models_path: "./"\n      max_allowed_chunks { value: 64 }\n'),
        RetrievalError,
        f"{CHUNKS} holds a block or a list, not a number; write it as max_allowed_chunks: 64",
    ),
    (
        "not protobuf text",
        "node { calculator: 'RerankCalculatorOV' ! }",
        RetrievalError,
        "graph: cannot read it as protobuf text: line 1: unexpected '! }'",
    ),
    (
        "bytes",
        EXPORTED_RERANK.encode(),
        RetrievalTypeError,
        "graph: expected the text of a graph.pbtxt (a string), got bytes",
    ),
    (
        "null",
        None,
        RetrievalTypeError,
        "graph: expected the text of a graph.pbtxt (a string), got null",
    ),
]


@pytest.mark.parametrize(
    ("case", "graph", "error", "message"), REFUSALS, ids=[case[0] for case in REFUSALS]
)
def test_refusals(case: str, graph: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        retrieval_graph_guards(graph)
    assert str(caught.value) == message
    with pytest.raises(AnsibleFilterError) as filtered:
        FILTERS["retrieval_graph_guards"](graph)
    assert filtered.value.message == message


@pytest.mark.parametrize("function", [retrieval_graph_guards, retrieval_graph_guards_check])
@pytest.mark.parametrize(
    ("chunks", "positions", "message"),
    [
        (
            0,
            640,
            "retrieval_max_allowed_chunks: expected a whole number of chunks per request, 1 or "
            "more, got 0",
        ),
        (
            64,
            8,
            "retrieval_max_position_embeddings: 8 tokens leaves no room for a document: OVMS "
            "refuses a max_position_embeddings of 8 or less (four special tokens and the query "
            "share each row); the seed's guard is 640",
        ),
    ],
)
def test_bad_guard_values_raise(
    function: object, chunks: int, positions: int, message: str
) -> None:
    assert callable(function)
    with pytest.raises(RetrievalError) as caught:
        function(GUARDED_RERANK, chunks, positions)
    assert str(caught.value) == message


def test_filters_return_what_the_functions_do() -> None:
    assert FILTERS["retrieval_graph_guards"](EXPORTED_RERANK) == GUARDED_RERANK
    assert FILTERS["retrieval_graph_guards_check"](EXPORTED_RERANK, 64, 640) == [
        CHUNKS_ABSENT,
        POSITIONS_ABSENT,
    ]
    assert FILTERS["retrieval_graph_guards_check"](EXPORTED_EMBEDDINGS) == [NO_RERANK_EMBEDDINGS]
