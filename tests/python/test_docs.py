"""The docs cannot drift from the code (docs/testing.md, "The docs test"): README.md,
CHANGELOG.md and docs/*.md are checked against the binary and the repository.

- docs/configuration.md has a row for every key the daemon's config accepts (asked of the
  binary: its config refuses unknown keys and lists the ones it expects) and every key of
  config.example.toml, none the code lacks, and config.example.toml's defaults;
- every `shardd ...` command names a subcommand and flags that `--help` lists; every repo
  script a command runs exists and defines the flags it is given;
- Python blocks compile, TOML/JSON/YAML blocks parse, and a TOML config passes
  `shardd check --offline`;
- metric names exist in src/, every alert has a runbook section, repo paths and links exist.

Black box: nothing here parses Rust, so src/ may move freely beneath it.
"""

import functools
import json
import re
import shlex
import subprocess
import textwrap
import tomllib

import pytest
import yaml

from conftest import ROOT, SHARDD

DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIG_DOC = ROOT / "docs" / "configuration.md"
EXAMPLE = ROOT / "config.example.toml"
# Paths the docs name that the src/ reorganisation (issue 25) has not created yet. Remove an
# entry once its file lands; the test then holds the docs to it like every other path.
PENDING_PATHS = set()


def rel(path):
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------
# Markdown: fenced blocks and the text outside them.


def parse_markdown(text, where):
    """Returns (blocks, prose): blocks as (language, dedented text, first line number); prose
    is the text outside the blocks."""
    blocks, prose, current = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if current is None and fence:
            current = (fence.group(1), number, [])
        elif current is not None and re.match(r"^\s*```\s*$", line):
            language, start, lines = current
            blocks.append((language, textwrap.dedent("\n".join(lines)), start))
            current = None
        elif current is not None:
            current[2].append(line)
        else:
            prose.append(line)
    assert current is None, f"{where}: a code block opened at line {current[1]} is never closed"
    return blocks, "\n".join(prose)


@functools.cache
def markdown(path):
    return parse_markdown(path.read_text(), rel(path))


def inline_spans(text):
    """Inline code spans of prose (a span may wrap a line, never a paragraph)."""
    return [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", text) if "\n\n" not in s]


def all_blocks(*languages):
    for path in DOCS:
        for language, text, line in markdown(path)[0]:
            if language in languages:
                yield path, text, line


# ---------------------------------------------------------------------------------------------
# The binary's command line, from its --help.


def run(*args, check=False):
    return subprocess.run([SHARDD, *args], capture_output=True, text=True, timeout=30, check=check)


@functools.cache
def help_text(*subcommand):
    return run(*subcommand, "--help", check=True).stdout


def section(text, title):
    """The indented lines under `title:` in clap's help."""
    match = re.search(rf"^{title}:\n((?:[ \t]+.*\n?)*)", text, re.M)
    return match.group(1) if match else ""


@functools.cache
def subcommands():
    return {line.split()[0] for line in section(help_text(), "Commands").splitlines() if line.strip()}


@functools.cache
def flags(*subcommand):
    """Every flag an options line of the help names: `-o, --output <OUTPUT>  ...`, and aliases."""
    found = set()
    for line in section(help_text(*subcommand), "Options").splitlines():
        spec = line.strip().split("  ")[0]
        found.update(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", spec))
        for aliases in re.findall(r"\[alias(?:es)?: ([^\]]+)\]", line):
            found.update(a.strip() for a in aliases.split(","))
    return frozenset(found)


# ---------------------------------------------------------------------------------------------
# Commands in the docs.

OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "(", ")"}


def shell_commands(text):
    """Simple commands (token lists) of a shell snippet; quoted arguments that are themselves
    commands (ssh --command='...', sh -c '...') are searched too."""
    text = re.sub(r"\\\n", " ", text)
    commands = []
    for line in text.splitlines():
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
        except ValueError:
            tokens = line.split()
        current = []
        for token in tokens + [";"]:
            if token in OPERATORS:
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
                if " " in token and re.search(r"\bshardd\b|\.py\b|\.sh\b", token):
                    commands.extend(shell_commands(token.split("=", 1)[-1] if token.startswith("--") else token))
    return commands


def strip_prefix(tokens):
    """Drops VAR=value assignments and sudo/exec/env in front of a command."""
    tokens = list(tokens)
    while tokens and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]) or tokens[0] in ("sudo", "exec", "env")):
        tokens.pop(0)
    return tokens


