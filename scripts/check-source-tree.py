#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""check-source-tree.py TREE DOC: every file git tracks in TREE is described in DOC's source tree.

DOC is the document that walks a newcomer through the tree file by file (docs/source-tree.md; the
one argument to change when the walk moves). Its text read is the section headed "The source
tree" (at any level, up to the next heading of that level or above), or the whole document when
it has no such heading. A tracked file is described when that text

- names it: its file name (`td_router.c`, `tallyd.conf.example`) as a word of its own, with or
  without a folder before it; or
- names its stem inside backquotes: the name up to its first dot (`td_settings` for
  td_settings.c and td_settings.h, `tally_version` for tally_version.h.in), a whole word, so a
  module is named once for its source and its header; or
- holds, inside backquotes, a pattern with `*` that matches the file's whole path from the top
  of the tree (`bench/runs/*`, `tests/test_*`, `tests/fuzz/corpus/*`): files of one kind,
  described together.

A folder named alone (`daemon/`) does not describe the files in it: a new file must be named, or
be of a kind the text already describes by a pattern. Exit 0 when every file is described, 1
with one line per file that is not (and what to do), 2 for a bad command line.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
from typing import List

SECTION = "the source tree"


def section_text(doc: str) -> str:
    """The "The source tree" section of doc, or all of it when there is none."""
    lines = doc.splitlines()
    start, level = None, 0
    fence = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        m = re.match(r"^(#+)\s+(.*?)\s*$", line)
        if not m:
            continue
        if start is None and m.group(2).lower() == SECTION:
            start, level = i + 1, len(m.group(1))
        elif start is not None and len(m.group(1)) <= level:
            return "\n".join(lines[start:i])
    return "\n".join(lines[start:]) if start is not None else doc


def backquoted(text: str) -> List[str]:
    return re.findall(r"`([^`\n]+)`", text)


def described(path: str, text: str, spans: List[str]) -> bool:
    name = os.path.basename(path)
    # The file name, not inside a longer name (NAME.c in LONGNAME.c or NAME.c.in).
    if re.search(r"(?<![\w.@-])" + re.escape(name) + r"(?![\w@-]|\.\w)", text):
        return True
    stem = name.split(".", 1)[0] if not name.startswith(".") else name
    word = re.compile(r"(?<![\w-])" + re.escape(stem) + r"(?![\w-])")
    for span in spans:
        if stem and word.search(span):
            return True
        for pattern in re.findall(r"[\w./@-]*\*[\w./@*-]*", span):
            if fnmatch.fnmatchcase(path, pattern):
                return True
    return False


def main(argv: List[str]) -> int:
    if len(argv) != 3:
        print("usage: check-source-tree.py TREE DOC", file=sys.stderr)
        return 2
    tree, doc_path = argv[1], argv[2]
    files = subprocess.run(["git", "-C", tree, "ls-files", "-z"], check=True,
                           capture_output=True).stdout.decode().split("\0")
    with open(doc_path, encoding="utf-8") as f:
        text = section_text(f.read())
    spans = backquoted(text)
    where = os.path.relpath(doc_path, tree)
    missing = [p for p in files if p and not described(p, text, spans)]
    for p in missing:
        print(f"{where}: '{p}' is not described in the source tree: name it (or its stem, "
              "in backquotes) where its folder is described, or a `pattern*` of its kind")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
