"""Each script's header says what it touches, and a parser of the header format checks it
against what the rendered script (includes inlined) really reads.

The header format (BullMQ-style, see lua/includes/common.lua for the shared parts), one
``--[[ ... ]]`` block at the top of each file; section headings stand at two spaces::

  KEYS used: ledger, fifo, ...            roles of kvgate.keys.SCRIPT_KEYS (all 15 are passed)
  ARGV[1] now: ...                        scripts only: the clock
  ARGV[2] JSON object ...:                scripts only; entries at four spaces:
    name (type, required): meaning          read as P.name (a missing one is an error)
    name (type, optional): meaning          read as OPT.name (nil when absent)
  ARGV[3] knobs (...): name, name, ...    scripts only: the knobs it reads (P.name), described
                                          in common.lua
  Returns: ... / Publishes: "g <ticket>" ...
  Knobs read: name, ... | none            includes only: the knobs their own functions read
  Gate keys: / Knobs:                     common.lua only: the catalogues (role (TYPE): ...,
                                          knob (unit): ...)

Continuation lines are indented deeper than the line they continue; a parenthesis in a list
of names is a remark. What a script reads is found in its code with comments and strings
removed, following calls: an include's function counts only when the script (or a function
it reaches) calls it, so a helper inlined but never called declares nothing.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvgate import GateConfig
from kvgate.client import scripts
from kvgate.client.flows import knob_params
from kvgate.keys import SCRIPT_KEYS

LUA = Path(__file__).resolve().parent.parent / "lua"


# -- Lua text: code without comments and strings ----------------------------------------------
LONG_OPEN = re.compile(r"\[(=*)\[")


def strip_lua(src: str) -> str:
    """The code of a Lua chunk with comments removed and string literals emptied (``""``);
    line breaks are kept, so line numbers still match."""
    out: list[str] = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("--", i):
            m = LONG_OPEN.match(src, i + 2)
            if m:
                end = src.find("]" + m.group(1) + "]", m.end())
                end = n if end < 0 else end + len(m.group(1)) + 2
            else:
                end = src.find("\n", i)
                end = n if end < 0 else end
            out.append("\n" * src.count("\n", i, end))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + 1
        elif (m := LONG_OPEN.match(src, i)) is not None:
            end = src.find("]" + m.group(1) + "]", m.end())
            end = n if end < 0 else end + len(m.group(1)) + 2
            out.append('""' + "\n" * src.count("\n", i, end))
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


TOP_FUNCTION = re.compile(r"^local function ([A-Za-z_]\w*)\s*\(", re.M)


def split_functions(code: str) -> tuple[dict[str, str], str]:
    """An include's top-level ``local function``s (from the line that opens one at column 0
    to the next ``end`` at column 0) by name, and the rest of its code (run when inlined)."""
    funcs: dict[str, str] = {}
    rest: list[str] = []
    pos = 0
    for m in TOP_FUNCTION.finditer(code):
        if m.start() < pos:
            raise AssertionError(f"function {m.group(1)} opens inside another one")
        rest.append(code[pos:m.start()])
        end = re.compile(r"^end\b", re.M).search(code, m.end())
        assert end is not None, f"function {m.group(1)} has no 'end' at column 0"
        funcs[m.group(1)] = code[m.start():end.end()]
        pos = end.end()
    rest.append(code[pos:])
    return funcs, "".join(rest)


@dataclass
class Reads:
    required: set[str] = field(default_factory=set)   # P.<name>
    optional: set[str] = field(default_factory=set)   # OPT.<name>
    keys: set[str] = field(default_factory=set)       # K.<role>
    publishes: set[str] = field(default_factory=set)  # publish("x ...") kinds

    def add(self, code: str, raw: str = "") -> None:
        self.required |= set(re.findall(r"\bP\.(\w+)", code))
        self.optional |= set(re.findall(r"\bOPT\.(\w+)", code))
        self.keys |= set(re.findall(r"\bK\.(\w+)", code))
        self.publishes |= set(re.findall(r"""\bpublish\(["'](\w) """, raw))


def bare_uses(code: str) -> list[str]:
    """Uses of P, OPT or K other than ``.name`` (an index by a variable, a table passed
    around): what such a use reads cannot be checked."""
    return [m.group(0) for m in re.finditer(r"\b(P|OPT|K)\b(?!\.\w)", code)]


def include_names(src: str) -> list[str]:
    return scripts.INCLUDE_RE.findall(src)


def include_closure(name_src: str) -> list[str]:
    """Every include a file pulls in, itself included (dependency order not needed here)."""
    seen: list[str] = []
    todo = include_names(name_src)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.append(n)
            todo += include_names((LUA / "includes" / f"{n}.lua").read_text())
    return seen


