"""What a path or a file name from a config may hold, judged as text before the file system sees
it: no control character (a NUL ends the name early for the OS, a line break splits a log
line), no bidirectional mark (the name shown is not the name used), and no name longer than file
systems take (255 bytes a name, 4096 a path: a longer one fails every lookup)."""

from __future__ import annotations

import os
import re

UNSAFE_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
NAME_MAX = 255
PATH_MAX = 4095


def text_problem(text: str) -> str | None:
    """Why `text` may not be a value a config gives here; None when it may."""
    if UNSAFE_CHARACTERS.search(text):
        return "holds a control character or a right-to-left mark"
    return None


def path_text_problem(path: str) -> str | None:
    """Why `path` cannot name a file or folder; None when it can (as text)."""
    if problem := text_problem(path):
        return problem
    if len(os.fsencode(path)) > PATH_MAX:
        return f"is longer than the {PATH_MAX} bytes allowed for a path"
    for name in path.split("/"):
        if len(os.fsencode(name)) > NAME_MAX:
            return f"has a name ({name[:20]}...) that is longer than the {NAME_MAX} bytes allowed"
    return None