def shardd_argv(tokens):
    """The arguments after `shardd` when the command runs shardd, else None."""
    tokens = strip_prefix(tokens)
    if not tokens:
        return None
    if tokens[0] == "shardd" or (tokens[0].endswith("/shardd") and "/" in tokens[0]):
        return tokens[1:]
    if tokens[:2] == ["cargo", "run"] and "--" in tokens:
        return tokens[tokens.index("--") + 1:]
    return None


def script_call(tokens):
    """(script path, its arguments) when the command runs a repository script."""
    tokens = strip_prefix(tokens)
    while tokens and (tokens[0] in ("bash", "sh", "python", "python3") or tokens[0].endswith("/python")):
        tokens.pop(0)
    if tokens and re.match(r"^(bench|examples|scripts|tests/soak|fuzz)/[\w/.-]+\.(py|sh)$", tokens[0]):
        return tokens[0], tokens[1:]
    return None


def documented_commands():
    """(where, tokens) of every command in shell blocks and inline code spans."""
    for path, text, line in all_blocks("sh", "bash", "shell", "console", ""):
        for tokens in shell_commands(text):
            yield f"{rel(path)}:{line}", tokens
    for path in DOCS:
        for span in inline_spans(markdown(path)[1]):
            if re.match(r"^(\S*/)?shardd |^cargo run |^(bench|examples|tests/soak|scripts|fuzz)/\S+\.(py|sh)\b", span):
                for tokens in shell_commands(span):
                    yield f"{rel(path)} `{span}`", tokens


def check_shardd(argv):
    """Problems with one shardd command line: an unknown subcommand or flag."""
    words = [a.strip("[]") for a in argv]
    subcommand = next((w for w in words if w in subcommands()), None)
    if subcommand is None and words and not words[0].startswith("-"):
        return [f"no subcommand {words[0]!r} (shardd has {sorted(subcommands())})"]
    known = flags() | (flags(subcommand) if subcommand else frozenset())
    problems = []
    for word in words:
        if word == "--" or not re.match(r"^--?[a-zA-Z]", word):
            continue
        flag = word.split("=", 1)[0]
        if flag not in known:
            problems.append(f"shardd {subcommand or ''} has no flag {flag} (it has {sorted(known)})")
    return problems


def test_every_documented_shardd_command_exists_with_its_flags():
    problems, seen = [], 0
    for where, tokens in documented_commands():
        argv = shardd_argv(tokens)
        if argv is None:
            continue
        seen += 1
        problems += [f"{where}: {p}" for p in check_shardd(argv)]
    assert seen >= 20, f"found only {seen} shardd commands in the docs: is the parser broken?"
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_a_wrong_flag_and_subcommand():
    assert check_shardd(["plan", "--config", "c.toml", "--hosts", "4"]) == []
    assert check_shardd(["check", "--offline", "--config", "c.toml"]) == []
    assert check_shardd(["index", "p", "-o", "out"]) == []
    assert check_shardd(["plan", "--nodes", "4"])
    assert check_shardd(["frobnicate", "--config", "c.toml"])


def test_every_documented_script_exists_with_its_flags():
    problems, seen = [], 0
    for where, tokens in documented_commands():
        call = script_call(tokens)
        if call is None:
            continue
        seen += 1
        script, args = call
        path = ROOT / script
        if not path.is_file():
            problems.append(f"{where}: {script} does not exist")
            continue
        # A wrapper (tests/soak/run.sh) passes its flags to a script beside it.
        source = "\n".join(p.read_text() for p in path.parent.iterdir() if p.suffix in (".py", ".sh"))
        for arg in args:
            flag = arg.strip("[]").split("=", 1)[0]
            if re.match(r"^--[a-z]", flag) and f'"{flag}"' not in source and f"{flag})" not in source:
                problems.append(f"{where}: {script} defines no flag {flag}")
    for where, tokens in documented_commands():
        tokens = strip_prefix(tokens)
        if tokens[:2] == ["cargo", "run"] and "--example" in tokens:
            example = tokens[tokens.index("--example") + 1]
            if not (ROOT / "examples" / f"{example}.rs").is_file():
                problems.append(f"{where}: no example {example} in examples/")
    assert seen >= 10, f"found only {seen} script commands in the docs: is the parser broken?"
    assert not problems, "\n".join(problems)


