"""The course as it is today, and what a page's "lesson N" and "section k" point at (tests/test_references.py).

A lesson numbers its sections in their headings ("## 3. The vocabulary", "### 3.1 ..."); a page says
"lesson 10, section 3" (or "lesson 10's section 3", or "lesson 10 §3": the same), and "section 3" alone
for one of its own. The lessons are read from lessons/NN-name.md, never listed: a course renumbered by a
script is checked as it then is. A reference is stale when its lesson or section does not exist, or when
the sentence around it (`topic`) is about another lesson: its words fit another lesson's title and
headings clearly better than the named lesson's (`Course.fit`). The words are compared, not understood,
so the rule is conservative: a sentence that fits its own lesson at all is left alone, and one common word
is no evidence.
"""

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n?", re.S | re.M)  # as tests/test_lessons.py reads a page


def blank(text: str, keep: tuple[str, ...] = ()) -> str:
    """The page with its fenced blocks (but those of a kind in `keep`) blanked out, line numbers kept."""
    return FENCE.sub(lambda m: m.group(0) if m.group(1) in keep else re.sub(r"[^\n]", " ", m.group(0)), text)


def line_of(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


# ----------------------------------------------------------------------------- the course


# words that say nothing about which lesson is meant: English, and what every lesson of this course is about
STOP = set("""the and for with what how why its from into one two each every that this which where when are was not
but than then them they their there these those all any more most only also over under about after before between
both same other own lesson lessons section sections run runs step steps model try next check set setup using use used
does did can here first last see our your you has have had who whose out off per like looks look must need needs
goes make makes take takes give gives say says show shows whole full new real less much many few way part done
just still even again once now already instead rather three four five six seven eight nine ten course train training
time times layer layers""".split())


def words(text: str) -> set[str]:
    """The words that can name a topic: lower case, three letters or more (or a letter and a digit: 3d,
    fp8), not a STOP word."""
    found = re.findall(r"[a-z0-9]+", text.lower())
    return {w for w in found if w not in STOP and re.search("[a-z]", w) and (len(w) >= 3 or re.search(r"\d", w))}


def fits(a: str, b: str) -> bool:
    """Two words name the same thing: equal, or one starts the other (clip, clipping; parallel, parallelism)."""
    return a == b or (min(len(a), len(b)) >= 4 and (a.startswith(b) or b.startswith(a)))


@dataclass
class Lesson:
    number: int
    file: str
    title: str  # after "Lesson N — "
    sections: dict[str, str]  # "3" -> "The vocabulary: embedding, loss and tied weights", "3.1" -> ...
    intro: str  # the paragraphs before its first section: what it is about, in a few sentences


class Course:
    """The lessons as they are today, and how well a few words fit each one's title and headings."""

    def __init__(self, root: Path):
        self.lessons: dict[int, Lesson] = {}
        for path in sorted((root / "lessons").glob("[0-9]*-*.md")):
            text = blank(path.read_text())
            title = re.search(r"^# (?:Lesson \d+ — )?(.*)$", text, re.M).group(1)
            sections = dict(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? (.*)$", text, re.M))
            intro = text[text.index("\n"):text.index("\n## ") if "\n## " in text else len(text)]
            intro = " ".join(s for s in re.split(r"(?<=[.!?])\s+", intro) if not LESSON_REF.search(s))  # its own topic
            n = int(path.name.split("-")[0])
            self.lessons[n] = Lesson(n, path.name, title, sections, without_code(intro))
        self.vocab = {n: words(x.title + " " + " ".join(x.sections.values())) for n, x in self.lessons.items()}
        self.covers = {n: self.vocab[n] | words(x.intro) for n, x in self.lessons.items()}
        self.uses = {n: words(without_code(blank((root / "lessons" / x.file).read_text())))
                     for n, x in self.lessons.items()}  # every word of its prose

    def fit(self, topic: set[str], named: list, candidates: dict | None = None, table: bool = False) -> tuple | None:
        """(a candidate that fits `topic` clearly better than those `named`, the words it fits), or None.
        The candidates are the lessons (their titles and headings), or a lesson's sections (`candidates`).
        Clearly: two words of a candidate where those named fit none (for a lesson: none of its title,
        headings and introduction), or three more words than they fit (in a `table`, whose row is all about
        its lesson: twice as many and two more); or, in prose, a word of one lesson's headings alone that
        the named lesson never uses ("vocabulary", for lesson 8). One common word is no evidence ("the
        dropped step" is not lesson 18's "dropped tokens"), and a sentence that fits its lesson at all is
        left alone: a reference is stale when its sentence is about another lesson."""
        vocab, covers = (candidates, candidates) if candidates else (self.vocab, self.covers)
        fitting = {k: {w for w in topic if any(fits(w, v) for v in words)} for k, words in vocab.items()}
        mine = max(len({w for w in topic if any(fits(w, v) for v in covers[k])}) for k in named)
        best = max((k for k in vocab if k not in named), key=lambda k: len(fitting[k]), default=None)
        more = len(fitting[best]) if best is not None else 0
        if (mine == 0 and more >= 2) or more >= mine + 3 or (table and more >= max(2 * mine, mine + 2)):
            return best, sorted(fitting[best])
        if candidates is None and not table and mine == 0:
            for w in sorted(topic):
                owners = [k for k, found in fitting.items() if w in found]
                if len(owners) == 1 and owners[0] not in named and \
                        not any(fits(w, v) for k in named for v in self.uses[k]):
                    return owners[0], [w]
        return None

    def describe(self, n: int, section: str | None = None) -> str:
        x = self.lessons[n]
        return f"lesson {n} section {section} ({x.sections[section]})" if section else f"lesson {n} ({x.title})"


# "lesson 10", "lessons 9 and 14", "lessons 9–15", "lesson 10, section 3", "lesson 6's section 8", "lesson 10 §3"
LESSON_REF = re.compile(r"\b[Ll]essons?\s+(?P<nums>\d+(?:(?:,\s+|\s+and\s+|\s+or\s+|\s+to\s+|–|-)\d+)*)(?![\d.]*\d)"
                        r"(?:(?:,\s+|'s\s+|\s+)(?:section\s+|§\s*)(?P<sec>\d+(?:\.\d+)?))?")
OWN_SECTION = re.compile(r"(?<![\w§])(?:[Ss]ection |§ ?)(\d+(?:\.\d+)?)")
# near a citation, "section k" is the paper's: a year, "et al.", a title in quotes, a paper by name
CITES = re.compile(r"et al|\b(?:19|20)\d\d\b|paper|appendix|\"|GPipe|PaLM|Megatron|ZeRO|Llama|DeepSeek|"
                   r"\b(?:[Tt]heir|its) section")
BOUNDARY = re.compile(r"[;:()—|]|\.\s|,\s|\n\s*\n|^#+ ", re.M)


def without_code(text: str) -> str:
    """Inline code blanked: an identifier is no topic (`init_device_mesh` is not lesson 1's initialization)."""
    return re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), text)


