"""What every job-file section shares: `ConfigError`, and `Section`, the checks a section runs on itself.

A section is a frozen dataclass (slidedp/config.py holds them, slidedp/plan_section.py the [plan]
one). Each validates itself in `__post_init__`: the type of every key, then its own `validate`,
which reports each bad key by `section.key`, the bad value and what is allowed, and goes on to the
next, so a job file is fixed in one go.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar, Sequence


class ConfigError(ValueError):
    """A bad job file. `problems` holds every one found (a job file is checked whole, not to its first error)."""

    def __init__(self, message: str = "", problems: Sequence[str] = ()) -> None:
        self.problems = list(problems) or [message]
        super().__init__("\n".join(self.problems))


TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               (bool, str): "true, false or a string",
               (int, str): "\"auto\" or an integer"}


class Section:
    """Shared checks. Subclasses set `_name` and the keys that hold paths."""

    _name: ClassVar[str] = ""
    _paths: ClassVar[tuple[str, ...]] = ()
    _lists: ClassVar[tuple[str, ...]] = ()  # string keys that also take a list of strings (kept as a tuple)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            want = FIELD_TYPES[f.type] if isinstance(f.type, str) else f.type
            value = getattr(self, f.name)
            if f.name in self._lists and isinstance(value, (list, tuple)):
                if not value or not all(isinstance(v, str) and v for v in value):
                    raise ConfigError(f"{self._key(f.name)} must be a string or a non-empty list of non-empty "
                                      f"strings, got {value!r}")
                object.__setattr__(self, f.name, tuple(value) if len(value) > 1 else value[0])
                continue
            # bool is a subclass of int in Python; a TOML `true` is never a number here.
            takes_bool = want is bool or (isinstance(want, tuple) and bool in want)
            ok = isinstance(value, want) and not (not takes_bool and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                ok = True
            if not ok:
                problems.append(
                    f"{self._key(f.name)} must be {TYPE_NAMES[want]}, got {show(value)} ({type(value).__name__})"
                )
        if not problems:  # values of the wrong type cannot be range-checked
            object.__setattr__(self, "_problems", problems)  # _range and _choice add to it and go on
            try:
                self.validate()
            except ConfigError as e:
                problems.extend(e.problems)
            except (TypeError, ValueError, ArithmeticError):
                if not problems:
                    raise
                # a consequence of a value already reported (e.g. a zero divisor)
            object.__delattr__(self, "_problems")
        if problems:
            raise ConfigError(problems=problems)

    def validate(self) -> None:
        pass

    def _key(self, name: str) -> str:
        return f"{self._name}.{name}"

    def _report(self, message: str) -> None:
        """A problem of one key: noted while the section checks the rest of its keys."""
        found = self.__dict__.get("_problems")
        if found is None:
            raise ConfigError(message)
        found.append(message)

    def _choice(self, name: str, allowed: Sequence[str]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            self._report(f"{self._key(name)} must be one of {', '.join(map(repr, allowed))}; got {value!r}")

    def _range(self, name: str, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, hi_open: bool = False) -> None:
        value = getattr(self, name)
        bad = (isinstance(value, float) and not math.isfinite(value))
        bad |= lo is not None and (value <= lo if lo_open else value < lo)
        bad |= hi is not None and (value >= hi if hi_open else value > hi)
        if bad:
            if hi is None:
                allowed = f"{'>' if lo_open else '>='} {lo}"
            else:
                allowed = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            self._report(f"{self._key(name)} must be {allowed}; got {show(value)}")

    def _existing(self, name: str, what: str) -> Path:
        value = getattr(self, name)
        for path in map(Path, (value,) if isinstance(value, str) else value):
            if not path.exists():
                raise ConfigError(f"{self._key(name)}: {what} {str(path)!r} does not exist")
        return path


# the annotations a section's keys may have (as strings: `from __future__ import annotations`)
FIELD_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "bool | str": (bool, str), "int | str": (int, str)}


def show(value: Any) -> str:
    """A value as a job file writes it (true, not True)."""
    return repr(value) if not isinstance(value, bool) else str(value).lower()
