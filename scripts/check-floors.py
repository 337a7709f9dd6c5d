#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# check-floors.py NAME DIR OBJECT...: the files of one library stand in floors, each calling and
# including only the floors below it (STYLE.md, "Tables and walls"; issue 35). Two graphs:
#   - calls: object A -> object B when A needs a symbol that B defines (`nm`: A's undefined
#     symbols against B's global ones; a call, or the address of a function or a table). This is
#     what the linker sees, so a call through a table of functions filled by the upper floor (as
#     libuv's and the daemon's transports do) is no edge, while a direct call always is;
#   - includes: header H -> header G when H includes "G" and G is in DIR.
# Either graph with a circle fails: each circle is printed with the symbols (or the #include
# lines) that close it, and the exit status is 1. Otherwise it prints the floors of the calls,
# the bottom first. Used by tests/test_walls.sh.
import os
import re
import subprocess
import sys


def symbols(obj):
    """(defined, undefined): obj's global symbols, and those it needs from elsewhere."""
    out = subprocess.run(['nm', '-P', obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind == 'U':
            undefined.add(name)
        elif kind.isupper() and kind not in 'AUW':  # T D R B C: global, defined here
            defined.add(name)
    return defined, undefined


def circles(nodes, edges):
    """The strongly connected components of more than one node (or with a self edge): Tarjan."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def floors(nodes, edges):
    """Each node's floor: 0 for one that calls no other, else one above the highest it calls."""
    level = {}

    def of(v):
        if v not in level:
            level[v] = 0
            level[v] = 1 + max((of(w) for w in edges.get(v, ())), default=-1)
        return level[v]

    for v in nodes:
        of(v)
    return level


def stem(obj):
    """tally_proto.c.o -> tally_proto.c (CMake's object names), else the file name."""
    name = os.path.basename(obj)
    return name[:-2] if name.endswith('.c.o') else name


def call_graph(objects):
    defined, needed = {}, {}
    for obj in objects:
        d, u = symbols(obj)
        defined[stem(obj)], needed[stem(obj)] = d, u
    owner = {}
    for f, names in defined.items():
        for s in names:
            owner[s] = f
    edges, why = {}, {}
    for f, names in needed.items():
        for s in sorted(names):
            g = owner.get(s)
            if g is not None and g != f:
                edges.setdefault(f, set()).add(g)
                why.setdefault((f, g), []).append(s)
    return set(defined), edges, why


INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def include_graph(folder):
    headers = sorted(n for n in os.listdir(folder) if n.endswith('.h'))
    edges = {}
    for h in headers:
        with open(os.path.join(folder, h), errors='replace') as f:
            for g in INCLUDE.findall(f.read()):
                if os.path.basename(g) in headers:
                    edges.setdefault(h, set()).add(os.path.basename(g))
    return set(headers), edges


def main():
    if len(sys.argv) < 4:
        print('usage: check-floors.py NAME DIR OBJECT...', file=sys.stderr)
        return 2
    name, folder, objects = sys.argv[1], sys.argv[2], sys.argv[3:]
    bad = 0
    nodes, edges, why = call_graph(objects)
    for comp in circles(nodes, edges):
        bad = 1
        print(f'FAIL: {name}: a circle of calls between {", ".join(comp)}:', file=sys.stderr)
        for f in comp:
            for g in sorted(edges.get(f, ())):
                if g in comp:
                    print(f'  {f} -> {g}: {", ".join(why[(f, g)][:6])}', file=sys.stderr)
    hnodes, hedges = include_graph(folder)
    for comp in circles(hnodes, hedges):
        bad = 1
        print(f'FAIL: {name}: a circle of #includes between {", ".join(comp)}', file=sys.stderr)
    if bad:
        return 1
    level = floors(nodes, edges)
    top = max(level.values(), default=0)
    shown = ' | '.join(', '.join(sorted(f for f in nodes if level[f] == k)) for k in range(top + 1))
    print(f'{name}: {len(nodes)} files, calls one way, floors from the bottom: {shown}; '
          f'{len(hnodes)} headers, no circle of includes')
    return 0


if __name__ == '__main__':
    sys.exit(main())
