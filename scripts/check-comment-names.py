#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""check-comment-names.py [TREE]: every file and function a comment or a document names exists.

Read: the comments of the C, CUDA, header, CMake, shell and Python sources (Python docstrings
too), and the whole text of the documents in DOCS (the README, the protocol and the guide for
contributors) and of every page of docs/. In them:

- a file name with a source-like extension (`td_sched.c`, `tests/test_shm.c`, `scripts/test.sh`,
  `bench/RESULTS.md`) must name a file of the tree. Without a folder it may be anywhere (files
  move between folders; a comment need not follow them); with one, some file's path must end
  with it (`lib/harness.c` inside tests/ is tests/lib/harness.c). A name whose `NAME.in`
  template exists is made by the build and counts as there, and so does a header of the
  system's include folders (`stdio.h`, `sys/socket.h`). Placeholders are not file names: a
  folder in capitals (`OUT_DIR/path.md`) is not looked for, and capitals in a name stand for
  any text (`FILE.c`, `bench/run-NAME.sh`).
- a function named `name()`, and any identifier with one of the project's prefixes (td_, tally_,
  tk_, th_, tr_, cli_, hv_, bench_) written `name(...)` or in backticks, must appear in the
  code of the tree (outside comments): defined there, or, for another project's function, at
  least called (a comment about `zmq_msg_send()` is about a call the code makes). A backticked
  name may also be a file's stem (`td_sched` for td_sched.c and td_sched.h); one that ends in
  `_` is a prefix (`tally__`), not a name.

What is neither, and is right anyway (another project's function the code never calls, a file
outside the tree), goes into ALLOWED below, with the reason. Absolute paths, URLs, patterns with
`*`, and names after `.` or `->` (methods, fields) are not checked. Exit 0 when all is found, 1
with one line per miss (FILE:LINE: what) otherwise.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tokenize
from typing import Dict, Iterator, List, Set, Tuple

# Names that exist outside this tree, each with why it is named.
ALLOWED: Dict[str, str] = {
    "td_web_assets.c": "written by web/embed.cmake into the build tree",
    "app.c": "the reader's own program in docs/c-and-python.md's example",
    "cuda.h": "the CUDA driver API's header, in the CUDA toolkit (not on every build host)",
}

PREFIXES = ("td_", "tally_", "tk_", "th_", "tr_", "cli_", "hv_", "bench_")
FILE_EXT = r"(?:c|h|cu|cuh|py|sh|bash|cmake|md|json|service|socket)"
# A file name: optional folders, a name, one of the extensions; not part of a longer word, an
# absolute path, a URL, a home-relative path or a pattern (`daemon/*/*_int.h`).
FILE_RE = re.compile(r"(?<![\w/.~:$@*-])((?:\.{1,2}/)?(?:[\w.-]+/)*[\w-][\w.-]*\." + FILE_EXT
                     + r")(?![\w/-])")
CALL_RE = re.compile(r"(?<![\w.>$:])([A-Za-z_]\w*)\(\)")
PREFIXED_CALL_RE = re.compile(r"(?<![\w.>$:])((?:" + "|".join(PREFIXES) + r")\w*)\(")
TICK_RE = re.compile(r"`((?:" + "|".join(PREFIXES) + r")\w*)(?:\([^`]*\))?`")
C_EXT = (".c", ".h", ".cu", ".cuh", ".h.in", ".c.in")
DOCS = ("README.md", "proto/PROTOCOL.md", "CONTRIBUTING.md")
IDENT_RE = re.compile(r"[A-Za-z_]\w*")
# Where a system header may be; /opt/deps is where scripts/device-env.sh unpacks the Debian
# packages on the GPU host (libzmq's zmq.h is there, not in /usr/include).
SYSTEM_INCLUDE = ("/usr/include", "/usr/include/x86_64-linux-gnu", "/usr/include/aarch64-linux-gnu",
                  "/usr/local/include", "/opt/deps/usr/include",
                  "/opt/deps/usr/include/x86_64-linux-gnu")
PLACEHOLDER_RE = re.compile(r"[A-Z][A-Z0-9_]{2,}")


def is_doc(path: str) -> bool:
    return path in DOCS or (path.startswith("docs/") and path.endswith(".md"))


