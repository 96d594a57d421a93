"""tools/role_docs.py: spec/defaults agreement, README rendering and the CLI."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import role_docs

PORT_OPTION = "demo_port: {type: int, default: 80, description: Port.}\n"
REPO_ROLES = Path(__file__).resolve().parents[3] / "roles"

SPEC_HEAD = """\
---
argument_specs:
  main:
    short_description: Do one thing
    options:
"""


def make_role(
    roles: Path, name: str, options: str | None, defaults: str | None, spec: str | None = None
) -> Path:
    """A role tree under ``roles``: ``options`` is the YAML of ``argument_specs.main.options``
    (indented as under ``options:``); ``spec`` replaces the whole spec file."""
    role = roles / name
    (role / "tasks").mkdir(parents=True)
    if spec is None and options is not None:
        spec = SPEC_HEAD + textwrap.indent(textwrap.dedent(options), "      ")
    if spec is not None:
        (role / "meta").mkdir()
        (role / "meta" / "argument_specs.yml").write_text(spec, encoding="utf-8")
    if defaults is not None:
        (role / "defaults").mkdir()
        (role / "defaults" / "main.yml").write_text(
            "---\n" + textwrap.dedent(defaults), encoding="utf-8"
        )
    return role


# (case id, spec options, defaults/main.yml, expected problems)
CHECK_CASES = [
    (
        "agree",
        """
        demo_port: {type: int, default: 80, description: Port.}
        demo_name: {type: str, description: Name., required: false}
        """,
        "demo_port: 80\ndemo_name: null\n",
        [],
    ),
    (
        "default-not-in-spec",
        "demo_port: {type: int, default: 80, description: Port.}\n",
        "demo_port: 80\ndemo_extra: 1\n",
        ["demo: demo_extra is in defaults/main.yml but not in meta/argument_specs.yml"],
    ),
    (
        "spec-option-not-in-defaults",
        "demo_port: {type: int, default: 80, description: Port.}\n",
        "{}\n",
        ["demo: demo_port is in meta/argument_specs.yml but not in defaults/main.yml"],
    ),
    (
        "no-defaults-file",
        "demo_port: {type: int, default: 80, description: Port.}\n",
        None,
        ["demo: demo_port is in meta/argument_specs.yml but not in defaults/main.yml"],
    ),
    (
        "required-without-default-is-fine",
        "demo_token: {type: str, required: true, description: Token.}\n",
        "{}\n",
        [],
    ),
    (
        "required-but-set-in-defaults",
        "demo_token: {type: str, required: true, description: Token.}\n",
        "demo_token: abc\n",
        [
            "demo: demo_token is required in meta/argument_specs.yml but defaults/main.yml "
            "sets it, so it can never be missing"
        ],
    ),
    (
        "scalar-default-differs",
        "demo_port: {type: int, default: 80, description: Port.}\n",
        "demo_port: 8080\n",
        [
            "demo: demo_port: the spec's default differs from defaults/main.yml: "
            "spec 80, defaults/main.yml 8080"
        ],
    ),
    (
        "flow-list-split-by-comma",
        "demo_vendors: {type: list, elements: str, default: [Red Hat, Inc.], description: V.}\n",
        "demo_vendors:\n  - Red Hat, Inc.\n",
        [
            "demo: demo_vendors: the spec's default differs from defaults/main.yml: "
            'spec ["Red Hat", "Inc."], defaults/main.yml ["Red Hat, Inc."]'
        ],
    ),
    (
        "nested-default-differs-at-path",
        """
        demo_map:
          type: dict
          description: Map.
          default: {a: {b: [1, 2]}, c: x}
        """,
        "demo_map: {a: {b: [1, 3]}, c: x}\n",
        [
            "demo: demo_map: the spec's default differs from defaults/main.yml at "
            "demo_map.a.b[1]: spec 2, defaults/main.yml 3"
        ],
    ),
    (
        "bool-is-not-int",
        "demo_on: {type: raw, default: true, description: On.}\n",
        "demo_on: 1\n",
        [
            "demo: demo_on: the spec's default differs from defaults/main.yml: "
            "spec true, defaults/main.yml 1"
        ],
    ),
    (
        "int-equals-float",
        "demo_share: {type: float, default: 1, description: Share.}\n",
        "demo_share: 1.0\n",
        [],
    ),
    (
        "spec-without-default-but-literal-default",
        "demo_list: {type: list, elements: str, description: L.}\n",
        "demo_list: [a]\n",
        [
            "demo: demo_list: the spec has no default (Ansible takes that as null) but "
            'defaults/main.yml sets ["a"]; add that value as the spec\'s default'
        ],
    ),
    (
        "long-value-cut-in-message",
        "demo_list: {type: list, elements: str, description: L.}\n",
        "demo_list: [" + ", ".join(f"item{i:03d}" for i in range(30)) + "]\n",
        [
            "demo: demo_list: the spec has no default (Ansible takes that as null) but "
            "defaults/main.yml sets "
            + ('["' + '", "'.join(f"item{i:03d}" for i in range(30)) + '"]')[:96]
            + " ...; add that value as the spec's default"
        ],
    ),
    (
        "templated-default-not-compared",
        "demo_root: {type: path, default: /, description: Root.}\n",
        "demo_root: \"{{ cardshare_host_root | default('/srv') }}\"\n",
        [],
    ),
    (
        "templated-inside-list-not-compared",
        "demo_dirs: {type: list, elements: path, default: [/a], description: Dirs.}\n",
        'demo_dirs:\n  - "{{ demo_base }}/a"\n',
        [],
    ),
    (
        "unsafe-string-is-literal",
        "demo_fmt: {type: str, default: x, description: Format.}\n",
        "demo_fmt: !unsafe '{{ not a template }}'\n",
        [
            "demo: demo_fmt: the spec's default differs from defaults/main.yml: "
            'spec "x", defaults/main.yml "{{ not a template }}"'
        ],
    ),
    (
        "vaulted-default-not-compared",
        "demo_secret: {type: str, default: x, description: Secret.}\n",
        "demo_secret: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162\n",
        [],
    ),
    (
        "default-not-in-choices",
        "demo_state: {type: str, default: up, choices: [started, stopped], description: S.}\n",
        "demo_state: up\n",
        [
            'demo: demo_state: defaults/main.yml\'s "up" is not among the choices '
            '["started", "stopped"]'
        ],
    ),
    (
        "list-element-not-in-choices",
        """
        demo_modes:
          type: list
          elements: str
          choices: [a, b]
          default: [a, c]
          description: Modes.
        """,
        "demo_modes: [a, c]\n",
        ['demo: demo_modes: defaults/main.yml\'s ["a", "c"] is not among the choices ["a", "b"]'],
    ),
    (
        "null-default-skips-choices",
        "demo_dtype: {type: str, choices: [auto, half], description: D.}\n",
        "demo_dtype: null\n",
        [],
    ),
    (
        "option-without-description",
        "demo_port: {type: int, default: 80}\n",
        "demo_port: 80\n",
        [
            "demo: meta/argument_specs.yml: argument_specs.main.options.demo_port needs a "
            "description (a string or a list of strings)"
        ],
    ),
    (
        "required-and-default",
        "demo_token: {type: str, required: true, default: x, description: Token.}\n",
        "{}\n",
        [
            "demo: meta/argument_specs.yml: argument_specs.main.options.demo_token is required "
            "and has a default; a spec may say only one"
        ],
    ),
    (
        "defaults-not-a-mapping",
        "demo_port: {type: int, default: 80, description: Port.}\n",
        "- demo_port\n",
        [
            "demo: defaults/main.yml must be a mapping of variables",
            "demo: demo_port is in meta/argument_specs.yml but not in defaults/main.yml",
        ],
    ),
]


@pytest.mark.parametrize(
    ("options", "defaults", "expected"),
    [case[1:] for case in CHECK_CASES],
    ids=[case[0] for case in CHECK_CASES],
)
def test_scan_role_problems(
    tmp_path: Path, options: str, defaults: str | None, expected: list[str]
) -> None:
    role = make_role(tmp_path, "demo", options, defaults)
    assert list(role_docs.scan_role(role).problems) == expected


# (case id, role name, spec file text or None, expected problems, README generated)
SPEC_FILE_CASES = [
    (
        "public-role-without-spec",
        "plex",
        None,
        [
            "plex: no meta/argument_specs.yml; every public role needs one "
            "(internal roles start with '_')"
        ],
        False,
    ),
    ("internal-role-without-spec", "_shared", None, [], False),
    (
        "spec-not-a-mapping",
        "demo",
        "---\n- main\n",
        ["demo: meta/argument_specs.yml must be a mapping with an argument_specs mapping"],
        False,
    ),
    (
        "no-entry-point",
        "demo",
        "---\nargument_specs: {}\n",
        ["demo: meta/argument_specs.yml: argument_specs has no entry point"],
        False,
    ),
    (
        "no-short-description",
        "demo",
        "---\nargument_specs:\n  main:\n    options: {}\n",
        ["demo: meta/argument_specs.yml: argument_specs.main needs a short_description"],
        True,
    ),
    (
        "options-not-a-mapping",
        "demo",
        "---\nargument_specs:\n  main:\n    short_description: X\n    options: [a]\n",
        [
            "demo: meta/argument_specs.yml: argument_specs.main.options must be a mapping of "
            "option names to their specs"
        ],
        True,
    ),
]


@pytest.mark.parametrize(
    ("name", "spec", "expected", "has_readme"),
    [case[1:] for case in SPEC_FILE_CASES],
    ids=[case[0] for case in SPEC_FILE_CASES],
)
def test_scan_role_spec_file(
    tmp_path: Path, name: str, spec: str | None, expected: list[str], has_readme: bool
) -> None:
    role = make_role(tmp_path, name, None, "{}\n", spec=spec)
    result = role_docs.scan_role(role)
    assert list(result.problems) == expected
    assert (result.readme is not None) is has_readme


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("C(/dev/dri) and V(null)", "`/dev/dri` and `null`"),
        ("O(vllm_port) or O(vllm_x=1)", "`vllm_port` or `vllm_x=1`"),
        (
            "I(it) B(bold) M(community.general.rhsm_release)",
            "*it* **bold** `community.general.rhsm_release`",
        ),
        ("U(https://example.invalid/a)", "<https://example.invalid/a>"),
        ("L(the docs, https://example.invalid/d)", "[the docs](https://example.invalid/d)"),
        ('C("0") is the first', '`"0"` is the first'),
        ("V(a\\)b) escaped", "`a)b` escaped"),
        ("C(a`b)", "`` a`b ``"),
        ("ABC(x) is not markup", "ABC(x) is not markup"),
        ("folded\n  lines", "folded lines"),
    ],
)
def test_markup(text: str, expected: str) -> None:
    assert role_docs.markup(text) == expected


def _readme(options: str, defaults: str) -> str:
    spec = SPEC_HEAD + textwrap.indent(textwrap.dedent(options), "      ")
    entries, errors = role_docs.parse_spec(role_docs.parse_yaml(spec))
    assert errors == []
    loaded = role_docs.parse_yaml("---\n" + textwrap.dedent(defaults))
    assert isinstance(loaded, dict)
    return role_docs.render_readme("demo", entries, loaded)


def _row(readme: str, name: str) -> str:
    rows = [line for line in readme.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, readme
    return rows[0]


@pytest.mark.parametrize(
    ("options", "defaults", "name", "expected_row"),
    [
        (
            "demo_port: {type: int, default: 80, description: Port C(--port).}\n",
            "demo_port: 80\n",
            "demo_port",
            "| `demo_port` | int | `80` | Port `--port`. |",
        ),
        (
            "demo_root: {type: path, default: /, description: Root.}\n",
            "demo_root: \"{{ cardshare_host_root | default('/') }}\"\n",
            "demo_root",
            "| `demo_root` | path | `{{ cardshare_host_root \\| default('/') }}` (templated) "
            "| Root. |",
        ),
        (
            "demo_ids: {type: list, elements: str, default: [e223], description: Ids.}\n",
            "demo_ids: [e223]\n",
            "demo_ids",
            '| `demo_ids` | list of str | `["e223"]` | Ids. |',
        ),
        (
            """
            demo_state:
              default: started
              choices: [started, stopped]
              description: [First., Second.]
            """,
            "demo_state: started\n",
            "demo_state",
            "| `demo_state` | str | `started` | First.<br>Second.<br>"
            "Choices: `started`, `stopped`. |",
        ),
        (
            "demo_token: {type: str, required: true, description: Token.}\n",
            "{}\n",
            "demo_token",
            "| `demo_token` | str | *required* | **Required.** Token. |",
        ),
        (
            "demo_mask: {type: str, description: Mask.}\n",
            "demo_mask: null\n",
            "demo_mask",
            "| `demo_mask` | str | `null` | Mask. |",
        ),
        (
            """
            demo_list:
              type: list
              elements: dict
              default: []
              description: Things.
              options:
                size: {type: int, default: 1, description: Size.}
            """,
            "demo_list: []\n",
            "demo_list[].size",
            "| `demo_list[].size` | int | `1` | Size. |",
        ),
        (
            """
            demo_catalog:
              type: dict
              description: Catalog.
              default: {model-a: {context: 32768, quantization: awq, moe: false}}
            """,
            "demo_catalog: {model-a: {context: 32768, quantization: awq, moe: false}}\n",
            "demo_catalog",
            "| `demo_catalog` | dict | see [below](#default-demo_catalog) | Catalog. |",
        ),
    ],
)
def test_readme_rows(options: str, defaults: str, name: str, expected_row: str) -> None:
    assert _row(_readme(options, defaults), name) == expected_row


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (role_docs.Unsafe("{{ x }}"), '"{{ x }}"'),
        (role_docs.Vaulted("$ANSIBLE_VAULT;1.1;AES256"), '"!vault (encrypted)"'),
        ({"b": [role_docs.Unsafe("u")], "a": 1.5}, '{"a": 1.5, "b": ["u"]}'),
        ({1: "int key", "s": "str key"}, '{"1": "int key", "s": "str key"}'),
    ],
)
def test_show(value: object, expected: str) -> None:
    assert role_docs.show(value) == expected


def test_readme_vaulted_default() -> None:
    readme = _readme(
        "demo_secret: {type: str, default: x, description: Secret.}\n",
        "demo_secret: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162\n",
    )
    assert _row(readme, "demo_secret") == (
        "| `demo_secret` | str | *vault-encrypted in `defaults/main.yml`* | Secret. |"
    )


def test_readme_long_default_section() -> None:
    readme = _readme(
        """
        demo_catalog:
          type: dict
          description: Catalog.
          default: {model-a: {context: 32768, quantization: awq, moe: false}}
        """,
        "demo_catalog: {model-a: {context: 32768, quantization: awq, moe: false}}\n",
    )
    section = readme.split('<a id="default-demo_catalog"></a>\n', 1)[1].split("\n## ", 1)[0]
    assert section == (
        "### Default of `demo_catalog`\n\n```yaml\n"
        "demo_catalog:\n  model-a:\n    context: 32768\n    moe: false\n"
        "    quantization: awq\n```\n"
    )


def test_readme_layout() -> None:
    spec = """\