def test_readme_quick_start_is_the_two_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks, _ = parse_markdown(quick, "README.md, Quick start")
    commands = [c for _, block, _ in blocks for c in shell_commands(block)]
    assert commands == [["cargo", "run", "--release", "--", "demo"], ["bash", "scripts/test.sh"]]
    assert len(text.splitlines()) <= 200, "README.md is the front door: at most ~200 lines"


# ---------------------------------------------------------------------------------------------
# Snippets.


def test_python_snippets_compile():
    count = 0
    for path, text, line in all_blocks("python", "py"):
        count += 1
        try:
            compile(text, f"{rel(path)}:{line}", "exec")
        except SyntaxError as e:
            pytest.fail(f"{rel(path)}, the Python block at line {line} does not compile: {e}")
    assert count >= 10


def test_data_snippets_parse_and_configs_validate(tmp_path):
    for path, text, line in all_blocks("toml"):
        try:
            parsed = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            pytest.fail(f"{rel(path)}, the TOML block at line {line}: {e}")
        if "datasets" in parsed:
            config = tmp_path / f"{path.stem}-{line}.toml"
            config.write_text(text)
            result = run("check", "--offline", "--config", str(config))
            assert result.returncode == 0, f"{rel(path)}, the config at line {line}: {result.stderr}"
    for path, text, line in all_blocks("json"):
        json.loads(text)
    for path, text, line in all_blocks("yaml", "yml"):
        yaml.safe_load(text)


# ---------------------------------------------------------------------------------------------
# The configuration reference.

# One config per table with an unknown key: the daemon's error lists what the table accepts.
PROBES = {
    "": "zz_probe = 1\n",
    "server": "[server]\nzz_probe = 1\n",
    "host": "[host]\nzz_probe = 1\n",
    "cache": "[cache]\nzz_probe = 1\n",
    "store": "[store]\nzz_probe = 1\n",
    "gcs": "[gcs]\nzz_probe = 1\n",
    "s3": "[s3]\nzz_probe = 1\n",
    "datasets.NAME": "[datasets.x]\nzz_probe = 1\n",
    "schedule": "[datasets.x]\nmix = { a = 1 }\nschedule = [{ epoch = 1, mix = { a = 1 }, zz_probe = 1 }]\n",
}


def code_keys(tmp_dir):
    """{table: keys} the daemon's config accepts, from the errors of the probes."""
    keys = {}
    for table, text in PROBES.items():
        config = tmp_dir / f"probe-{table or 'top'}.toml"
        config.write_text(text)
        result = run("check", "--offline", "--config", str(config))
        match = re.search(r"unknown field `zz_probe`, expected (.*)", result.stderr)
        assert result.returncode == 1 and match, f"probe of [{table}]: {result.stderr}"
        keys[table] = set(re.findall(r"`([^`]+)`", match.group(1)))
    return keys


def documented_keys():
    """{table: {key: default cell}} from docs/configuration.md: a heading names the table
    (## `[server]`, ## `[datasets.NAME]`, ### `schedule` entries), its table rows the keys."""
    tables, table = {}, None
    for line in CONFIG_DOC.read_text().splitlines():
        heading = re.match(r"^#{2,3} `\[?([\w.]+)\]?`", line)
        if heading:
            table = heading.group(1)
            tables.setdefault(table, {})
        elif re.match(r"^#{1,3} ", line):
            table = None
        elif table is not None:
            row = re.match(r"^\| `([a-z_]+)` \| ([^|]*) \|", line)
            if row:
                assert row.group(1) not in tables[table], f"{table}.{row.group(1)} documented twice"
                tables[table][row.group(1)] = row.group(2).strip()
    tables[""] = {t.split(".")[0]: "" for t in tables if t.startswith(("server", "host", "cache", "store", "gcs", "s3", "datasets"))}
    return tables


def example_keys():
    """{table: keys} of config.example.toml, commented-out ones included."""
    tables, table = {"": set()}, ""
    for line in EXAMPLE.read_text().splitlines():
        header = re.match(r"^#?\[([\w.]+)\]\s*$", line)
        if header:
            table = "datasets.NAME" if header.group(1).startswith("datasets.") else header.group(1)
            tables.setdefault(table, set())
            tables[""].add(table.split(".")[0])
            continue
        key = re.match(r"^#?([a-z_]+)\s*=\s*\S", line)
        if key:
            tables[table].add(key.group(1))
    return tables


