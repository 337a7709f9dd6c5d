#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""coverage-table.py — the coverage table by folder, and the floors it must not go under.

    coverage-table.py SUMMARY.json FLOORS [--raise] [--margin M]
    coverage-table.py --check-history FLOORS OLD_FLOORS

SUMMARY.json is gcovr's --json-summary of a build (scripts/coverage.sh makes it). Each source
file counts toward its folder: the top folder (proto, kernels, client, cli), or for daemon/ its
floor (daemon/core, daemon/nats, ...; daemon itself for main.c and td_server.c). FLOORS is
tests/coverage-floors.txt: a line per folder, `folder lines branches` (percentages); a folder
under either of its floors fails the run (exit 1), and so does a folder with code that has no
floor (each folder is watched). --raise rewrites FLOORS with each floor raised to the measured
value less the margin (default 0.5 points: the threads' timing moves a few branches from run to
run), never lowered. --check-history fails when FLOORS lowers any floor of OLD_FLOORS (the
floors only go up) or drops a folder.
"""
import json
import math
import sys


def folder_of(path):
    parts = path.split("/")
    if parts[0] == "daemon":
        return "daemon/" + parts[1] if len(parts) > 2 else "daemon"
    return parts[0]


def read_floors(path):
    floors = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 3:
                sys.exit(f"{path}:{n}: want `folder lines branches`, got {line!r}")
            floors[fields[0]] = (float(fields[1]), float(fields[2]))
    return floors


def write_floors(path, floors):
    with open(path) as f:
        head = [l for l in f if l.startswith("#")]
    with open(path, "w") as f:
        f.writelines(head)
        for folder in sorted(floors):
            lines, branches = floors[folder]
            f.write(f"{folder:<16}{lines:5.1f}  {branches:5.1f}\n")


def measure(summary):
    totals = {}
    for f in json.load(open(summary))["files"]:
        t = totals.setdefault(folder_of(f["filename"]), [0, 0, 0, 0])
        t[0] += f["line_covered"]
        t[1] += f["line_total"]
        t[2] += f["branch_covered"]
        t[3] += f["branch_total"]
    return totals


def pct(a, b):
    return 100.0 * a / b if b else 100.0


def check_history(new_path, old_path):
    new, old = read_floors(new_path), read_floors(old_path)
    bad = []
    for folder, (lines, branches) in old.items():
        if folder not in new:
            bad.append(f"{folder}: its floor was removed")
        elif new[folder][0] < lines or new[folder][1] < branches:
            bad.append(f"{folder}: {new[folder][0]} / {new[folder][1]} < {lines} / {branches}")
    for b in bad:
        print(f"coverage floor lowered: {b}")
    return 1 if bad else 0


def main(argv):
    if len(argv) == 4 and argv[1] == "--check-history":
        return check_history(argv[2], argv[3])
    if len(argv) < 3:
        print(__doc__)
        return 2
    summary, floors_path = argv[1], argv[2]
    raise_floors = "--raise" in argv
    margin = float(argv[argv.index("--margin") + 1]) if "--margin" in argv else 0.5
    floors = read_floors(floors_path)
    totals = measure(summary)
    failed = []
    print(f"{'folder':<16}{'lines':>16}{'%':>7}{'branches':>16}{'%':>7}   floors")
    all_t = [0, 0, 0, 0]
    for folder in sorted(totals):
        t = totals[folder]
        all_t = [a + b for a, b in zip(all_t, t)]
        lp, bp = pct(t[0], t[1]), pct(t[2], t[3])
        fl = floors.get(folder)
        mark = ""
        if fl is None:
            mark = "  NO FLOOR"
            failed.append(folder)
        elif lp + 1e-9 < fl[0] or bp + 1e-9 < fl[1]:
            mark = "  UNDER"
            failed.append(folder)
        shown = f"{fl[0]:5.1f} / {fl[1]:5.1f}" if fl else "-"
        print(f"{folder:<16}{t[0]:>7} / {t[1]:<6}{lp:6.1f}{t[2]:>8} / {t[3]:<6}{bp:6.1f}   {shown}{mark}")
        if raise_floors:
            def up(old, measured):
                return max(old, math.floor((measured - margin) * 10) / 10)
            old = fl or (0.0, 0.0)
            floors[folder] = (up(old[0], lp), up(old[1], bp))
    print(f"{'all':<16}{all_t[0]:>7} / {all_t[1]:<6}{pct(all_t[0], all_t[1]):6.1f}"
          f"{all_t[2]:>8} / {all_t[3]:<6}{pct(all_t[2], all_t[3]):6.1f}")
    if raise_floors:
        write_floors(floors_path, floors)
        print(f"floors raised where the measure allows: {floors_path}")
        return 0
    if failed:
        print(f"under its floor (or without one): {' '.join(failed)} ({floors_path})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