---
argument_specs:
  main:
    short_description: Run C(demo)
    description:
      - First paragraph.
      - Second O(demo_port).
    options:
      demo_port: {type: int, default: 80, description: Port.}
"""
    entries, errors = role_docs.parse_spec(role_docs.parse_yaml(spec))
    assert errors == []
    assert role_docs.render_readme("demo", entries, {"demo_port": 80}) == (
        "<!-- Generated from meta/argument_specs.yml by tools/role_docs.py; "
        "edit the spec, not this file. -->\n"
        "# cardshare.gpuhost.demo\n\n"
        "Run `demo`\n\n"
        "First paragraph.\n\n"
        "Second `demo_port`.\n\n"
        "## Variables\n\n"
        "| Name | Type | Default | Description |\n"
        "| --- | --- | --- | --- |\n"
        "| `demo_port` | int | `80` | Port. |\n\n"
        "## Usage\n\n"
        "```yaml\n"
        "- name: Apply cardshare.gpuhost.demo\n"
        "  hosts: gpuhosts\n"
        "  become: true\n"
        "  roles:\n"
        "    - role: cardshare.gpuhost.demo\n"
        "```\n\n"
        "---\n\n"
        "This file is generated from `meta/argument_specs.yml` by `tools/role_docs.py`; "
        "edit the spec and run `python tools/role_docs.py`, not this file.\n"
    )


def test_readme_usage_is_a_valid_play_naming_other_entry_points() -> None:
    spec = """\