def what_a_script_reads(name: str) -> Reads:
    """What script ``name`` reads when it runs: its own code, the top-level code of every
    include it inlines, and the include functions reachable from those by calls."""
    own_src = (LUA / f"{name}.lua").read_text()
    funcs: dict[str, tuple[str, str]] = {}   # name -> (code, raw text)
    roots: list[tuple[str, str]] = [(strip_lua(own_src), own_src)]
    for inc in include_closure(own_src):
        raw = (LUA / "includes" / f"{inc}.lua").read_text()
        code = strip_lua(raw)
        fs, rest = split_functions(code)
        raw_fs, _ = split_functions(raw)
        for f, body in fs.items():
            assert f not in funcs, f"function {f} is defined twice"
            funcs[f] = (body, raw_fs[f])
        roots.append((rest, raw))
    reads = Reads()
    reached: set[str] = set()
    todo = list(roots)
    while todo:
        code, raw = todo.pop()
        reads.add(code, raw)
        for f in set(re.findall(r"\b([A-Za-z_]\w*)\b", code)) & funcs.keys() - reached:
            reached.add(f)
            todo.append(funcs[f])
    return reads


# -- the header ---------------------------------------------------------------------------------
PARAM = re.compile(r"^([a-z_][a-z0-9_]*) \(([^()]*?), (required|optional)\): (\S.*)$")
CATALOGUE = re.compile(r"^([a-z_][a-z0-9_]*) \(([^()]+)\): (\S.*)$")
SECTION = re.compile(r"^  (\S[^:]*?)(?::|$)(.*)$")


class HeaderError(AssertionError):
    pass


@dataclass
class Header:
    purpose: str
    sections: dict[str, list[str]]      # heading -> its lines (first: the rest of the heading line)

    def names(self, heading: str) -> set[str]:
        """A section that is a list of names (remarks in parentheses); "none" is empty."""
        text = " ".join(self.section(heading))
        text = re.sub(r"\([^()]*\)", " ", text)
        words = [w for w in re.split(r"[,;\s]+", text) if w]
        if words == ["none"]:
            return set()
        for w in words:
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", w):
                raise HeaderError(f"{heading}: {w!r} is not a name")
        if len(set(words)) != len(words):
            raise HeaderError(f"{heading}: a name is listed twice: {words}")
        return set(words)

    def section(self, heading: str) -> list[str]:
        for h, lines in self.sections.items():
            if h == heading or h.startswith(heading + " "):
                return lines
        raise HeaderError(f"no {heading!r} section (sections: {list(self.sections)})")

    def entries(self, heading: str) -> list[tuple[str, str]]:
        """The entries of a section at four spaces: (first line, with its continuations)."""
        out: list[tuple[str, str]] = []
        for line in self.section(heading)[1:]:
            if not line.strip():
                continue
            if line.startswith("    ") and not line.startswith("     "):
                out.append((line.strip(), line.strip()))
            elif line.startswith("      ") and out:
                first, whole = out[-1]
                out[-1] = (first, whole + " " + line.strip())
            else:
                raise HeaderError(f"{heading}: a line that is neither an entry nor its continuation: {line!r}")
        return out

    def params(self) -> tuple[dict[str, str], set[str]]:
        """ARGV[2]: its parameters (name -> "required" / "optional"); ARGV[3]: its knobs."""
        params: dict[str, str] = {}
        for first, whole in self.entries("ARGV[2]"):
            m = PARAM.match(whole)
            if not m or not m.group(2).strip():
                raise HeaderError(f"ARGV[2]: not 'name (type, required|optional): meaning': {first!r}")
            if m.group(1) in params:
                raise HeaderError(f"ARGV[2]: {m.group(1)} declared twice")
            params[m.group(1)] = m.group(3)
        return params, self.names("ARGV[3]")

    def catalogue(self, heading: str) -> list[str]:
        """common.lua's catalogues: 'name (type or unit): meaning', in order."""
        names = []
        for first, whole in self.entries(heading):
            m = CATALOGUE.match(whole)
            if not m:
                raise HeaderError(f"{heading}: not 'name (type): meaning': {first!r}")
            names.append(m.group(1))
        return names


def parse_header(src: str, file: str) -> Header:
    """The ``--[[ ... ]]`` block a file opens with, cut into sections."""
    if not src.startswith("--[[\n"):
        raise HeaderError(f"{file}: does not open with a --[[ header block")
    body = src[5:src.index("]]")]
    lines = body.split("\n")
    first = lines[0].strip()
    if not first.startswith(f"{file}: ") or len(first) < len(file) + 10:
        raise HeaderError(f"{file}: the header's first line is not '{file}: <purpose>': {first!r}")
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip(" "))
        if current is not None and line.strip() and indent not in (2,) and indent < 4:
            raise HeaderError(f"{file}: a line indented {indent} in a section (headings at 2, entries at 4): {line!r}")
        m = SECTION.match(line) if indent == 2 else None
        if m and (m.group(1) in ("KEYS used", "Returns", "Publishes", "Knobs read", "Knobs", "Gate keys")
                  or m.group(1).startswith(("ARGV[1] ", "ARGV[2] ", "ARGV[3] "))):
            heading = m.group(1)
            if heading in sections:
                raise HeaderError(f"{file}: two {heading!r} sections")
            current = sections[heading] = [m.group(2)]
        elif current is not None and (line.startswith("    ") or not line.strip()):
            current.append(line)
        else:
            current = None  # prose
    return Header(first, sections)


