"""Generate each role's README from its ``meta/argument_specs.yml`` and check the spec.

    python tools/role_docs.py            write roles/*/README.md
    python tools/role_docs.py --check    exit 1 if a README is stale or a spec and its
                                         role's defaults/main.yml disagree

The argument spec is the one source of a role's variables: the README's variable table is
generated from it, never maintained by hand.  The checks:

- every public role (a name not starting with ``_``) has ``meta/argument_specs.yml``;
- every key of ``defaults/main.yml`` is an option of the spec, and every option of the spec
  is a key of ``defaults/main.yml`` (a required option must not have one: a default would
  make ``required`` meaningless);
- a spec default equals the literal ``defaults/main.yml`` value.  Ansible takes a missing
  spec default as null and always uses the role's defaults at run time, so a spec default
  that differs documents a value the role does not use.  A templated default
  (``"{{ cardshare_host_root | default('/') }}"``) cannot be compared; the README shows the
  template instead;
- a literal default is one of the option's ``choices``;
- the README on disk is what the spec generates.

The decisions (parsing a spec, checking, rendering) are pure functions of loaded YAML; only
``load_yaml``, ``scan_roles`` and ``main`` touch the file system.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml  # type: ignore[import-untyped,unused-ignore]

COLLECTION = "cardshare.gpuhost"
SPEC_FILE = "meta/argument_specs.yml"
DEFAULTS_FILE = "defaults/main.yml"
README_FILE = "README.md"
GENERATOR = "tools/role_docs.py"
REGENERATE = f"run python {GENERATOR}"
# A default whose one-line form is longer than this is shown in its own section.
INLINE_DEFAULT_MAX = 60


class Unsafe(str):
    """A string tagged ``!unsafe``: Ansible never templates it, so it is a literal."""

    __slots__ = ()


@dataclass(frozen=True)
class Vaulted:
    """A ``!vault`` value: encrypted, so it cannot be compared or shown."""

    ciphertext: str


class _AnsibleSafeLoader(yaml.SafeLoader):  # type: ignore[misc]
    """PyYAML's safe loader plus the two tags Ansible adds to YAML."""


def _construct_unsafe(loader: yaml.SafeLoader, node: yaml.Node) -> object:
    if isinstance(node, yaml.ScalarNode):
        return Unsafe(loader.construct_scalar(node))
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_mapping(node, deep=True)


def _construct_vault(loader: yaml.SafeLoader, node: yaml.Node) -> object:
    return Vaulted(str(loader.construct_scalar(node)))


_AnsibleSafeLoader.add_constructor("!unsafe", _construct_unsafe)
_AnsibleSafeLoader.add_constructor("!vault", _construct_vault)


def parse_yaml(text: str) -> object:
    """Parse one YAML document the way Ansible's loader sees its values."""
    return yaml.load(text, Loader=_AnsibleSafeLoader)