---
argument_specs:
  main: {short_description: Main, options: {}}
  verify: {short_description: Verify only, options: {}}
"""
    entries, errors = role_docs.parse_spec(role_docs.parse_yaml(spec))
    assert errors == []
    readme = role_docs.render_readme("demo", entries, {})
    snippet = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    play = role_docs.parse_yaml(snippet)
    assert play == [
        {
            "name": "Apply cardshare.gpuhost.demo",
            "hosts": "gpuhosts",
            "become": True,
            "roles": [{"role": "cardshare.gpuhost.demo"}],
            "tasks": [
                {
                    "name": "Run the verify entry point of cardshare.gpuhost.demo",
                    "ansible.builtin.include_role": {
                        "name": "cardshare.gpuhost.demo",
                        "tasks_from": "verify",
                    },
                }
            ],
        }
    ]
    assert "### Entry point `main`" in readme
    assert "### Entry point `verify`" in readme


def test_readme_an_entry_point_aliasing_mains_options_gets_no_second_table() -> None:
    spec = """\
---
argument_specs:
  main:
    short_description: Main
    options: &options
      demo_size: {type: int, default: 3, description: A size.}
  preflight:
    short_description: Checks only
    options: *options
  other:
    short_description: Other
    options:
      demo_size: {type: int, default: 4, description: Another size.}