# -- the checks -------------------------------------------------------------------------------
KNOBS = list(knob_params(GateConfig(), "ch"))


def script_problems(name: str) -> list[str]:
    """How script ``name``'s header and what it reads disagree (empty: they agree)."""
    src = (LUA / f"{name}.lua").read_text()
    h = parse_header(src, f"{name}.lua")
    reads = what_a_script_reads(name)
    params, knobs = h.params()
    problems: list[str] = []
    required = {p for p, r in params.items() if r == "required"}
    optional = {p for p, r in params.items() if r == "optional"}

    def differ(what: str, read: set[str], declared: set[str]) -> None:
        if read - declared:
            problems.append(f"{name}.lua reads {what} its header does not declare: {sorted(read - declared)}")
        if declared - read:
            problems.append(f"{name}.lua declares {what} it does not read: {sorted(declared - read)}")

    differ("required parameters (P.) or knobs", reads.required, required | knobs)
    differ("optional parameters (OPT.)", reads.optional, optional)
    differ("KEYS", reads.keys, h.names("KEYS used"))
    published = set(re.findall(r'"(\w) <', " ".join(h.section("Publishes"))))
    differ("publications", reads.publishes, published)
    if knobs - set(KNOBS):
        problems.append(f"{name}.lua lists knobs that are not knobs: {sorted(knobs - set(KNOBS))}")
    if set(params) & set(KNOBS):
        problems.append(f"{name}.lua describes knobs as its own parameters: {sorted(set(params) & set(KNOBS))} "
                        f"(list them in its ARGV[3] knobs; common.lua describes them)")
    if set(h.names("KEYS used")) - set(SCRIPT_KEYS):
        problems.append(f"{name}.lua names KEYS that are no gate key: {sorted(h.names('KEYS used') - set(SCRIPT_KEYS))}")
    for heading in ("ARGV[1]", "Returns"):
        h.section(heading)
    bare = bare_uses(strip_lua(src))
    if bare:
        problems.append(f"{name}.lua uses P / OPT / K other than by .name: {bare}")
    return problems


def include_problems(inc: str) -> list[str]:
    """How include ``inc``'s header and its own code disagree: the KEYS and knobs its
    functions use (includes read knobs only, by P.<name>)."""
    src = (LUA / "includes" / f"{inc}.lua").read_text()
    h = parse_header(src, f"{inc}.lua")
    code = strip_lua(src)
    reads = Reads()
    reads.add(code, src)
    problems = []
    for what, read, declared in (("knobs", reads.required, h.names("Knobs read")),
                                 ("KEYS", reads.keys, h.names("KEYS used"))):
        if read != declared:
            problems.append(f"{inc}.lua: {what} read {sorted(read)}, declared {sorted(declared)}")
    if reads.required - set(KNOBS):
        problems.append(f"{inc}.lua reads parameters that are not knobs: {sorted(reads.required - set(KNOBS))}")
    if reads.optional:
        problems.append(f"{inc}.lua reads optional parameters (a script's own business): {sorted(reads.optional)}")
    if inc != "common" and bare_uses(code):
        problems.append(f"{inc}.lua uses P / OPT / K other than by .name: {bare_uses(code)}")
    return problems


INCLUDES = sorted(p.stem for p in (LUA / "includes").glob("*.lua"))


@pytest.mark.parametrize("name", scripts.SCRIPT_NAMES)
def test_a_scripts_header_declares_exactly_what_it_reads(name):
    assert script_problems(name) == []


@pytest.mark.parametrize("inc", INCLUDES)
def test_an_includes_header_declares_the_knobs_and_keys_its_functions_use(inc):
    assert include_problems(inc) == []


def test_every_script_file_is_a_known_script_and_every_include_is_used():
    assert sorted(p.stem for p in LUA.glob("*.lua")) == sorted(scripts.SCRIPT_NAMES)
    used = {i for n in scripts.SCRIPT_NAMES for i in include_closure((LUA / f"{n}.lua").read_text())}
    assert used == set(INCLUDES)


