#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# check-daemon-size.py [ROOT]: STYLE.md's size rules for daemon/, client/, cli/ and proto/ (issue
# 35 added the last three), as a test: no file over 1,000 lines and no function over 80. A function is a top-level brace block that opens on a line
# of its own (the project's style: `{` in column 0 after the signature); comments, strings and
# character literals are stripped before braces are counted. Prints each offender; exit 1 if any.
import os
import re
import sys

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 80
FOLDERS = ('daemon', 'client', 'cli', 'proto')
# Files still over a rule while their split waits, each with why: a note, not a failure. An entry
# for a file that passes fails, so that the list only ever shrinks.
PENDING = {}
STRIP = re.compile(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'|/\*.*?\*/|//.*')


def functions(lines):
    """(name, first line, length) of each top-level block that opens with '{' in column 0."""
    depth, start, name, in_comment = 0, None, None, False
    for i, raw in enumerate(lines):
        line = raw
        if in_comment:
            if '*/' not in line:
                continue
            line, in_comment = line[line.index('*/') + 2:], False
        line = STRIP.sub('""', line)
        if '/*' in line:
            line, in_comment = line[:line.index('/*')], True
        if depth == 0 and line.startswith('{'):
            start = i
            j = i - 1
            while j >= 0 and not re.search(r'\w+\s*\(', lines[j]):
                j -= 1
            m = re.search(r'(\w+)\s*\(', lines[j]) if j >= 0 else None
            name = m.group(1) if m else '?'
        depth += line.count('{') - line.count('}')
        if depth == 0 and start is not None:
            yield name, start + 1, i - start + 1
            start = None


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else '.'
    bad = files = 0
    for top in FOLDERS:
        for folder, _, names in sorted(os.walk(os.path.join(root, top))):
            for n in sorted(names):
                if n.endswith(('.c', '.h', '.cu')):
                    files += 1
                    bad += check(root, os.path.join(folder, n))
    print(f'{files} files of {", ".join(f + "/" for f in FOLDERS)} checked: {bad} over a rule')
    return 1 if bad else 0


def check(root, path):
    """The number of rules path breaks, each printed; a file in PENDING is a note instead."""
    with open(path, errors='replace') as f:
        lines = f.read().split('\n')
    found = []
    if len(lines) - 1 > MAX_FILE_LINES:
        found.append(f'{path}: {len(lines) - 1} lines (at most {MAX_FILE_LINES}: split it)')
    for name, first, length in functions(lines):
        if length > MAX_FUNCTION_LINES:
            found.append(f'{path}:{first}: {name}() is {length} lines (at most '
                         f'{MAX_FUNCTION_LINES})')
    pending = PENDING.get(os.path.relpath(path, root))
    if pending and found:
        print('\n'.join(f'note: {line} (pending: {pending})' for line in found))
        return 0
    if pending:
        print(f'{path}: passes now; take it out of PENDING in {os.path.basename(__file__)}')
        return 1
    if found:
        print('\n'.join(found))
    return len(found)


if __name__ == '__main__':
    sys.exit(main())
