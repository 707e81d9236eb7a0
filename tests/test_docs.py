"""The README and docs/ say what the code does: the generated config reference is current and names every
field, every `paralm` command in a code block parses with paralm's own parser (its config overrides naming
real fields), the README stays short, and every link, file path and module the pages name exists."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import shlex
import typing
from pathlib import Path

import pytest

from paralm.cli import build_parser, check_ranges
from paralm.config.load import load_config
from paralm.config.reference import REGENERATE, _trailing_comments, config_reference
from paralm.config.schema import Config
from paralm.config.source import parse_overrides
from paralm.errors import UserError
from paralm.models.config import flat_fields
from paralm.models.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_LIMIT = 16_000

# Verbs that refuse config overrides (each calls `refuse_overrides`): a README line giving them one would fail.
NO_OVERRIDES = {"export", "verify", "data", "quantize", "prune"}


def _sections() -> dict[str, list[str]]:
    """Each section's field names; `[model]`'s of every family."""
    hints = typing.get_type_hints(Config)
    families = [flat_fields(spec.options) for spec in FAMILIES.values()]
    return {
        f.name: list(dict.fromkeys(k for fields in families for k in fields))
        if f.name == "model"
        else [field.name for field in dataclasses.fields(hints[f.name])]
        for f in dataclasses.fields(Config)
    }


def _all_fields() -> list[tuple[str, str]]:
    return [(section, name) for section, names in _sections().items() for name in names]


# ---------------------------------------------------------------------------------------------- config.md


def test_config_reference_is_current():
    page = (DOCS / "config.md").read_text()
    assert page == config_reference(), f"docs/config.md is out of date with the config dataclasses: run `{REGENERATE}`"


@pytest.mark.parametrize("section,name", _all_fields())
def test_config_reference_lists_every_field(section, name):
    page = (DOCS / "config.md").read_text()
    table = page.split(f"## `[{section}]`", 1)
    assert len(table) == 2, f"docs/config.md has no section [{section}]"
    rows = table[1].split("\n## ", 1)[0]
    assert f"| `{name}` |" in rows, f"docs/config.md does not list {section}.{name}"


def test_config_reference_describes_fields_with_their_help_and_defaults():
    page = config_reference()
    assert "| `steps` | `int` | `500` | optimizer steps to reach (a resumed run continues up to it) |" in page
    assert '| `dtype` | `str` | `"fp32"` | compute dtype (master weights stay fp32) (one of `"fp32"`' in page
    assert "| `pp_split` | `list[int]` | `[]` |" in page
    assert "&lt;run.dir&gt;" not in page and "&lt;run.dir>/tensorboard" in page  # no raw HTML in a cell


def test_a_field_without_help_takes_its_trailing_comment():
    @dataclasses.dataclass
    class Example:
        plain: int = 3  # the comment that describes it
        multi: str = dataclasses.field(
            default="x",  # not this one: the logical line goes on
        )  # this one
        bare: float = 1.0

        def method(self) -> int:
            return self.plain  # not a field's

    assert _trailing_comments(Example) == {"plain": "the comment that describes it", "multi": "this one"}


# ------------------------------------------------------------------------------------- commands in the pages


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def _strip_comment(line: str) -> str:
    """Drop a shell comment: a `#` at the start or after a blank, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _logical_lines(block: str) -> list[str]:
    lines, pending = [], ""
    for raw in block.splitlines():
        line = _strip_comment(raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def _paralm_argv(segment: list[str]) -> list[str] | None:
    """`paralm VERB ...`, or `torchrun ... -m paralm VERB ...` / `python -m paralm ...`: the argv after paralm."""
    if segment and segment[0] == "paralm":
        return segment[1:]
    for i in range(len(segment) - 1):
        if segment[i] == "-m" and segment[i + 1] == "paralm":
            return segment[i + 2 :]
    return None


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """Every paralm command in the text's fenced code blocks, as (the line, its argv)."""
    found = []
    for block in _fenced_blocks(text):
        for line in _logical_lines(block):
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = ""
            try:
                tokens = list(lexer)
            except ValueError:  # not shell (a layout listing, program output)
                continue
            segment: list[str] = []
            for token in [*tokens, ";"]:
                if token in (";", "&&", "||", "|", "&"):
                    argv = _paralm_argv(segment)
                    if argv is not None:
                        found.append((line.strip(), argv))
                    segment = []
                else:
                    segment.append(token)
    return found


def _page_commands() -> list[tuple[str, str, list[str]]]:
    return [(page.name, line, argv) for page in PAGES for line, argv in _commands(page.read_text())]


def _parse(argv: list[str]):
    """paralm's own parser, without running the verb: (namespace, leftover arguments) or the error it prints."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_known_args(argv), None
        except SystemExit:
            return None, err.getvalue().strip()


def _check_overrides(overrides: list[str], where: str) -> dict[str, dict[str, str]]:
    try:
        parsed = parse_overrides(overrides)
    except UserError as e:
        raise AssertionError(f"{where}: {e}") from None
    sections = _sections()
    for section, values in parsed.items():
        assert section in sections, f"{where}: no config section [{section}]"
        names = set(sections[section])
        for name in values:
            assert name in names, f"{where}: --{section}.{name} names no config field"
    return parsed


def _check_field(assignment: str, where: str) -> None:
    """`FIELD=...` of `paralm sweep --grid/--sample`: FIELD is section.field."""
    field = assignment.split("=", 1)[0]
    _check_overrides([f"--{field}=0"], where)


ELLIPSIS = "..."  # "the same command as above, and": required arguments may be left out


def test_the_pages_have_commands_to_check():
    commands = _page_commands()
    readme_verbs = {argv[0] for page, _, argv in commands if page == "README.md" and argv}
    tour = {"train", "eval", "generate", "export", "import", "data", "plan", "simulate", "calibrate", "verify"}
    assert readme_verbs >= tour | {"compare", "sweep", "quantize", "prune"}
    assert readme_verbs == set(build_parser()._subparsers._group_actions[0].choices), "a verb missing from the tour"
    assert len(commands) > 60


@pytest.mark.parametrize("page,line,argv", _page_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_command_in_the_pages_parses(page, line, argv):
    where = f"{page}: {line}"
    elided = ELLIPSIS in argv
    argv = [a for a in argv if a != ELLIPSIS]
    parsed, error = _parse(argv)
    if error is not None:
        left_out = re.search(r"the following arguments are required|one of the arguments .* is required", error)
        assert elided and left_out, f"{where}: {error}"
        return
    args, rest = parsed
    try:
        check_ranges(args)
    except UserError as e:
        raise AssertionError(f"{where}: {e}") from None
    verb = argv[0]
    if rest:
        assert verb not in NO_OVERRIDES, f"{where}: {verb} takes no config overrides, got {rest}"
        assert getattr(args, "tasks", None) is None, f"{where}: eval --tasks takes no config overrides"
    _check_overrides(rest, where)
    for assignment in [*(getattr(args, "grid", None) or []), *(getattr(args, "sample", None) or [])]:
        _check_field(assignment, where)
    for layout in getattr(args, "layout", None) or []:  # compare --layout NAME=ARGS
        _check_overrides(shlex.split(layout.split("=", 1)[1]), where)
    config = getattr(args, "config", None)
    if verb in ("train", "plan", "simulate", "compare", "sweep") and not elided:
        path = ROOT / config if config else None
        try:  # the config loader and its rules, on the file where the repository has it
            load_config(path if path and path.is_file() else None, rest)
        except UserError as e:
            raise AssertionError(f"{where}: {e}") from None


def test_the_command_reader_handles_shell_forms():
    block = "\n".join(
        [
            "```bash",
            "pip install -e . && paralm train   # a comment",
            "torchrun --nproc-per-node 2 -m paralm train --config configs/tiny.toml \\",
            "         --train.steps=3",
            'paralm eval --run r; paralm generate --run r --prompt "# not a comment"',
            "ray start --head --port 6379",
            "```",
        ]
    )
    assert [argv for _, argv in _commands(block)] == [
        ["train"],
        ["train", "--config", "configs/tiny.toml", "--train.steps=3"],
        ["eval", "--run", "r"],
        ["generate", "--run", "r", "--prompt", "# not a comment"],
    ]


def test_a_wrong_override_is_caught():
    (args, rest), _ = _parse(["train", "--train.stepz=3"])
    with pytest.raises(AssertionError, match="names no config field"):
        _check_overrides(rest, "example")
    assert _parse(["train", "--nproc"])[1]  # argparse's own error


# ------------------------------------------------------------------------------------------- size and links


def test_readme_is_short():
    size = len(README.read_text())
    assert size < README_LIMIT, f"README.md has {size:,} characters (limit {README_LIMIT:,}): move a topic to docs/"


def test_readme_keeps_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in README.read_text()


def _prose(text: str) -> str:
    """The text without fenced blocks or inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "code", text)


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    anchors = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_exists(page):
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no heading or anchor #{anchor} in {path.name})")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_one_list_of_pages_the_index_links_every_page_and_the_readme_the_index():
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    index = {Path(link.partition("#")[0]).name for link in _links(DOCS / "index.md")}
    assert pages <= index, f"docs/index.md does not link {sorted(pages - index)}"
    assert "docs/index.md" in _links(README), "README.md does not link docs/index.md, the list of pages"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_machine_paths(page):
    found = re.findall(r"(?<![\w.])/(?:work|home|Users|root|mnt)/[^\s`)]*", page.read_text())
    assert not found, f"{page.name} names paths of one machine: {found}: describe them from the repository instead"


