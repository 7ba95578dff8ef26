"""A lesson's prose cannot drift from its commands either: a number with a decimal point in its text is one
that its blocks print (to the prose's rounding), or it is marked as quoted from elsewhere.

tests/test_lessons.py checks what the blocks print; this checks what the text around them says of it.
"""

import re

import pytest
from test_lessons import DOCS, FENCE, NUMBER

SOURCED = "†"  # written right after a number no command of the page prints: its sentence cites where it is from
DECIMAL = re.compile(r"(?<![\w.†])(?<!ection )(?<!Python )(?<!torch )"  # a section, a version: not values
                     r"(\d[\d,]*\.(\d+)(?:e([-+]?\d+))?)(%|×|x\b)?(?![\w.]*\d)[A-Za-z]*(†?)")


def unprinted(text: str) -> list[str]:
    """The numbers with a decimal point in a page's prose (outside its fenced blocks and inline code) that
    none of its blocks shows, to the prose's rounding (a percentage also as a fraction: 50.4% for 0.504),
    and that carry no SOURCED mark. A number that quotes a run must be the run's; one from a paper or a
    GPU is marked. Integers are left alone: years, counts and names are integers too."""
    blocks = " ".join(m.group(2) for m in FENCE.finditer(text))
    shown = {abs(float(n.replace(",", ""))) for n in NUMBER.findall(blocks)}
    prose = re.sub(r"`[^`\n]*`", " ", FENCE.sub("\n", text))
    bad = []
    for number, decimals, exponent, unit, mark in DECIMAL.findall(prose):
        x, half = float(number.replace(",", "")), 0.50001 * 10.0 ** (int(exponent or 0) - len(decimals))
        if not mark and not any(abs(y * k - x) <= half for y in shown for k in ((1, 100) if unit == "%" else (1,))):
            bad.append(number + unit)
    return bad


@pytest.mark.parametrize("doc", DOCS[:-1], ids=[p.stem for p in DOCS[:-1]])
def test_numbers_in_a_lessons_prose_are_printed_by_its_commands(doc):
    assert unprinted(doc.read_text()) == [], f"{doc.name}: not printed by a block, nor marked {SOURCED}"


def test_the_prose_checker_rounds_as_the_prose_does():
    page = "```bash\nrun\n```\n\n```text\nval loss 3.6526, MFU 0.504, 2,744,840 bytes, max 3.7e-07\n```\n"
    ok = ("The loss fell to 3.65 (or 3.653), at 50.4% MFU, 2,744,840.0 bytes, 3.7e-07 apart; `3.99` is code; "
          "989.4† TFLOP/s, 1.5×† (section 3.1), 0.75M†, on Python 3.11.")
    assert unprinted(page + ok) == []
    assert unprinted(page + "It fell to 3.66, at 50.5% MFU, 2.0% of it, 3.8e-07 apart, and 989.4 TFLOP/s.") == \
        ["3.66", "50.5%", "2.0%", "3.8e-07", "989.4"]
