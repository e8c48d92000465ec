"""How a config field is declared, in config/schema.py and in an algorithm's own file alike: `flag`
gives a dataclass field its --help text and how its flag is parsed (config/cli.py reads them), and
`parse_pair` parses the values written A:B or A,B. A leaf: it imports nothing of the project, so
the algorithms (rl/, below config/ in the layers) declare their flags with it."""
from __future__ import annotations

from dataclasses import field


def flag(default, help: str, **kw):
    """A config field: `help` is its --help text, `parse` (optional) turns the flag's string into
    the field's typed value, `action="append"` makes it repeatable, `metavar` names its value,
    `carried=False` keeps a --config file from setting it (`one_command=True` also keeps it out of
    config.json: it is what one command does, not what the run is)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def parse_pair(text, sep: str, types, flag_name: str) -> tuple:
    """'A<sep>B' -> (types[0](A), types[1](B)); a tuple or list (from config.json) passes through
    the same conversion."""
    types = types if isinstance(types, tuple) else (types, types)
    parts = text.split(sep) if isinstance(text, str) else list(text)
    try:
        if len(parts) != 2:
            raise ValueError
        return tuple(t(p) for t, p in zip(types, parts))
    except (TypeError, ValueError):
        raise ValueError(f"{flag_name} {text!r}: expected two values as A{sep}B") from None