def test_common_lua_catalogues_match_the_client():
    src = (LUA / "includes" / "common.lua").read_text()
    h = parse_header(src, "common.lua")
    # the knobs it describes are the ones knob_params sends, no more, no fewer
    assert sorted(h.catalogue("Knobs")) == sorted(KNOBS)
    # the gate keys, in KEYS order, as kvgate.keys passes them and as begin() names them
    assert h.catalogue("Gate keys") == list(SCRIPT_KEYS)
    roles = re.search(r"local KEY_ROLES = \{(.*?)\}", src, re.S).group(1)
    assert re.findall(r'"(\w+)"', roles) == list(SCRIPT_KEYS)


# -- the parser and the reachability, on small texts --------------------------------------------
def test_strip_lua_removes_comments_and_strings_but_keeps_lines():
    src = 'a = "P.x -- no" -- P.y\n--[[ P.z\n]] b = [==[P.w]==] .. \'K.q\\\'\' .. P.v\n'
    code = strip_lua(src)
    assert code.count("\n") == src.count("\n")
    assert re.findall(r"\bP\.(\w+)", code) == ["v"] and "K.q" not in code


def test_split_functions_and_bare_uses():
    fs, rest = split_functions("local X = 1\nlocal function f(a)\n  if a then\n  end\nend\nf(P.a)\n")
    assert list(fs) == ["f"] and "end\nend" in fs["f"] and "f(P.a)" in rest
    assert bare_uses("x = P.a + OPT.b + K.c") == []
    assert bare_uses("x = P[name] or OPT") == ["P", "OPT"]


SAMPLE = '''--[[
  sample.lua: a purpose line long enough.

  KEYS used: ledger, fifo (the FIFO)
  ARGV[1] now: ms or ""
  ARGV[2] JSON object of named parameters:
    ticket (str, required): the ticket, described over
      two lines
    gap (ms, optional): time away
  ARGV[3] knobs (the gate's): reap_batch, channel
  Returns: JSON {}
  Publishes: "g <ticket>" for grants
]]
'''


def test_the_header_parser_reads_the_format():
    h = parse_header(SAMPLE, "sample.lua")
    assert h.names("KEYS used") == {"ledger", "fifo"}
    assert h.params() == ({"ticket": "required", "gap": "optional"}, {"reap_batch", "channel"})


@pytest.mark.parametrize("bad, message", [
    ("    ticket (str): no required or optional", "not 'name"),
    ("    ticket (, required): no type", "not 'name"),
    ("   ticket (str, required): three spaces", "indented 3"),
    ("     ticket (str, required): five spaces, after an entry", "neither an entry"),
    ("    gap (ms, optional): again", "declared twice"),
    ("    knobs: reap_batch, channel", "not 'name"),  # knobs are ARGV[3]'s, not parameters
])
def test_the_header_parser_refuses_what_is_not_the_format(bad, message):
    src = SAMPLE.replace("    gap (ms, optional): time away", "    gap (ms, optional): time away\n" + bad)
    with pytest.raises(HeaderError, match=re.escape(message)):
        parse_header(src, "sample.lua").params()


def test_the_header_parser_refuses_a_knob_that_is_not_a_name():
    with pytest.raises(HeaderError, match="is not a name"):
        parse_header(SAMPLE.replace("reap_batch, channel", "reap_batch, Channel!"), "sample.lua").params()


def test_the_check_finds_an_undeclared_read_and_a_declared_unread_one(tmp_path, monkeypatch):
    inc = tmp_path / "includes"
    inc.mkdir()
    (inc / "common.lua").write_text((LUA / "includes" / "common.lua").read_text())
    (inc / "extra.lua").write_text('--[[\n  extra.lua: a helper with a knob\n\n  KEYS used: none\n'
                                   '  Knobs read: headroom\n]]\n--@include common\n'
                                   'local function unused()\n  return P.headroom\nend\n'
                                   'local function used()\n  return P.claim_ms\nend\n')
    (tmp_path / "sample.lua").write_text(SAMPLE + "--@include common\n--@include extra\n"
                                         'local x = P.ticket + OPT.age + used()\nredis.call("GET", K.ledger)\n')
    monkeypatch.setattr(sys.modules[__name__], "LUA", tmp_path)
    assert script_problems("sample") == [
        "sample.lua reads required parameters (P.) or knobs its header does not declare: ['claim_ms']",
        "sample.lua declares required parameters (P.) or knobs it does not read: ['channel', 'reap_batch']",
        "sample.lua reads optional parameters (OPT.) its header does not declare: ['age']",
        "sample.lua declares optional parameters (OPT.) it does not read: ['gap']",
        "sample.lua declares KEYS it does not read: ['fifo']",
        "sample.lua declares publications it does not read: ['g']",
    ]  # and nothing about headroom: unused() is never called, so its read does not count
    assert include_problems("extra") == ["extra.lua: knobs read ['claim_ms', 'headroom'], declared ['headroom']"]
