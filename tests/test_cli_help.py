"""`sluice <command> --help` for every command: it exits 0, and every flag's help shows its default (the
service commands' flags come from their settings models and say `[env ...; default ...]`; the hand-written
parsers use HelpWithDefaults and say `(default: ...)`)."""

from __future__ import annotations

import re

import pytest

from services.cli import _COMMANDS, main


def _flag_blocks(help_text: str) -> dict[str, str]:
    """Each long option of a --help text -> the text of its entry (up to the next option)."""
    options = help_text.split("options:", 1)[1]
    blocks, current = {}, None
    for line in options.splitlines():
        match = re.match(r"^  (?:-\w, )?(--[\w-]+)", line)
        if match:
            current = match.group(1)
            blocks[current] = line
        elif current is not None:
            blocks[current] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_help_shows_every_flags_default(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    blocks = _flag_blocks(capsys.readouterr().out)
    missing = [flag for flag, text in blocks.items() if flag != "--help" and "default" not in text]
    assert missing == [], f"sluice {command} --help: no default shown for {missing}"


def test_demo_task_alone_lists_every_built_in_task(capsys):
    from services.demo_tasks import DEMO_TASKS

    assert main(["demo", "--task"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(DEMO_TASKS)
    for line, task in zip(lines, DEMO_TASKS.values()):
        assert task.summary in line and f"(reward: {task.reward})" in line


def test_demo_refuses_an_unknown_task_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--task", "nope"])
    assert exc.value.code == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
