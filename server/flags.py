"""Command-line flags generated from the configuration dataclasses, and `--config FILE` (TOML) filling the same ones.

Every field of a config dataclass is a flag (`EngineConfig.kv_dtype` -> `--kv-dtype`; a nested dataclass adds its
field name as a prefix: `ServerConfig.cache.db` -> `--cache-db`), its help is the comment on the field's line, and
its default is the dataclass's own, so code and command line never disagree. Precedence: flag > file > default.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import tokenize
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

SCALARS = (bool, int, float, str, Path)


@dataclass(frozen=True, slots=True)
class Flag:
    """One generated option: where its value goes in the config tree, and how it reads from the command line."""

    root: str                   # the keyword the command receives the config under ("engine", "server")
    path: tuple[str, ...]       # field names from the root config down to this field
    option: str                 # "--kv-dtype", "--cache-db"
    kind: type                  # bool, int, float, str or Path
    optional: bool              # None is a valid value ("none" or "" on the command line)
    default: Any
    help: str
    envvar: str | None
    aliases: tuple[str, ...] = ()   # more names for the same flag (the short ones an issue or a doc uses)

    @property
    def param(self) -> str:
        return "__".join((self.root, *self.path))


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """The `# comment` inside each `name: type = default` statement of a dataclass body: its help text."""
    comments: dict[str, str] = {}
    name = None
    for tok in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and name is None:
            name = tok.string
        elif tok.type == tokenize.COMMENT and name is not None:
            comments[name] = tok.string.lstrip("# ").strip()
        elif tok.type == tokenize.NEWLINE:
            name = None
    return comments


def _scalar(hint) -> tuple[type, bool]:
    """(base type, optional) of a field's type hint; a type we cannot read from a command line is a bug here."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in SCALARS:
            return rest[0], True
    if hint in SCALARS:
        return hint, False
    raise TypeError(f"config field type {hint!r} has no command-line form")


def flags_of(root: str, cls: type, instance: Any = None, path: tuple[str, ...] = (),
             prefix: tuple[str, ...] = ()) -> list[Flag]:
    """Every flag of a config class, defaults read from `instance` (a default-constructed one when None); `path`
    leads from the root config to `cls`, `prefix` starts each flag's name."""
    instance = cls() if instance is None else instance
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    flags = []
    for f in dataclasses.fields(cls):
        hint, value = hints[f.name], getattr(instance, f.name)
        if dataclasses.is_dataclass(hint):
            flags += flags_of(root, hint, value, (*path, f.name), (*prefix, f.name))
            continue
        kind, optional = _scalar(hint)
        option = "--" + "-".join((*prefix, f.name)).replace("_", "-")
        flags.append(Flag(root, (*path, f.name), option, kind, optional, value, comments.get(f.name, ""),
                          f.metadata.get("envvar"), tuple(f.metadata.get("aliases", ()))))
    return flags


def _typer_parameter(flag: Flag) -> inspect.Parameter:
    if flag.kind is bool:
        names = [f"{flag.option}/--no-{flag.option[2:]}"]
        annotation: Any = bool
    else:
        names = [flag.option, *flag.aliases]
        annotation = str if flag.optional else flag.kind  # optional values are parsed by us ("none" -> None)
    default = flag.default if flag.kind is bool or not flag.optional else (
        "none" if flag.default is None else str(flag.default))
    info = typer.Option(default, *names, help=flag.help, envvar=flag.envvar, show_default=True,
                        rich_help_panel=f"{flag.root} configuration")
    return inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _parse_optional(flag: Flag, raw: str) -> Any:
    if raw.strip().lower() in ("", "none"):
        return None
    try:
        return flag.kind(raw)
    except ValueError:
        raise typer.BadParameter(f"expects {flag.kind.__name__} or 'none', got {raw!r}",
                                 param_hint=flag.option) from None


