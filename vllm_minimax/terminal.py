"""Text made safe to print: no character that a terminal would act on instead of showing."""

from __future__ import annotations


def printable(text: str, *, keep_newlines: bool = True) -> str:
    """``text`` with every character that is not printable (escape sequences, carriage
    returns, bidirectional overrides; newlines unless ``keep_newlines``) written as a Python
    escape, so that a value read from a file can neither drive the terminal nor forge a line."""
    if text.isprintable():
        return text
    return "".join(
        character
        if character.isprintable() or (keep_newlines and character == "\n")
        else repr(character)[1:-1]  # repr escapes every character that is not printable
        for character in text
    )
