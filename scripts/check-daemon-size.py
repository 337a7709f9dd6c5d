#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# check-daemon-size.py [ROOT]: STYLE.md's size rules for daemon/, as a test: no file over
# 1,000 lines and no function over 80. A function is a top-level brace block that opens on a line
# of its own (the project's style: `{` in column 0 after the signature); comments, strings and
# character literals are stripped before braces are counted. Prints each offender; exit 1 if any.
import os
import re
import sys

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 80
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
    bad = 0
    for folder, _, names in os.walk(os.path.join(root, 'daemon')):
        for n in sorted(names):
            if not n.endswith(('.c', '.h', '.cu')):
                continue
            path = os.path.join(folder, n)
            with open(path, errors='replace') as f:
                lines = f.read().split('\n')
            if len(lines) - 1 > MAX_FILE_LINES:
                print(f'{path}: {len(lines) - 1} lines (at most {MAX_FILE_LINES}: split it)')
                bad += 1
            for name, first, length in functions(lines):
                if length > MAX_FUNCTION_LINES:
                    print(f'{path}:{first}: {name}() is {length} lines (at most '
                          f'{MAX_FUNCTION_LINES})')
                    bad += 1
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