def enclosing(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The parentheses around text[start:end], within its paragraph."""
    depth, i = 0, start - 1
    while i >= 0 and text[i:i + 2] != "\n\n":
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth < 0:
            break
        i -= 1
    else:
        return None
    depth, j = 0, end
    while j < len(text) and text[j:j + 2] != "\n\n":
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth < 0:
            return i, j
        j += 1
    return None


def clause(text: str, start: int, end: int) -> str:
    """The phrase text[start:end] stands in, between the nearest boundaries (BOUNDARY) on either side."""
    before = [m.end() for m in BOUNDARY.finditer(text, 0, start)]
    after = BOUNDARY.search(text, end)
    return text[before[-1] if before else 0:after.start() if after else len(text)]


def topic(text: str, start: int, end: int) -> set[str]:
    """The words that name what a reference at text[start:end] points at. In parentheses with company, the
    rest of its part of them (parts split at ';', the part before where its own is bare): "(lesson 8 splits
    the vocabulary)". Alone in them, the phrase just before them: "Data parallelism (lesson 9)". Else its
    own clause, and the parentheses right after it: "lesson 9 (data parallelism)"."""
    ref = text[start:end]
    if (paren := enclosing(text, start, end)) is not None:
        parts = text[paren[0] + 1:paren[1]].split(";")
        mine = next(i for i, part in enumerate(parts) if ref in part)
        for part in (parts[mine], parts[mine - 1] if mine else ""):
            if found := words(part.replace(ref, " ")):
                return found
        return words(clause(text, paren[0], paren[0]))
    own = words(clause(text, start, end).replace(ref, " "))
    if (after := re.match(r"\s*\(([^()]*)\)", text[end:])) is not None:
        own |= words(after.group(1))
    return own


def numbers(nums: str) -> tuple[list[int], bool]:
    """The lesson numbers of "9", "9 and 14", "9–15", "9 to 15"; and whether they are a range."""
    found = [int(n) for n in re.findall(r"\d+", nums)]
    return found, bool(re.search(r"–|-| to ", nums))


def lesson_problems(text: str, course: Course, own: int | None) -> list[tuple[int, str]]:
    """(offset, problem) for each lesson or section reference of a page (its fenced output blanked)."""
    out = []
    for m in LESSON_REF.finditer(text):
        nums, is_range = numbers(m.group("nums"))
        ref, sec = " ".join(m.group(0).split()), m.group("sec")
        if missing := [n for n in nums if n not in course.lessons]:
            out.append((m.start(), f"'{ref}': there is no lesson {missing[0]} (lessons/ has "
                                   f"{min(course.lessons)}-{max(course.lessons)})"))
            continue
        if sec and sec not in course.lessons[nums[-1]].sections:
            out.append((m.start(), f"'{ref}': lesson {nums[-1]} has no section {sec} (its sections: "
                                   f"{', '.join(course.lessons[nums[-1]].sections)})"))
            continue
        if is_range:
            continue
        about = topic(text, m.start(), m.end())
        if (better := course.fit(about, nums)) is not None:
            key, fitting = better
            out.append((m.start(), f"'{ref}': the sentence is about {', '.join(fitting)}, which is "
                                   f"{course.describe(key)}, not {course.describe(nums[0])}"))
        elif sec:
            lesson = course.lessons[nums[-1]]
            candidates = {k: words(v) for k, v in lesson.sections.items()}
            if (better := course.fit(about, [sec], candidates)) is not None:
                key, fitting = better
                out.append((m.start(), f"'{ref}': the sentence is about {', '.join(fitting)}, which is "
                                       f"{course.describe(nums[-1], key)}, not section {sec}"))
    return out + ([] if own is None else own_problems(text, course, own))


def own_problems(text: str, course: Course, own: int) -> list[tuple[int, str]]:
    """What lesson `own` says of itself: its sections ("section k" alone), its title's number, and any
    lesson number in a name (`--rdzv-id lesson13-$$`)."""
    out, sections = [], course.lessons[own].sections
    for m in OWN_SECTION.finditer(text):
        if re.search(r"[Ll]essons?\s+\d+(,\s+|'s\s+|\s+)$", text[max(0, m.start() - 20):m.start()]):
            continue  # "lesson N, section k": above
        if m.group(1) not in sections and not CITES.search(text[max(0, m.start() - 200):m.end() + 40]):
            out.append((m.start(), f"'{m.group(0)}': this lesson has no section {m.group(1)} (its sections: "
                                   f"{', '.join(sections)})"))
    if (title := re.search(r"^# Lesson (\d+)\b", text, re.M)) and int(title.group(1)) != own:
        out.append((title.start(), f"the title says lesson {title.group(1)}, the file name {own}"))
    for m in re.finditer(r"\blesson(\d+)\b", text):
        if int(m.group(1)) != own:
            out.append((m.start(), f"'{m.group(0)}': a name that says lesson {m.group(1)}, in lesson {own}"))
    return out


def table_problems(text: str, course: Course) -> list[tuple[int, str]]:
    """A table with a "lesson" column: each row's lesson numbers exist, and the rest of the row is about them."""
    out = []
    for table in re.finditer(r"(?:^\|.*\|\n)+", text, re.M):
        rows = [(table.start() + sum(len(r) + 1 for r in table.group(0).split("\n")[:i]), r)
                for i, r in enumerate(table.group(0).rstrip("\n").split("\n"))]
        header = [c.strip().lower() for c in rows[0][1].strip("|").split("|")]
        if not {"lesson", "lessons"} & set(header):
            continue
        col = header.index("lesson" if "lesson" in header else "lessons")
        for at, row in rows[2:]:
            cells = [c.strip() for c in row.strip("|").split("|")]
            nums = [int(n) for n in re.findall(r"\d+", cells[col])]
            if missing := [n for n in nums if n not in course.lessons]:
                out.append((at, f"table row names lesson {missing[0]}, which does not exist"))
            elif nums and (better := course.fit(words(without_code(" ".join(cells[:col] + cells[col + 1:]))),
                                                nums, table=True)):
                out.append((at, f"table row's lesson {cells[col]}: the row is about {', '.join(better[1])}, "
                                f"which is {course.describe(better[0])}, not {course.describe(nums[0])}"))
    return out