def tree_files(root: str) -> List[str]:
    """The tree's files, relative to root: what git tracks or would track (untracked files not
    ignored: files an engineer has just added or moved), else every file below root."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard"],
                             check=True, capture_output=True, text=True).stdout
        return [f for f in out.splitlines() if os.path.isfile(os.path.join(root, f))]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith((".", "build"))]
            found += [os.path.relpath(os.path.join(d, f), root) for f in files]
        return found


def kind(path: str) -> str:
    base = os.path.basename(path)
    if path.endswith(C_EXT):
        return "c"
    if base == "CMakeLists.txt" or path.endswith(".cmake"):
        return "hash"
    if path.endswith((".sh", ".bash")):
        return "hash"
    if path.endswith(".py"):
        return "py"
    return ""


def split_c(text: str) -> Tuple[List[Tuple[int, str]], str]:
    """C/CUDA text into its comments (line, text) and its code (comments blanked, strings
    kept: a name in a string, a dlsym'd symbol, is the code's)."""
    comments: List[Tuple[int, str]] = []
    code: List[str] = []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            comments.append((line, text[i:end]))
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            comments.append((line, text[i:end]))
        elif c in "\"'":
            end = i + 1
            while end < n and text[end] != c and text[end] != "\n":
                end += 2 if text[end] == "\\" else 1
            end = min(end + 1, n)
            code.append(text[i:end])
        else:
            end = i + 1
            code.append(c)
        line += text.count("\n", i, end)
        if text.startswith(("/*", "//"), i):
            code.append("\n" * text.count("\n", i, end))
        i = end
    return comments, "".join(code)


def split_hash(text: str) -> Tuple[List[Tuple[int, str]], str]:
    """Shell and CMake: `#` to the end of the line, outside quotes, is a comment; a here-document
    is data (code), whatever its lines look like."""
    comments: List[Tuple[int, str]] = []
    code: List[str] = []
    heredoc = ""
    for no, line in enumerate(text.splitlines(), 1):
        if heredoc:
            heredoc = "" if line.strip() == heredoc else heredoc
            code.append(line)
            continue
        m = re.search(r"<<-?\s*['\"]?(\w+)", line)
        heredoc = m.group(1) if m else ""
        quote = ""
        for i, c in enumerate(line):
            if quote:
                quote = "" if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c == "#" and (i == 0 or line[i - 1] in " \t;(") and not line.startswith("#!"):
                comments.append((no, line[i:]))
                line = line[:i]
                break
        code.append(line)
    return comments, "\n".join(code)


def split_py(text: str) -> Tuple[List[Tuple[int, str]], str]:
    """Python: comments and docstrings (a string that is a statement of its own)."""
    comments: List[Tuple[int, str]] = []
    code: List[str] = []
    prev = tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments.append((tok.start[0], tok.string))
            elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT,
                                                          tokenize.DEDENT, tokenize.NL):
                comments.append((tok.start[0], tok.string))
            else:
                code.append(tok.string)
            if tok.type not in (tokenize.COMMENT, tokenize.NL) or prev != tokenize.NEWLINE:
                prev = tok.type
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return split_hash(text)
    return comments, " ".join(code)


def comments_of(root: str, files: List[str]) -> Tuple[List[Tuple[str, int, str]], Set[str]]:
    """The comments and documents to check, and the identifiers the code holds."""
    texts: List[Tuple[str, int, str]] = []
    idents: Set[str] = set()
    splitters = {"c": split_c, "hash": split_hash, "py": split_py}
    for f in files:
        k = kind(f)
        if not k and not is_doc(f):
            continue
        try:
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        if is_doc(f):
            texts += [(f, no, line) for no, line in enumerate(text.splitlines(), 1)]
            continue
        comments, code = splitters[k](text)
        idents.update(IDENT_RE.findall(code))
        for start, body in comments:
            texts += [(f, start + i, line) for i, line in enumerate(body.splitlines())]
    return texts, idents


def names_in(line: str) -> Iterator[Tuple[str, str]]:
    """("file", name) and ("function", name) for each name on a line."""
    line = re.sub(r"\w+://\S+", " ", line)  # URLs
    for m in FILE_RE.finditer(line):
        yield "file", m.group(1)
    seen = set()
    for rx in (CALL_RE, PREFIXED_CALL_RE):
        for m in rx.finditer(line):
            if m.group(1) not in seen:
                seen.add(m.group(1))
                yield "function", m.group(1)
    for m in TICK_RE.finditer(line):
        if m.group(1) not in seen and not m.group(1).endswith("_"):
            seen.add(m.group(1))
            yield "name", m.group(1)


def file_exists(name: str, paths: Set[str], bases: Set[str]) -> bool:
    name = re.sub(r"^(\.{1,2}/)+", "", name)
    folders, base = name.split("/")[:-1], os.path.basename(name)
    if name in ALLOWED or base in ALLOWED:
        return True
    if any(re.fullmatch(r"[A-Z][A-Z0-9_]*", d) for d in folders):
        return True  # a place named by a placeholder (OUT_DIR/...): not in the tree
    if name.endswith(".h") and any(os.path.isfile(os.path.join(d, name)) for d in SYSTEM_INCLUDE):
        return True
    if not folders and (name in bases or name + ".in" in bases):
        return True
    if any(p == name or p.endswith("/" + name) or p == name + ".in"
           or p.endswith("/" + name + ".in") for p in paths):
        return True
    if base in bases or not PLACEHOLDER_RE.search(base):
        return False
    pattern = re.compile("(.*/)?" + ".+".join(re.escape(part) for part in
                                              PLACEHOLDER_RE.split(name)) + "$")
    return any(pattern.match(p) for p in paths)


def check(root: str) -> List[str]:
    files = tree_files(root)
    paths = set(files)
    bases = {os.path.basename(p) for p in files}
    stems = {b.split(".", 1)[0] for b in bases}
    texts, idents = comments_of(root, files)
    misses = []
    for f, no, line in texts:
        for what, name in names_in(line):
            if what == "file":
                ok = file_exists(name, paths, bases)
            else:
                ok = name in idents or name in ALLOWED or (what == "name" and name in stems)
            if ok:
                continue
            if what == "file":
                misses.append(f"{f}:{no}: file '{name}' is named but no such file in the tree")
            else:
                misses.append(f"{f}:{no}: function '{name}' is named but defined nowhere in "
                              f"the tree")
    return misses


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    misses = check(root)
    for m in misses:
        print(m, flush=True)
    if misses:
        print(f"FAIL: {len(misses)} names in comments or documents that the tree lacks (fix "
              f"the comment, or add a name that lives elsewhere to ALLOWED in {sys.argv[0]})",
              file=sys.stderr)
        return 1
    print("every file and function named in comments and documents exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
