"""One typed settings object per command, filled from flags, then environment, then defaults.

Each command declares a pydantic model; its fields become `--flags` (help text from the field's
docstring) and each flag also reads `GPUUSAGE_<FLAG>` (plus any extra variables a field names,
such as NODE_NAME from the downward API). A tuple field is a flag given as often as needed; its
variable holds one value a line (a line break is the one character no value of it can hold).
Values are validated by the model, so a bad value in a flag or a variable gets the same clear
message naming both.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from gpuusage.errors import GpuusageError

ENV_PREFIX = "GPUUSAGE_"
S = TypeVar("S", bound="CommandSettings")


class CommandSettings(BaseModel):
    """Base class of every command's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    #: Field names whose values are replaced by "***" when the settings are logged.
    secret_fields: typing.ClassVar[frozenset[str]] = frozenset()

    def redacted(self) -> dict[str, Any]:
        """The effective settings as logged at start, secrets hidden."""
        values = self.model_dump(mode="json")
        return {k: ("***" if k in self.secret_fields and v else v) for k, v in values.items()}


def comma_list(text: str) -> tuple[str, ...]:
    """The items of a comma-separated setting, blanks dropped ("a, b," -> ("a", "b"))."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_names(model: type[CommandSettings], field: str) -> list[str]:
    """GPUUSAGE_<FIELD> first, then any extra names the field declares."""
    extra = model.model_fields[field].json_schema_extra
    more = list(extra.get("env", [])) if isinstance(extra, dict) else []  # type: ignore[arg-type]
    return [ENV_PREFIX + field.upper(), *[str(name) for name in more]]


def _base_type(annotation: Any) -> Any:
    """Strip Optional[...] / X | None to the underlying type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _base_type(args[0])
    return annotation


def repeated(model: type[CommandSettings], field: str) -> bool:
    """Whether the field is a flag given once per value (a tuple of them)."""
    return typing.get_origin(_base_type(model.model_fields[field].annotation)) is tuple


def add_arguments(parser: argparse.ArgumentParser, model: type[CommandSettings]) -> None:
    """Add one flag per settings field; values stay None unless given, so env can fill in."""
    for name, info in model.model_fields.items():
        base = _base_type(info.annotation)
        envs = ", ".join(env_names(model, name))
        shown = "; required" if info.is_required() else _shown_default(info)
        if repeated(model, name):
            envs, shown = f"{envs} (one a line)", f"{shown}; repeatable"
        help_text = f"{info.description or ''} [env {envs}{shown}]".strip()
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
        if repeated(model, name):
            kwargs["action"] = "append"
        elif base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is Literal:
            kwargs["choices"] = [str(c) for c in typing.get_args(base)]
            kwargs["metavar"] = "{" + ",".join(kwargs["choices"]) + "}"
        elif base is Path:
            kwargs["metavar"] = "PATH"
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if "metavar" in extra:
            kwargs["metavar"] = str(extra["metavar"])
        short = [str(extra["short"])] if "short" in extra else []  # kubectl-style -n, -A, -o
        parser.add_argument(*short, flag_name(name), **kwargs)


def _shown_default(info: Any) -> str:
    """The default as a person types it (a list comma-separated, a flag on or off); nothing
    for an empty one."""
    default = info.get_default(call_default_factory=True)
    if default is None or default in ("", (), []):
        return ""
    if isinstance(default, bool):
        return f"; default {'on' if default else 'off'}"
    if isinstance(default, list | tuple | set | frozenset):
        return f"; default {','.join(str(d) for d in default)}"
    return f"; default {default}"


def resolve(
    model: type[S], namespace: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> S:
    """Build the settings object: flag, else environment variable, else the model's default.

    Raises SettingsError with one line per bad value, naming the flag and the variable.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name in model.model_fields:
        given = getattr(namespace, name, None)
        if given is not None:
            values[name], origin[name] = given, flag_name(name)
            continue
        for env in env_names(model, name):
            if environ.get(env, "") != "":
                text = environ[env]
                lines = [line.strip() for line in text.splitlines() if line.strip()]
                values[name] = lines if repeated(model, name) else text
                origin[name] = f"${env}"
                break
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            where = origin.get(field, flag_name(field))
            lines.append(f"{where}: {error['msg']} (got {error.get('input')!r})")
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None


class SettingsError(GpuusageError):
    """A flag or environment variable has a value the command cannot use."""
