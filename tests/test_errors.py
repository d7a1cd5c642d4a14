"""errors.one_line: the one way an exception becomes a line in a table, reason or verdict."""

from decompshard.errors import one_line


class _Custom(Exception):
    pass


def test_first_line_with_the_type():
    e = RuntimeError("  shapes do not match\nwhile running mm\n  hint: ...")
    assert one_line(e) == "RuntimeError: shapes do not match"


def test_limit_cuts_the_first_line_only():
    e = ValueError("x" * 300 + "\nsecond")
    assert one_line(e, 200) == "ValueError: " + "x" * 200
    assert one_line(e) == "ValueError: " + "x" * 300


def test_empty_message_gives_the_type_alone():
    assert one_line(AssertionError()) == "AssertionError"
    assert one_line(_Custom("   \n ")) == "_Custom"
    assert one_line(AssertionError(), 160, with_type=False) == "AssertionError"


def test_without_the_type():
    e = KeyError("no such key")  # KeyError's str() quotes its argument
    assert one_line(e, with_type=False) == "'no such key'"
    assert one_line(RuntimeError("a\nb"), 1, with_type=False) == "a"