def read_config_file(path: Path, roots: dict[str, type]) -> dict[str, dict]:
    """A TOML file of tables named after the roots (`[engine]`, `[server]`, `[server.cache]`); unknown keys fail."""
    try:
        data = tomllib.loads(Path(path).read_text("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--config") from None
    unknown = set(data) - set(roots)
    if unknown:
        raise typer.BadParameter(f"{path}: unknown table(s) {sorted(unknown)}; this command reads "
                                 f"{sorted(roots)}", param_hint="--config")
    not_tables = sorted(name for name, value in data.items() if not isinstance(value, dict))
    if not_tables:
        raise typer.BadParameter(f"{path}: {not_tables} must be tables ([{not_tables[0]}])", param_hint="--config")
    return data


def _checked(value: Any, hint, where: str) -> Any:
    """A file's value for a scalar field, of the field's type (an int where a float goes; a path as a string)."""
    kind, optional = _scalar(hint)
    if optional and (value is None or isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None     # TOML has no null: "none" is how a file says it, as on the command line
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is Path and isinstance(value, str):
        return Path(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise typer.BadParameter(f"{where} must be {'a path' if kind is Path else kind.__name__}"
                             f"{' or none' if optional else ''}, got {value!r}")


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def build(cls: type, values: dict, where: str, base: Any = None) -> Any:
    """A config object from nested plain values, over `base` (an instance of cls) when given; unknown keys and
    invalid values are clear errors. A nested config starts from its parent field's own default, not from its
    class's: ServerConfig's cache keeps its SQLite file when one cache flag is given."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        raise typer.BadParameter(f"unknown setting(s) {sorted(unknown)} in {where}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise typer.BadParameter(f"{where}.{name} must be a table")
            parent_default = getattr(base, name) if base is not None else _default(fields[name])
            value = build(hint, value, f"{where}.{name}", parent_default)
        else:
            value = _checked(value, hint, f"{where}.{name}")
        kwargs[name] = value
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise typer.BadParameter(f"{where}: {exc}") from None


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
        if not isinstance(tree, dict):          # the file gave a value where a table goes
            raise typer.BadParameter(f"{name} must be a table in the config file, got {tree!r}")
    tree[path[-1]] = value


def config_command(prefixed: tuple[str, ...] = (), **roots: type):
    """Decorate a typer command so that it takes `--config FILE` and one flag per config field, and receives the
    built config objects as keyword arguments named like `roots` (e.g. `engine=EngineConfig`). The flags of a root
    named in `prefixed` start with its name (`cache=RequestCacheConfig` -> `--cache-embedder`, as in `serve`)."""

    def decorate(func):
        flags = [flag for root, cls in roots.items()
                 for flag in flags_of(root, cls, prefix=(root,) if root in prefixed else ())]
        own = [p for p in inspect.signature(func).parameters.values() if p.name not in roots]
        context_param = inspect.Parameter("flags_context", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        config_param = inspect.Parameter(
            "config_file", inspect.Parameter.KEYWORD_ONLY, annotation=Path | None,
            default=typer.Option(None, "--config", help="TOML file of settings (tables " +
                                 ", ".join(roots) + "); flags override it."))

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            ctx = kwargs.pop("flags_context")
            file = kwargs.pop("config_file")
            trees = read_config_file(file, roots) if file else {}
            for flag in flags:
                raw = kwargs.pop(flag.param)
                source = ctx.get_parameter_source(flag.param)
                if source is not None and source.name != "DEFAULT":     # given on the command line or by envvar
                    value = _parse_optional(flag, raw) if flag.optional and flag.kind is not bool else raw
                    _set(trees.setdefault(flag.root, {}), flag.path, value)
            for root, cls in roots.items():
                kwargs[root] = build(cls, trees.get(root, {}), f"[{root}]")
            return func(*args, **kwargs)

        params = own + [context_param, config_param] + [_typer_parameter(flag) for flag in flags]
        wrapper.__signature__ = inspect.Signature(params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__        # typer must read the generated signature, not the original one
        return wrapper

    return decorate
