#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""mutants.py — the list of mutants (tests/mutants.txt) for scripts/mutants.sh.

    mutants.py check LIST SRC [BUILD]     every mutant well formed and its line found exactly
                                          once in SRC; with BUILD, its kill regex names a test
    mutants.py select LIST SEED N         the names of N mutants picked by SEED (all when N is 0),
                                          in the list's order
    mutants.py show LIST NAME FIELD       one field of one mutant (file, find, into, kill, why)
    mutants.py apply LIST NAME SRC        mutate SRC's copy of the mutant's file in place

A mutant is a block of the list: `[name]`, then `file:`, `find:`, `into:`, `kill:` and `why:`
lines (blank lines and `#` comments between blocks). `find` is a piece of the code's own line: it
must occur in exactly one line of the file, once; `into` replaces it (empty: deleted). `kill` is
the CTest regex (ctest -R) of the tests that must fail with the mutant in; `why` one line on what
the mutant breaks. A `find` that no longer matches exactly one line fails `check`: the list is
kept with the code (docs/testing.md, "Adding a mutant").
"""
import hashlib
import os
import re
import subprocess
import sys

FIELDS = ("file", "find", "into", "kill", "why")


def parse(path):
    mutants, cur, errors = [], None, []
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            m = re.fullmatch(r"\[([A-Za-z0-9_.-]+)\]\s*", line)
            if m:
                cur = {"name": m.group(1), "at": n}
                mutants.append(cur)
                continue
            m = re.fullmatch(r"(\w+):(?: (.*))?", line)
            if not m or cur is None or m.group(1) not in FIELDS:
                errors.append(f"{path}:{n}: not `[name]` nor one of {', '.join(FIELDS)}: {line!r}")
                continue
            if m.group(1) in cur:
                errors.append(f"{path}:{n}: {m.group(1)} twice in [{cur['name']}]")
            cur[m.group(1)] = (m.group(2) or "").strip() if m.group(1) != "into" else (m.group(2) or "")
    names = [m["name"] for m in mutants]
    for m in mutants:
        for field in FIELDS:
            if field not in m or (field != "into" and not m[field]):
                errors.append(f"{path}:{m['at']}: [{m['name']}] has no {field}")
        if names.count(m["name"]) > 1:
            errors.append(f"{path}:{m['at']}: [{m['name']}] named twice")
        if m.get("find") == m.get("into"):
            errors.append(f"{path}:{m['at']}: [{m['name']}] changes nothing")
    return mutants, errors


def locate(m, src):
    """The index of the one line of m's file holding m's find, or an error message."""
    path = os.path.join(src, m["file"])
    try:
        lines = open(path).read().split("\n")
    except OSError as e:
        return None, None, f"[{m['name']}] {m['file']}: {e.strerror}"
    hits = [i for i, l in enumerate(lines) if m["find"] in l]
    if len(hits) != 1 or lines[hits[0]].count(m["find"]) != 1:
        where = ", ".join(str(i + 1) for i in hits[:5]) or "none"
        return None, None, (f"[{m['name']}] {m['file']}: `{m['find']}` must be in exactly one "
                            f"line, once; lines: {where} (edit tests/mutants.txt with the code)")
    return lines, hits[0], None


def tests_of(build, regex):
    out = subprocess.run(["ctest", "-N", "-R", regex], cwd=build, capture_output=True, text=True)
    return re.findall(r"Test\s+#\d+: (\S+)", out.stdout)


def check(listp, src, build=None):
    mutants, errors = parse(listp)
    for m in mutants:
        if "find" not in m or "file" not in m:
            continue
        _, _, err = locate(m, src)
        if err:
            errors.append(err)
        if build and m.get("kill") and not tests_of(build, m["kill"]):
            errors.append(f"[{m['name']}] kill: `{m['kill']}` names no CTest test in {build}")
    for e in errors:
        print(e)
    print(f"{len(mutants)} mutants, {len(errors)} problems")
    return 1 if errors or not mutants else 0


def select(listp, seed, n):
    mutants, errors = parse(listp)
    if errors:
        return check(listp, ".")
    names = [m["name"] for m in mutants]
    if n <= 0 or n >= len(names):
        chosen = names
    else:
        key = lambda name: hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()
        chosen = set(sorted(names, key=key)[:n])
        chosen = [x for x in names if x in chosen]
    print("\n".join(chosen))
    return 0


def find(listp, name):
    mutants, errors = parse(listp)
    for m in mutants:
        if m["name"] == name:
            return m
    sys.exit(f"no mutant [{name}] in {listp}")


def apply(listp, name, src):
    m = find(listp, name)
    lines, i, err = locate(m, src)
    if err:
        print(err)
        return 1
    lines[i] = lines[i].replace(m["find"], m["into"], 1)
    with open(os.path.join(src, m["file"]), "w") as f:
        f.write("\n".join(lines))
    print(f"{m['file']}:{i + 1}: {lines[i].strip()}")
    return 0


def main(a):
    if len(a) >= 4 and a[1] == "check":
        return check(a[2], a[3], a[4] if len(a) > 4 else None)
    if len(a) == 5 and a[1] == "select":
        return select(a[2], a[3], int(a[4]))
    if len(a) == 5 and a[1] == "show":
        print(find(a[2], a[3]).get(a[4], ""))
        return 0
    if len(a) == 5 and a[1] == "apply":
        return apply(a[2], a[3], a[4])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
