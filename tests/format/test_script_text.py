"""A script is sent with the helpers it uses only (tdstore/_engine/script_text.py): what goes, what stays out."""

from __future__ import annotations

import re

import pytest

from tdstore._engine import scripts
from tdstore._engine.script_text import assemble, definitions, names_in

LIB = """-- a library
local unpack = unpack or table.unpack

-- adds one
local function inc(x)
  return x + 1
end

local K, L = 1, 2
local struct = nil
do
  struct = {K = K}
end

-- uses inc (and names dead() only in this comment)
local function twice(x)
  return inc(inc(x)) + L
end

local function dead()
  return struct
end
"""


def test_a_library_is_cut_into_its_top_level_definitions():
    preamble, defs = definitions(LIB)
    assert preamble == "-- a library\n"
    assert [sorted(d.defines) for d in defs] == [["unpack"], ["inc"], ["K", "L"], ["struct"], ["twice"], ["dead"]]
    assert "do\n  struct = {K = K}\nend" in defs[3].text  # a top-level do block belongs to the definition above it
    assert defs[4].uses >= {"inc", "L"} and "dead" not in defs[4].uses  # names in comments do not count


def test_only_what_the_script_uses_goes_transitively_and_in_order():
    text = assemble([LIB], "return twice(1)\n")
    assert "local function twice" in text and "local function inc" in text and "local K, L" in text
    assert "local function dead" not in text and "local struct" not in text and "local unpack" not in text
    assert text.index("local function inc") < text.index("local K, L") < text.index("local function twice")
    assert text.endswith("return twice(1)\n")
    # a second library may use the first; the do block comes with its variable
    text = assemble([LIB, "local function tail()\n  return dead()\nend\n"], "return tail()\n")
    assert "local function dead" in text and "struct = {K = K}" in text and "local function inc" not in text


def test_names_in_ignores_comments_of_both_kinds():
    assert names_in("a(b) -- c d\n--[[ e\n f ]] g --[==[ h ]==] i") == {"a", "b", "g", "i"}


@pytest.mark.parametrize("name", scripts.SCRIPT_NAMES)
def test_every_helper_a_script_calls_is_in_its_text(name):
    """Every tds_/TDS_ name the sent text uses is defined in it (a helper left out would be a nil global)."""
    text, _ = scripts.script_source(name)
    defined = set(re.findall(r"^local\s+function\s+(\w+)", text, re.M))
    for m in re.finditer(r"^local\s+([\w\s,]+?)\s*=", text, re.M):
        defined |= {n.strip() for n in m.group(1).split(",")}
    defined |= set(re.findall(r"^\s+local\s+function\s+(\w+)", text, re.M))
    defined |= {n.strip() for m in re.finditer(r"^\s+local\s+([\w\s,]+?)\s*=", text, re.M) for n in m.group(1).split(",")}
    used = {n for n in names_in(text) if n.lower().startswith("tds_")}
    assert used <= defined, sorted(used - defined)


def test_helpers_only_the_rest_uses_are_made_below_the_marker():
    """A script's common path returns above its REST line: the helpers only the code below uses come after it."""
    script = "if x then\n  return inc(1)\nend\n-- tds:rest\nreturn twice(2) + #dead()\n"
    text = assemble([LIB], script)
    head, rest = text.split("-- tds:rest\n")
    assert "local function inc" in head and "local function twice" not in head and "local function dead" not in head
    assert "local function twice" in rest and "local function dead" in rest and "struct = {K = K}" in rest
    assert rest.index("local K, L") < rest.index("local function twice") < rest.index("return twice(2)")
    assert "local function inc" not in rest  # made once, above: the rest sees it


def test_write_makes_only_the_short_paths_helpers_before_it():
    """write.lua's in-place path returns before the marker: the tree, inventory and ring helpers come after."""
    text, _ = scripts.script_source("write")
    head = text.split("-- tds:rest\n")[0]
    assert "local function tds_check" in head and "local function in_place" in head
    assert "local function tds_tree" not in head and "local function tds_inventory" not in head
    assert "local function tds_tree" in text and "local function tds_inventory" in text