def test_config_reference_has_every_key(tmp_path):
    code = code_keys(tmp_path)
    docs = documented_keys()
    example = example_keys()
    problems = []
    for table, keys in code.items():
        name = f"[{table}]" if table else "the top level"
        documented = set(docs.get(table, {}))
        for key in sorted(keys - documented):
            problems.append(f"{name}: the config accepts `{key}`, docs/configuration.md does not document it")
        for key in sorted(documented - keys):
            problems.append(f"{name}: docs/configuration.md documents `{key}`, which the config refuses")
    for table, keys in example.items():
        documented = set(docs.get(table, {}))
        for key in sorted(keys - documented):
            problems.append(f"config.example.toml has `{key}` in [{table}], docs/configuration.md does not")
    assert set(code) - {""} <= set(docs), f"tables without a section: {set(code) - set(docs)}"
    assert not problems, "\n".join(problems)


def test_config_reference_defaults_are_the_example_defaults():
    docs = documented_keys()
    example = tomllib.loads(EXAMPLE.read_text())
    sections = [(t, example.get(t, {})) for t in ("server", "host", "cache", "store")]
    sections.append(("datasets.NAME", example["datasets"]["train"]))
    problems, checked = [], 0
    for table, values in sections:
        for key, value in values.items():
            cell = docs.get(table, {}).get(key)
            if cell is None:
                continue  # test_config_reference_has_every_key names it
            literal = re.fullmatch(r"`([^`]+)`", cell)
            if literal:
                documented = tomllib.loads(f"v = {literal.group(1)}")["v"]
                checked += 1
                if documented != value:
                    problems.append(f"[{table}] {key}: docs say {literal.group(1)}, config.example.toml {value!r}")
            elif "required" not in cell:
                problems.append(f"[{table}] {key}: the default column should be `{value!r}` as a TOML value, not {cell!r}")
    assert checked >= 25
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# Names: metrics, alerts, paths, links.


@functools.cache
def rust_sources():
    return "\n".join(p.read_text() for p in (ROOT / "src").rglob("*.rs"))


def test_documented_metrics_exist():
    names = set()
    for path in DOCS:
        names.update(re.findall(r"\bshardd_[a-z][a-z0-9_]*", path.read_text()))
    assert len(names) >= 30
    missing = []
    for name in sorted(names):
        base = re.sub(r"_(bucket|sum|count)$", "", name[len("shardd_"):])
        if f'"{base}"' not in rust_sources() and f'"{name[len("shardd_"):]}"' not in rust_sources():
            missing.append(name)
    assert not missing, f"metrics the docs name that src/ does not register: {missing}"


def test_every_alert_has_a_runbook_section():
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "shardd-rules.yml").read_text())
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
    headings = set(re.findall(r"^### (\w+)\s*$", (ROOT / "docs" / "operations.md").read_text(), re.M))
    assert alerts and not set(alerts) - headings, f"alerts without a runbook section in docs/operations.md: {set(alerts) - headings}"


PATH = re.compile(
    r"(?<![\w./:-])((?:src|docs|deploy|bench|examples|tests|clients|proto|scripts|fuzz|\.ci)/[\w./-]*"
    r"|README\.md|CHANGELOG\.md|config\.example\.toml|pyproject\.toml|Cargo\.toml)"
)


def test_named_paths_and_links_exist():
    missing = []
    for path in DOCS:
        text = path.read_text()
        for match in PATH.finditer(text):
            name = match.group(1).rstrip(".,:;)")
            if name in PENDING_PATHS or any(c in name for c in "*{<"):
                continue
            if not (ROOT / name).exists():
                missing.append(f"{rel(path)}: {name}")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                missing.append(f"{rel(path)}: link {target}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def test_the_architecture_table_names_real_files():
    """docs/architecture.md, "Where each stage lives": a row for `src/DIR/` names files of it."""
    rows = re.findall(r"^\| `(src/\w+/)` \|(.*)\|\s*$", (ROOT / "docs" / "architecture.md").read_text(), re.M)
    assert len(rows) >= 8
    missing = [f"{d}{f}" for d, row in rows for f in re.findall(r"`(\w+\.rs)`", row) if not (ROOT / d / f).is_file()]
    folders = {p.name for p in (ROOT / "src").iterdir() if p.is_dir()}
    undocumented = folders - {d.split("/")[1] for d, _ in rows}
    assert not missing and not undocumented, (
        f"docs/architecture.md names files src/ lacks: {missing}; src/ folders it lacks: {undocumented}")
