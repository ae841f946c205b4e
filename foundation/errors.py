"""Errors. Anything a user can cause derives from :class:`TestbedError` (CLI: message, exit 2)."""

from __future__ import annotations

from dataclasses import dataclass


class TestbedError(Exception):
    """A problem in the user's input or setup; the CLI prints it and exits with status 2."""

    __test__ = False  # not a pytest test class, despite the name


@dataclass(frozen=True)
class InputProblem:
    """One thing wrong in a user file, located by file, line and field."""

    file: str
    line: int | None
    field: str
    problem: str
    hint: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        text = f"{where}: {self.field}: {self.problem}" if self.field else f"{where}: {self.problem}"
        return f"{text}; {self.hint}" if self.hint else text


class InputError(TestbedError):
    """One or more problems in a user file (inventory, campaign, trace)."""

    def __init__(self, problems: list[InputProblem]) -> None:
        if not problems:
            raise ValueError("InputError needs at least one problem")
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class NodeError(Exception):
    """A node could not be reached or did not behave: reported per node, never a user error."""

    def __init__(self, node: str, message: str) -> None:
        self.node = node
        self.message = message
        super().__init__(f"{node}: {message}")
