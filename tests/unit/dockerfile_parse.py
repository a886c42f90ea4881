"""A small Dockerfile and .dockerignore reader for the container-image tests (no container engine here): stages,
instructions, ARG/ENV expansion, exec forms, and which context paths the ignore file leaves out."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str  # upper case
    args: str  # after the keyword, continuation lines joined, comment lines dropped


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: list[Instruction]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def env(self, stage: Stage) -> dict[str, str]:
        """The ENV of ``stage`` as the container sees it (a base image's own variables expand to "")."""
        values: dict[str, str] = {}
        for instruction in stage.all("ENV"):
            for key, value in pairs(instruction.args):
                values[key] = expand(value, values)
        return values


def parse(text: str) -> Dockerfile:
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments (and parser directives) vanish, also inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        keyword, _, args = " ".join(p for p in pending if p).partition(" ")
        instructions.append(Instruction(start, keyword.upper(), args.strip()))
        pending = []
    assert not pending, "the Dockerfile ends inside a continued instruction"
    global_args: list[Instruction] = []
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {instruction.line}: {instruction.keyword} before FROM"
            global_args.append(instruction)
        else:
            stages[-1].instructions.append(instruction)
    assert stages, "no FROM"
    return Dockerfile(global_args, stages)


def pairs(args: str) -> list[tuple[str, str]]:
    """``KEY=value ...`` of ENV, LABEL and ARG (an ARG may have no value; ENV's old ``KEY value`` form too)."""
    words = shlex.split(args)
    if words and "=" not in words[0] and len(words) > 1:
        return [(words[0], " ".join(words[1:]))]
    return [(word.partition("=")[0], word.partition("=")[2]) for word in words]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not an exec form: {args}"
    return value


_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:[:][-+][^}]*)?\}|([A-Za-z_][A-Za-z0-9_]*))")


def variables(text: str) -> set[str]:
    return {m.group(1) or m.group(2) for m in _VARIABLE.finditer(text)}


def expand(text: str, values: Mapping[str, str]) -> str:
    return _VARIABLE.sub(lambda m: values.get(m.group(1) or m.group(2), ""), text)


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    return {key: value for i in instructions for key, value in pairs(i.args)}


# --- .dockerignore ----------------------------------------------------------------------------------------------

def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out)


def ignored(path: str, dockerignore: str) -> bool:
    """Whether the build context leaves ``path`` (relative to the repository root) out: a pattern matches the path
    or a folder above it; the last matching pattern wins (``!`` takes a path back)."""
    parts = path.strip("/").split("/")
    result = False
    for line in dockerignore.splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = _ignore_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            result = not negate
    return result