def load_yaml(path: Path) -> object:
    return parse_yaml(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------
# The spec as data


@dataclass(frozen=True)
class Option:
    name: str
    type: str
    elements: str | None
    required: bool
    has_default: bool
    default: object
    choices: tuple[object, ...] | None
    description: tuple[str, ...]
    suboptions: tuple[Option, ...]


@dataclass(frozen=True)
class EntryPoint:
    name: str
    short_description: str
    description: tuple[str, ...]
    options: tuple[Option, ...]


def _text_list(value: object) -> tuple[str, ...] | None:
    """A spec ``description``: a string or a list of strings; None when it is neither."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    return None


def _parse_options(raw: object, where: str, errors: list[str]) -> tuple[Option, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        errors.append(f"{where} must be a mapping of option names to their specs")
        return ()
    options: list[Option] = []
    for name in sorted(raw, key=str):
        here = f"{where}.{name}"
        spec = raw[name]
        if not isinstance(spec, Mapping):
            errors.append(f"{here} must be a mapping")
            continue
        description = _text_list(spec.get("description"))
        if description is None:
            errors.append(f"{here} needs a description (a string or a list of strings)")
            description = ()
        type_ = spec.get("type", "str")
        elements = spec.get("elements")
        if not isinstance(type_, str):
            errors.append(f"{here}.type must be a string")
            type_ = "str"
        if elements is not None and not isinstance(elements, str):
            errors.append(f"{here}.elements must be a string")
            elements = None
        choices = spec.get("choices")
        if choices is not None and not isinstance(choices, list):
            errors.append(f"{here}.choices must be a list")
            choices = None
        required = spec.get("required", False)
        if not isinstance(required, bool):
            errors.append(f"{here}.required must be true or false")
            required = False
        if required and "default" in spec:
            errors.append(f"{here} is required and has a default; a spec may say only one")
        suboptions = _parse_options(spec.get("options"), f"{here}.options", errors)
        options.append(
            Option(
                name=str(name),
                type=type_,
                elements=elements,
                required=required,
                has_default="default" in spec,
                default=spec.get("default"),
                choices=None if choices is None else tuple(choices),
                description=description,
                suboptions=suboptions,
            )
        )
    return tuple(options)


def parse_spec(data: object) -> tuple[tuple[EntryPoint, ...], list[str]]:
    """Entry points of a loaded ``meta/argument_specs.yml`` (sorted) and what is malformed."""
    errors: list[str] = []
    where = SPEC_FILE
    if not isinstance(data, Mapping) or not isinstance(data.get("argument_specs"), Mapping):
        return (), [f"{where} must be a mapping with an argument_specs mapping"]
    entries: list[EntryPoint] = []
    specs = data["argument_specs"]
    for name in sorted(specs, key=str):
        here = f"{where}: argument_specs.{name}"
        spec = specs[name]
        if not isinstance(spec, Mapping):
            errors.append(f"{here} must be a mapping")
            continue
        short = spec.get("short_description")
        if not isinstance(short, str) or not short.strip():
            errors.append(f"{here} needs a short_description")
            short = ""
        description = _text_list(spec.get("description", []))
        if description is None:
            errors.append(f"{here}.description must be a string or a list of strings")
            description = ()
        options = _parse_options(spec.get("options"), f"{here}.options", errors)
        entries.append(EntryPoint(str(name), short.strip(), description, options))
    if not entries and not errors:
        errors.append(f"{where}: argument_specs has no entry point")
    return tuple(entries), errors


# ---------------------------------------------------------------------------------------
# Values


def is_templated(value: object) -> bool:
    """True when Ansible would template the value (a Jinja expression or statement)."""
    if isinstance(value, Unsafe):
        return False
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, Mapping):
        return any(is_templated(k) or is_templated(v) for k, v in value.items())
    if isinstance(value, list):
        return any(is_templated(item) for item in value)
    return False


def values_equal(left: object, right: object) -> bool:
    """Equality as YAML means it: ``true`` is not ``1``, but ``1`` equals ``1.0``."""
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left == right
    if isinstance(left, int | float) and isinstance(right, int | float):
        return left == right
    if isinstance(left, str) and isinstance(right, str):
        return str(left) == str(right)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(values_equal, left, right))
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return set(left) == set(right) and all(values_equal(left[k], right[k]) for k in left)
    return type(left) is type(right) and left == right


def plain(value: object) -> object:
    """The value with Ansible's tagged types made plain, for dumping as JSON or YAML."""
    if isinstance(value, Vaulted):
        return "!vault (encrypted)"
    if isinstance(value, str):
        return str(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def show(value: object) -> str:
    """One-line form of a value for messages and the README (JSON, which is also YAML)."""
    value = plain(value)
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    except TypeError:  # keys of mixed types cannot be sorted
        return json.dumps(value, ensure_ascii=False, default=str)


def brief(value: object, limit: int = 100) -> str:
    """``show`` cut to ``limit`` characters, for messages about large values."""
    text = show(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def first_difference(left: object, right: object, path: str) -> tuple[str, object, object]:
    """Where two unequal values first differ: the path (``a.b[2]``) and both values there."""
    if isinstance(left, Mapping) and isinstance(right, Mapping) and set(left) == set(right):
        for key in sorted(left, key=str):
            if not values_equal(left[key], right[key]):
                return first_difference(left[key], right[key], f"{path}.{key}")
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            if not values_equal(a, b):
                return first_difference(a, b, f"{path}[{index}]")
    return path, left, right


# ---------------------------------------------------------------------------------------
# Checks


def check_role(
    role: str,
    entries: Sequence[EntryPoint],
    defaults: Mapping[str, object],
) -> list[str]:
    """Disagreements between a role's parsed spec and its loaded ``defaults/main.yml``."""
    problems: list[str] = []
    options: dict[str, list[Option]] = {}
    for entry in entries:
        for option in entry.options:
            options.setdefault(option.name, []).append(option)
    for name in sorted(set(defaults) - set(options)):
        problems.append(f"{name} is in {DEFAULTS_FILE} but not in {SPEC_FILE}")
    for name in sorted(options):
        for option in options[name]:
            problems.extend(_check_option(option, defaults))
    # one message per problem, even when several entry points share an option
    return [f"{role}: {p}" for p in dict.fromkeys(problems)]


def _check_option(option: Option, defaults: Mapping[str, object]) -> list[str]:
    name = option.name
    if name not in defaults:
        if option.required:
            return []
        return [f"{name} is in {SPEC_FILE} but not in {DEFAULTS_FILE}"]
    value = defaults[name]
    if option.required:
        return [
            f"{name} is required in {SPEC_FILE} but {DEFAULTS_FILE} sets it, "
            f"so it can never be missing"
        ]
    if is_templated(value) or isinstance(value, Vaulted):
        return []
    problems: list[str] = []
    spec_default = option.default
    if not option.has_default and value is not None:
        problems.append(
            f"{name}: the spec has no default (Ansible takes that as null) but "
            f"{DEFAULTS_FILE} sets {brief(value)}; add that value as the spec's default"
        )
    elif not values_equal(spec_default, value):
        where, ours, theirs = first_difference(spec_default, value, name)
        at = "" if where == name else f" at {where}"
        problems.append(
            f"{name}: the spec's default differs from {DEFAULTS_FILE}{at}: "
            f"spec {brief(ours)}, {DEFAULTS_FILE} {brief(theirs)}"
        )
    if option.choices is not None and value is not None:
        items = value if isinstance(value, list) and option.type == "list" else [value]
        bad = [i for i in items if not any(values_equal(i, c) for c in option.choices)]
        if bad:
            problems.append(
                f"{name}: {DEFAULTS_FILE}'s {show(value)} is not among the choices "
                f"{show(list(option.choices))}"
            )
    return problems


# ---------------------------------------------------------------------------------------
# Rendering

# Ansible's documentation markup.  C() I() B() U() L() M() end at the first ")"; the
# semantic O() V() RV() E() P() take backslash escapes.
_MARKUP = re.compile(
    r"(?<![A-Za-z0-9_])(?:"
    r"(?P<classic>[CIBUM])\((?P<ctext>[^)]*)\)"
    r"|L\((?P<ltext>[^,)]*),(?P<lurl>[^)]*)\)"
    r"|(?P<semantic>RV|[OVEP])\((?P<stext>(?:\\.|[^\\)])*)\)"
    r"|(?P<hr>HORIZONTALLINE)"
    r")"
)


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _markup_to_md(match: re.Match[str]) -> str:
    if match["hr"]:
        return "<hr>"
    if match["ltext"] is not None:
        return f"[{match['ltext'].strip()}]({match['lurl'].strip()})"
    if match["semantic"]:
        return _code(re.sub(r"\\(.)", r"\1", match["stext"]))
    kind, text = match["classic"], match["ctext"]
    if kind == "I":
        return f"*{text}*"
    if kind == "B":
        return f"**{text}**"
    if kind == "U":
        return f"<{text}>"
    return _code(text)


def markup(text: str) -> str:
    """Ansible doc markup (``C(x)``, ``O(x)``, ``V(x)``, ``I()``, ``B()``, ``L()``) as Markdown."""
    return _MARKUP.sub(_markup_to_md, " ".join(text.split()))


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (GFM needs ``\\|`` even inside code)."""
    return text.replace("|", "\\|")


def _type_text(option: Option) -> str:
    if option.elements:
        return f"{option.type} of {option.elements}"
    return option.type


def _anchor(path: str) -> str:
    return "default-" + re.sub(r"[^a-z0-9_-]", "-", path.lower())


def _default_text(
    option: Option, path: str, defaults: Mapping[str, object] | None, long: list[tuple[str, object]]
) -> str:
    """The Default cell; long values are queued in ``long`` for their own section."""
    if option.required:
        return "*required*"
    value = option.default
    if defaults is not None and option.name in defaults:
        # what the role really uses; equal to the spec's default unless the check fails
        value = defaults[option.name]
        if isinstance(value, Vaulted):
            return f"*vault-encrypted in `{DEFAULTS_FILE}`*"
        if is_templated(value):
            return f"{_code(show(value) if not isinstance(value, str) else value)} (templated)"
    if isinstance(value, str) and value and value.strip() == value and "\n" not in value:
        text = value
    else:
        text = show(value)
    if len(text) > INLINE_DEFAULT_MAX:
        long.append((path, value))
        return f"see [below](#{_anchor(path)})"
    return _code(text)


def _description_text(option: Option) -> str:
    parts = [markup(p) for p in option.description]
    if option.required:
        parts[:1] = [" ".join(["**Required.**", *parts[:1]])]
    if option.choices is not None:
        parts.append("Choices: " + ", ".join(_code(show_choice(c)) for c in option.choices) + ".")
    return "<br>".join(parts)


def show_choice(choice: object) -> str:
    return choice if isinstance(choice, str) else show(choice)


def _rows(
    options: Sequence[Option],
    prefix: str,
    defaults: Mapping[str, object] | None,
    long: list[tuple[str, object]],
) -> list[str]:
    rows: list[str] = []
    for option in options:
        path = prefix + option.name
        cells = (
            _code(path),
            _type_text(option),
            _default_text(option, path, defaults, long),
            _description_text(option),
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        if option.suboptions:
            sub = f"{path}[]." if option.type == "list" else f"{path}."
            rows.extend(_rows(option.suboptions, sub, None, long))
    return rows


def _entry_section(entry: EntryPoint, defaults: Mapping[str, object], heading: str) -> list[str]:
    long: list[tuple[str, object]] = []
    lines: list[str] = []
    if entry.options:
        lines += [
            "| Name | Type | Default | Description |",
            "| --- | --- | --- | --- |",
            *_rows(entry.options, "", defaults, long),
        ]
    else:
        lines.append("This entry point has no variables.")
    for path, value in long:
        block = yaml.safe_dump(
            {path: plain(value)}, sort_keys=True, default_flow_style=False, allow_unicode=True
        )
        lines += [
            "",
            f'<a id="{_anchor(path)}"></a>',
            f"{heading}# Default of `{path}`",
            "",
            "```yaml",
            block.rstrip("\n"),
            "```",
        ]
    return lines


def _usage(role: str, entries: Sequence[EntryPoint]) -> list[str]:
    fqcn = f"{COLLECTION}.{role}"
    lines = [
        "```yaml",
        f"- name: Apply {fqcn}",
        "  hosts: gpuhosts",
        "  become: true",
    ]
    names = [e.name for e in entries]
    if "main" in names or not names:
        lines += ["  roles:", f"    - role: {fqcn}"]
    others = [n for n in names if n != "main"]
    if others:
        lines.append("  tasks:")
        for name in others:
            lines += [
                f"    - name: Run the {name} entry point of {fqcn}",
                "      ansible.builtin.include_role:",
                f"        name: {fqcn}",
                f"        tasks_from: {name}",
            ]
    lines.append("```")
    return lines


def render_readme(role: str, entries: Sequence[EntryPoint], defaults: Mapping[str, object]) -> str:
    """The README of a role: deterministic, so ``--check`` can compare it byte for byte."""
    fqcn = f"{COLLECTION}.{role}"
    main = next((e for e in entries if e.name == "main"), entries[0] if entries else None)
    lines = [
        f"<!-- Generated from {SPEC_FILE} by {GENERATOR}; edit the spec, not this file. -->",
        f"# {fqcn}",
        "",
    ]
    if main is not None and main.short_description:
        lines += [markup(main.short_description), ""]
    if main is not None:
        for paragraph in main.description:
            lines += [markup(paragraph), ""]
    lines += ["## Variables", ""]
    if len(entries) == 1:
        lines += _entry_section(entries[0], defaults, "##")
    else:
        for entry in entries:
            lines += ["", f"### Entry point `{entry.name}`", ""]
            if entry is not main:
                if entry.short_description:
                    lines += [markup(entry.short_description), ""]
                for paragraph in entry.description:
                    lines += [markup(paragraph), ""]
            same = main is not None and entry.options and entry.options == main.options
            if entry is not main and same:
                # an alias of main's options (as a preflight entry point has): no second table
                lines.append("The same variables as the entry point `main`.")
                continue
            lines += _entry_section(entry, defaults, "###")
    lines += [
        "",
        "## Usage",
        "",
        *_usage(role, entries),
        "",
        "---",
        "",
        f"This file is generated from `{SPEC_FILE}` by `{GENERATOR}`; "
        f"edit the spec and run `python {GENERATOR}`, not this file.",
    ]
    while lines[2:4] == ["", ""]:
        del lines[2]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# The file system edge


@dataclass(frozen=True)
class RoleResult:
    role: str
    readme_path: Path | None
    readme: str | None
    problems: tuple[str, ...]


def _load_defaults(role_dir: Path, role: str, problems: list[str]) -> dict[str, object]:
    path = role_dir / DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        data = load_yaml(path)
    except yaml.YAMLError as exc:
        problems.append(f"{role}: {DEFAULTS_FILE} is not valid YAML: {exc}")
        return {}
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        problems.append(f"{role}: {DEFAULTS_FILE} must be a mapping of variables")
        return {}
    return {str(k): v for k, v in data.items()}


def scan_role(role_dir: Path) -> RoleResult:
    """Read one role and return its README text (None without a spec) and its problems."""
    role = role_dir.name
    spec_path = role_dir / SPEC_FILE
    if not spec_path.is_file():
        problems: tuple[str, ...] = ()
        if not role.startswith("_"):
            problems = (
                f"{role}: no {SPEC_FILE}; every public role needs one "
                f"(internal roles start with '_')",
            )
        return RoleResult(role, None, None, problems)
    found: list[str] = []
    try:
        raw = load_yaml(spec_path)
    except yaml.YAMLError as exc:
        return RoleResult(role, None, None, (f"{role}: {SPEC_FILE} is not valid YAML: {exc}",))
    entries, errors = parse_spec(raw)
    found += [f"{role}: {e}" for e in errors]
    defaults = _load_defaults(role_dir, role, found)
    found += check_role(role, entries, defaults)
    readme = render_readme(role, entries, defaults) if entries else None
    return RoleResult(role, role_dir / README_FILE, readme, tuple(found))


def scan_roles(roles_dir: Path) -> list[RoleResult]:
    return [
        scan_role(d)
        for d in sorted(roles_dir.iterdir())
        if d.is_dir() and not d.name.startswith(".")
    ]


def stale_readmes(results: Sequence[RoleResult]) -> list[str]:
    problems: list[str] = []
    for result in results:
        if result.readme_path is None or result.readme is None:
            continue
        if not result.readme_path.is_file():
            problems.append(f"{result.role}: {README_FILE} is missing; {REGENERATE}")
        elif result.readme_path.read_text(encoding="utf-8") != result.readme:
            problems.append(
                f"{result.role}: {README_FILE} is stale (not what {SPEC_FILE} generates); "
                f"{REGENERATE}"
            )
    return problems


def write_readmes(results: Sequence[RoleResult]) -> list[Path]:
    written: list[Path] = []
    for result in results:
        if result.readme_path is None or result.readme is None:
            continue
        path = result.readme_path
        if not path.is_file() or path.read_text(encoding="utf-8") != result.readme:
            path.write_text(result.readme, encoding="utf-8")
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a README is stale or a spec and its defaults disagree",
    )
    parser.add_argument(
        "--roles-dir",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "roles",
        help="the collection's roles directory (default: roles/ beside tools/)",
    )
    args = parser.parse_args(argv)
    roles_dir: Path = args.roles_dir
    if not roles_dir.is_dir():
        print(f"role_docs: {roles_dir} is not a directory", file=sys.stderr)
        return 2
    results = scan_roles(roles_dir)
    problems = [p for r in results for p in r.problems]
    if args.check:
        problems += stale_readmes(results)
    else:
        for path in write_readmes(results):
            print(f"role_docs: wrote {path.parent.name}/{path.name}")
    for problem in problems:
        print(f"role_docs: {problem}", file=sys.stderr)
    if problems:
        return 1
    documented = sum(1 for r in results if r.readme is not None)
    if args.check:
        print(f"role_docs: {documented} role README(s) up to date, specs agree with defaults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