"""
    entries, errors = role_docs.parse_spec(role_docs.parse_yaml(spec))
    assert errors == []
    readme = role_docs.render_readme("demo", entries, {"demo_size": 3})
    preflight = readme.split("### Entry point `preflight`", 1)[1].split("## Usage", 1)[0]
    assert "The same variables as the entry point `main`." in preflight
    assert "| Name |" not in preflight
    other = readme.split("### Entry point `other`", 1)[1].split("### Entry point", 1)[0]
    assert "| `demo_size` |" in other and "The same variables" not in other


@pytest.mark.parametrize(
    "order",
    [
        ["demo_a", "demo_b", "demo_c"],
        ["demo_c", "demo_a", "demo_b"],
        ["demo_b", "demo_c", "demo_a"],
    ],
)
def test_readme_is_sorted_whatever_the_spec_order(order: list[str]) -> None:
    options = "".join(f"{n}: {{type: int, default: 1, description: {n}.}}\n" for n in order)
    readme = _readme(options, "".join(f"{n}: 1\n" for n in order))
    names = [line.split("`")[1] for line in readme.splitlines() if line.startswith("| `")]
    assert names == ["demo_a", "demo_b", "demo_c"]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (None, []),
        (
            "delete",
            ["role_docs: demo: README.md is missing; run python tools/role_docs.py"],
        ),
        (
            "append",
            [
                "role_docs: demo: README.md is stale (not what meta/argument_specs.yml "
                "generates); run python tools/role_docs.py"
            ],
        ),
    ],
)
def test_cli_check_after_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str | None, expected: list[str]
) -> None:
    role = make_role(
        tmp_path,
        "demo",
        "demo_port: {type: int, default: 80, description: Port.}\n",
        "demo_port: 80\n",
    )
    assert role_docs.main(["--roles-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "role_docs: wrote demo/README.md\n"
    readme = role / "README.md"
    if edit == "delete":
        readme.unlink()
    elif edit == "append":
        readme.write_text(readme.read_text(encoding="utf-8") + "hand edit\n", encoding="utf-8")
    code = role_docs.main(["--check", "--roles-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert captured.err.splitlines() == expected
    assert code == (1 if expected else 0)


def test_cli_write_is_idempotent_and_reports_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_role(
        tmp_path,
        "demo",
        "demo_port: {type: int, default: 80, description: Port.}\n",
        "demo_port: 81\n",
    )
    make_role(tmp_path, "plex", None, None)
    assert role_docs.main(["--roles-dir", str(tmp_path)]) == 1
    first = capsys.readouterr()
    assert first.out == "role_docs: wrote demo/README.md\n"
    assert first.err.splitlines() == [
        "role_docs: demo: demo_port: the spec's default differs from defaults/main.yml: "
        "spec 80, defaults/main.yml 81",
        "role_docs: plex: no meta/argument_specs.yml; every public role needs one "
        "(internal roles start with '_')",
    ]
    assert role_docs.main(["--roles-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().out == ""


def test_cli_missing_roles_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert role_docs.main(["--check", "--roles-dir", str(missing)]) == 2
    assert capsys.readouterr().err == f"role_docs: {missing} is not a directory\n"


def test_repository_roles_pass_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    """The real roles/: every README current, every spec in agreement with its defaults."""
    code = role_docs.main(["--check", "--roles-dir", str(REPO_ROLES)])
    assert capsys.readouterr().err == ""
    assert code == 0
