"""A command line from a dataclass: each field is a flag, its metadata the help and the check.

    @dataclass
    class Config:
        lr: float = arg(1e-3, "peak learning rate", at_least(0), group="optimization")
        warmup: int = arg(0, "warm-up steps", shown="5% of the steps")
        fresh: bool = arg(False, "start over", group="checkpoints")

    cfg = Config(**vars(parser(Config, "what the program does").parse_args(argv)))

train.py, data.py and sample.py build their flags this way, so a flag is declared once, with its
default, its meaning and what values it accepts; a bad value is refused by the parser in one line,
before any work starts. `--help` lists the flags under headings (a field's `group` starts one; the
fields after it belong to it) and shows each default as it really is: `shown` says what an automatic
default ("auto", 0) becomes.
"""

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import MISSING, field, fields


def arg(default, help: str, check: tuple | None = None, flag: str = "", group: str = "", shown: str = "", **kw):
    """A flag: its default, its help, optionally (test, "what it must be") checked by the parser, a flag
    name other than the field's (`--data` for `source`), the --help heading it starts (`group`), and the
    default as --help should show it when the value alone would not say (`shown`: "gpt2 on CUDA, mini on
    CPU" rather than "auto")."""
    return field(default=default, metadata={"help": help, "check": check, "flag": flag, "group": group,
                                            "shown": shown, **kw})


def at_least(lo, note: str = "") -> tuple:
    return (lambda v: v >= lo, f"must be >= {lo}{note}")


class OneLineParser(argparse.ArgumentParser):
    """argparse, with errors as one line that points at --help."""

    def error(self, message: str):
        stop_every_rank(f"{message} ({self.prog} --help lists every flag)")


def checked(kind, check: tuple | None):
    """An argparse type that converts, then tests the value. A float must be finite: `inf` passes
    `>= 0` (and trains NaN weights), so no flag takes it."""
    def convert(text: str):
        value = kind(text)
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if check and not check[0](value):
            raise argparse.ArgumentTypeError(f"{check[1]}, got {text}")
        return value
    convert.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return convert


def default_text(f) -> str:
    """What --help says a flag's default is."""
    if f.metadata.get("shown"):
        return f.metadata["shown"]
    if f.type in (bool, "bool"):
        return "on" if f.default else "off"
    return repr(f.default) if isinstance(f.default, str) else str(f.default)


def parser(config_type, description: str, epilog: str | None = None, prog: str | None = None) -> OneLineParser:
    """A parser with one flag per field of `config_type`, under the headings the fields' `group` starts.
    A bool field is a switch (--x, or --no-x when it is on by default); a `bool | None` field takes
    --x / --no-x and stays None (automatic) when neither is given."""
    p = OneLineParser(prog=prog, description=description, epilog=epilog,
                      formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=32, width=100))
    section = p
    for f in fields(config_type):
        if f.metadata.get("group"):
            section = p.add_argument_group(f.metadata["group"])
        kw = {k: v for k, v in f.metadata.items() if k not in ("check", "flag", "group", "shown")}
        kw["help"] = f"{kw['help']} (default: {default_text(f)})".replace("%", "%%")
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if f.type in (bool, "bool") and not default:
            action = section.add_argument(flag, dest=f.name, action="store_true", **kw)
        elif f.type in (bool, "bool"):  # on by default: --no-x turns it off
            action = section.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=True, **kw)
        elif f.type in (bool | None, "bool | None"):
            action = section.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, **kw)
        else:
            action = section.add_argument(flag, dest=f.name, type=checked(type(default), f.metadata.get("check")),
                                          default=default, **kw)
        action.help = kw["help"]  # (some Pythons' BooleanOptionalAction append a default of their own)
    return p


def printer(on: bool):
    """print, flushed, when `on` (a program's rank 0), else nothing: what every line a run says goes through."""
    return (lambda msg: print(msg, flush=True)) if on else (lambda msg: None)


def fail(message: str, code: int = 2, say: bool = True, cause: bool = True, at_once: bool = False) -> None:
    """Exit with `code` after one line on stderr (when `say`). Under torchrun the line also goes where the
    launcher looks for a worker's error (the file TORCHELASTIC_ERROR_FILE names, in the format of
    torch.distributed.elastic's `record`): its failure summary then shows this line as the cause, instead
    of a link to its documentation. Not when this rank only suffered the failure (`cause=False`: a peer
    died): the file's time stamp would make torchrun name this rank as the first to fail. `at_once`: leave
    without the interpreter's teardown (a stopped run: interrupt.py says why)."""
    if say:
        print(message, file=sys.stderr, flush=True)
    if cause and (path := os.environ.get("TORCHELASTIC_ERROR_FILE")):
        info = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        try:
            with open(path, "w") as f:
                json.dump({"message": info}, f)
        except OSError:  # the summary falls back to its link; the line above was said
            pass
    if at_once:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def stop_every_rank(message: str) -> None:
    """An error that every rank found alike (a flag, a layout, a checkpoint they all read): alone, print it
    and exit 2. Under torchrun, rank 0 says it once and exits 2, so `torchrun ... && next` stops and a
    scheduler records a failure; the other ranks exit 0 at once, so torchrun's summary names one failure,
    rank 0's, with this line as its cause (`fail`). With --max-restarts N, torchrun tries N more times.
    The others leave without the interpreter's teardown (torch's can take longer than rank 0's wait on a
    loaded machine, once the ranks have connected): nothing of theirs is left to finish."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if world == 1:
        fail(f"error: {message}")
    if int(os.environ.get("RANK", "0")) == 0:
        time.sleep(0.5)  # the others, exiting 0 meanwhile, are gone before torchrun sees rank 0 fail (it would
        fail(f"error: {message} (all {world} processes stopped)")  # stop them, and list each as a failure)
    fail("", 0, say=False, cause=False, at_once=True)


# ----------------------------------------------------------------------------- signals before and after main


def exit_on_signals_while_starting() -> None:
    """A program's first act, before its heavy imports (torch takes seconds to load): until the program's own
    handling replaces it (train.py: interrupt.Stop; data.py and sample.py: `interruptible`), SIGINT and SIGTERM
    end the process at once, with one line and exit status 128 + the signal, instead of a KeyboardInterrupt
    traceback (from every rank, under torchrun: the terminal signals them all) or a silent death. os._exit:
    there is nothing to save yet, and the teardown of a half-imported torch is not one to run."""
    def handle(signum, frame):
        if os.environ.get("RANK", "0") == "0":  # (torchrun's workers: rank 0 says it)
            print(f"stopped by {signal.Signals(signum).name} while starting, before any work; nothing to save",
                  file=sys.stderr, flush=True)
        os._exit(128 + signum)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handle)


def interruptible() -> None:
    """From here (a program's main, its imports done) Ctrl-C is Python's KeyboardInterrupt again, which the
    program cleans up after on its way out and says in one line (`stopped`); SIGTERM ends it silently."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stopped(what: str) -> None:
    """A Ctrl-C that reached a program's main: one line (`what` happened; rank 0 says it), exit status 130."""
    fail(f"stopped by SIGINT; {what}", 128 + signal.SIGINT, say=os.environ.get("RANK", "0") == "0", cause=False)