# -------------------------------------------------------------------------------- files and modules named

TOP = {"src", "tests", "benchmarks", "configs", "examples", "docs"}
SOURCE = ROOT / "src" / "paralm"


def _inline_code(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return [code.split()[0] for code in re.findall(r"`([^`\n]+)`", text) if code.strip()]


def _missing_path(token: str) -> bool | None:
    """Whether a repository path named in inline code is missing (None: not a path)."""
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)+/?", token):
        return None
    first = token.split("/", 1)[0]
    if first in TOP:
        return not (ROOT / token).exists()
    if first == "paralm":
        return not (SOURCE.parent / token).exists()
    if token.endswith(".py"):  # models/registry.py: inside the package
        return not (SOURCE / token).exists()
    return None


def _top_level_names(module: Path) -> set[str]:
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _missing_module(token: str) -> str | None:
    """`paralm.a.b.Name(...)`: the module must exist and define Name (read with ast, nothing imported)."""
    match = re.match(r"paralm(\.\w+)+", token)
    if not match:
        return None
    parts = match.group(0).split(".")
    for end in range(len(parts), 0, -1):
        base = SOURCE.parent.joinpath(*parts[:end])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            rest = parts[end:]
            if rest and rest[0] not in _top_level_names(module):
                return f"{'.'.join(parts[:end])} defines no {rest[0]}"
            return None
    return f"no module {match.group(0)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_and_module_named_exists(page):
    problems = []
    for token in _inline_code(page):
        if _missing_path(token):
            problems.append(f"{token}: no such file")
        elif why := _missing_module(token):
            problems.append(f"{token}: {why}")
    assert not problems, f"{page.name}: " + "; ".join(problems)
