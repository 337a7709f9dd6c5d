#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""check-docs.py ROOT PAGE...: the documentation hangs together.

PAGE... are the pages the docs tests run (tests/CMakeLists.txt, tally_docs_test), relative to
ROOT. Checked:
- every page of docs/ is among them, and so is README.md: none is left untested;
- the README links every page of docs/: none is left unfound;
- every relative link of README.md, docs/*.md, proto/PROTOCOL.md and CONTRIBUTING.md names a
  file of the tree, and a link to a heading (`PAGE.md#a-heading`, `#a-heading`) names one that
  the page has (GitHub's anchors: lower case, punctuation dropped, spaces to dashes).
Exit 0 when all holds, 1 with one line per fault (FILE:LINE: what), 2 for a bad command line.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Dict, List, Set

LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCUMENTS = ("README.md", "proto/PROTOCOL.md", "CONTRIBUTING.md")


def anchors(path: str, cache: Dict[str, Set[str]]) -> Set[str]:
    """The anchors GitHub makes of a Markdown file's headings (fenced blocks left out)."""
    if path not in cache:
        found: Set[str] = set()
        fence = False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("```"):
                    fence = not fence
                m = None if fence else re.match(r"^#+\s+(.*?)\s*#*\s*$", line)
                if m:
                    slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
                    found.add(slug)
        cache[path] = found
    return cache[path]


def links(root: str, doc: str, cache: Dict[str, Set[str]]) -> List[str]:
    """The faults of doc's relative links."""
    faults = []
    fence = False
    with open(os.path.join(root, doc), encoding="utf-8") as f:
        lines = f.read().splitlines()
    for no, line in enumerate(lines, 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        for target in LINK_RE.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(root, os.path.dirname(doc), path)) if path \
                else os.path.join(root, doc)
            if not os.path.exists(full):
                faults.append(f"{doc}:{no}: link to {target}: no such file")
            elif anchor and full.endswith(".md") and anchor not in anchors(full, cache):
                faults.append(f"{doc}:{no}: link to {target}: no heading with that anchor")
    return faults


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    root, tested = sys.argv[1], set(sys.argv[2:])
    pages = sorted("docs/" + n for n in os.listdir(os.path.join(root, "docs")) if n.endswith(".md"))
    faults = []
    for page in pages + ["README.md"]:
        if page not in tested:
            faults.append(f"{page}:1: run by no docs test: add it to a tally_docs_test in "
                          "tests/CMakeLists.txt")
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        linked = {target.partition("#")[0] for target in LINK_RE.findall(f.read())}
    for page in pages:
        if page not in linked:
            faults.append(f"README.md:1: no link to {page}: add it to \"Where to go next\"")
    cache: Dict[str, Set[str]] = {}
    for doc in pages + list(DOCUMENTS):
        faults += links(root, doc, cache)
    for fault in faults:
        print(fault)
    if not faults:
        print(f"{len(pages)} pages of docs/ and the README: every one run by a docs test and "
              f"linked from the README; every link of them, PROTOCOL.md and CONTRIBUTING.md "
              f"found")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
