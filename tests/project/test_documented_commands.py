"""Every ``posbench ...`` command in the code blocks of README.md and docs/*.md composes: its
subcommand exists and Hydra takes its overrides (parsed, config composed; nothing is run).

The commands are read from the pages when the tests are collected, so an edited page is checked
as it stands. Placeholders (``<run dir>``) stand for a value and are replaced by one; shell
variables set in the same code block (``export T=task=flipflop``, ``S=hydra.sweep.dir=...``) are
expanded, as the shell would.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = "x"
ASSIGNMENT = re.compile(r"^(?:export\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s*)+$")


def code_blocks(text: str) -> list[list[tuple[int, str]]]:
    """The fenced code blocks of a markdown page: (line number, line) per line, continuation
    lines (ending in a backslash) joined into the line they continue."""
    blocks: list[list[tuple[int, str]]] = []
    inside, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            inside = not inside
            if inside:
                blocks.append([])
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            start = start or number
            pending += line.rstrip()[:-1] + " "
            continue
        blocks[-1].append((start or number, pending + line))
        pending, start = "", 0
    return blocks


def shell_words(line: str, variables: dict[str, str]) -> list[str]:
    """The words of a shell line: comments dropped, placeholders given a value, variables expanded."""
    line = re.sub(r"<[^<>\s][^<>]*>", PLACEHOLDER, line)  # <run dir> -> x
    line = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
    return shlex.split(line, comments=True)


def posbench_calls(words: list[str]) -> list[list[str]]:
    """Each ``posbench <args>`` of a line (a line may chain commands with && ; |)."""
    calls: list[list[str]] = []
    current = None
    for index, word in enumerate(words):
        if word == "posbench" and index and words[index - 1] in ("cd", "clone"):
            continue  # the folder, not the command
        if word in ("&&", ";", "|", "||"):
            current = None
        elif current is not None:
            current.append(word)
        elif word == "posbench":
            current = []
            calls.append(current)
    return [call for call in calls if call and call[0] not in ("&&", ";", "|", "||")]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(page:line, [subcommand, args...]) for every posbench command in a code block."""
    found = []
    for page in PAGES:
        for block in code_blocks(page.read_text()):
            variables: dict[str, str] = {}
            for number, line in block:
                code = line.split("#", 1)[0].strip()
                if ASSIGNMENT.match(code):
                    for word in shlex.split(code.removeprefix("export ")):
                        name, _, value = word.partition("=")
                        variables[name] = value
                    continue
                if not re.search(r"(^|[\s;&|(])posbench\s", line):
                    continue
                for call in posbench_calls(shell_words(line, variables)):
                    found.append((f"{page.relative_to(ROOT)}:{number}", call))
    return found


COMMANDS = documented_commands()


def _example(arg: str) -> str:
    """A placeholder for a group's option (``task=<task>``) as the group's first option."""
    from posbench.config import config_names

    key, _, value = arg.partition("=")
    return f"{key}={config_names(key)[0]}" if value == PLACEHOLDER and config_names(key) else arg


def test_the_pages_document_commands():
    """The extraction finds the commands (a broken extraction would pass every check below)."""
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert len(COMMANDS) >= 20 and "README.md" in pages and "docs/commands.md" in pages
    assert any(call[0] == "plot" for _, call in COMMANDS)


RUNNABLE = [(where, call) for where, call in COMMANDS if not call or call[0] != PLACEHOLDER]
"""The commands to compose: all but the synopsis ``posbench <command> ...``, which names no command."""


@pytest.mark.slow
@pytest.mark.parametrize("where, call", RUNNABLE, ids=[where for where, _ in RUNNABLE])
def test_documented_command_composes(where, call):
    from posbench.commands.cli import COMMANDS as SUBCOMMANDS
    from posbench.commands.cli import hydra_arguments
    from posbench.config import check_command_line

    assert call, f"{where}: `posbench` without a subcommand"
    command, *args = call
    assert command in SUBCOMMANDS, f"{where}: no subcommand {command!r}"
    args = hydra_arguments(command, [_example(arg) for arg in args])  # as the CLI hands them to Hydra
    check_command_line(command, args)  # raises PosbenchError, naming the fix, where Hydra would fail


def test_a_value_holding_equals_signs_is_one_value():
    """`posbench plot variant=num_sequences=64` (an eval_variants label) failed in Hydra's
    parser (mismatched input '='); the value is now the label."""
    from posbench.config import check_command_line

    args, (cfg,) = check_command_line("plot", ["runs=[a]", "variant=num_sequences=64,precision=bf16"])
    assert cfg.variant == "num_sequences=64,precision=bf16"
    assert args == ["runs=[a]", "variant='num_sequences=64,precision=bf16'"]
    assert check_command_line("plot", ["variant=num_sequences"])[0] == ["variant=num_sequences"]


def test_extraction_handles_the_shell_forms_the_pages_use():
    block = code_blocks("```bash\nexport A=1 T=task=copy\nOMP_NUM_THREADS=1 nice -n 10 posbench train -m $T \\\n"
                        "  'method=glob(*)'  # all\nposbench prepare data=sample && posbench viz run=<run dir>\n```\n")[0]
    assert block[1] == (3, "OMP_NUM_THREADS=1 nice -n 10 posbench train -m $T    'method=glob(*)'  # all")
    assert posbench_calls(shell_words(block[1][1], {"T": "task=copy"})) == [["train", "-m", "task=copy", "method=glob(*)"]]
    assert posbench_calls(shell_words(block[2][1], {})) == [["prepare", "data=sample"], ["viz", "run=x"]]
