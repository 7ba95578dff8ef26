"""A command line from a dataclass: each field is a flag, its metadata the help and the check.

    @dataclass
    class Config:
        lr: float = arg(1e-3, "peak learning rate", at_least(0))
        fresh: bool = arg(False, "start over")

    cfg = parse(Config, argv, "what the program does")      # --lr 1e-3 --fresh

train.py and data.py both build their flags this way, so a flag is declared once, with its default,
its meaning and what values it accepts; a bad value is refused by the parser in one line, before
any work starts.
"""

import argparse
from dataclasses import MISSING, field, fields


def arg(default, help: str, check: tuple | None = None, flag: str = "", **kw):
    """A flag: its default, its help, optionally (test, "what it must be") checked by the parser,
    and optionally a flag name other than the field's (`--data` for `source`)."""
    return field(default=default, metadata={"help": help, "check": check, "flag": flag, **kw})


def at_least(lo, note: str = "") -> tuple:
    return (lambda v: v >= lo, f"must be >= {lo}{note}")


class OneLineParser(argparse.ArgumentParser):
    """argparse, with errors as one line that points at --help."""

    def error(self, message: str):
        self.exit(2, f"error: {message} ({self.prog} --help lists every flag)\n")


def checked(kind, check: tuple | None):
    """An argparse type that converts, then tests the value."""
    def convert(text: str):
        value = kind(text)
        if check and not check[0](value):
            raise argparse.ArgumentTypeError(f"{check[1]}, got {text}")
        return value
    convert.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return convert


def parser(config_type, description: str, epilog: str | None = None, prog: str | None = None) -> OneLineParser:
    """A parser with one flag per field of `config_type`. A bool field is a switch (--x, or --no-x when
    it is on by default); a `bool | None` field takes --x / --no-x and stays None (automatic) when neither is given."""
    p = OneLineParser(prog=prog, description=description, epilog=epilog,
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(config_type):
        meta = {k: v for k, v in f.metadata.items() if k not in ("check", "flag")}
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if f.type in (bool, "bool") and not default:
            p.add_argument(flag, dest=f.name, action="store_true", **meta)
        elif f.type in (bool, "bool"):  # on by default: --no-x turns it off
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=True, **meta)
        elif f.type in (bool | None, "bool | None"):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, **meta)
        else:
            p.add_argument(flag, dest=f.name, type=checked(type(default), f.metadata.get("check")),
                           default=default, **meta)
    return p
