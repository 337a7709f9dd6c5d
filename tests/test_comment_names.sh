#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_comment_names.sh SOURCE_DIR: every file and function that a comment or README.md,
# proto/PROTOCOL.md, CONTRIBUTING.md names exists (scripts/check-comment-names.py on the tree),
# and the check does find what is stale: on a small tree of its own it must report exactly the
# planted misses (a file gone, a path that moved, functions defined nowhere, in C, shell,
# Python and Markdown) and none of the names that are right (found by basename or path suffix,
# system headers, placeholders, another project's function that the code calls, file stems).
set -eu
src=$1
check=$src/scripts/check-comment-names.py
python3 "$check" "$src"

t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/daemon/core" "$t/tests/lib" "$t/scripts"
cat >"$t/daemon/core/td_a.c" <<'C'
/* td_a.c: td_b() is defined below, td_gone() nowhere; td_c(x) neither. tests/lib/h.c and
 * lib/h.c are there, daemon/td_a.c moved to daemon/core/ and td_missing.h never was; FILE.c,
 * OUT_DIR/x.md and stdio.h are not the tree's to have. `td_stem`, the `tally__` prefix and
 * zmq_msg_send() (called below) are right; frob() is not. */
#include <stdio.h>
int td_b(void) { return zmq_msg_send(0, 0, 0); } // "td_fake()" in a string is code, not a comment
const char *s = "td_fake()";
C
printf '/* SPDX */\nint th_h(void);\n' >"$t/tests/lib/h.c"
printf 'int td_stem;\n' >"$t/daemon/core/td_stem.h"
cat >"$t/scripts/x.sh" <<'SH'
#!/bin/sh
# x.sh: runs scripts/x.sh and scripts/gone.sh; th_h() exists, th_nope() does not
echo "# not a comment: td_absent()"
SH
cat >"$t/scripts/y.py" <<'PY'
"""y.py: tr_py() is defined here, tr_none() is not."""
def tr_py() -> None:  # x = "tr_py2()" is in a comment
    pass
PY
printf '# Tree\n\n`tally_nope` and `td_b` and td_a.c; see proto/PROTOCOL.md.\n' >"$t/README.md"
mkdir -p "$t/proto" && printf 'x\n' >"$t/proto/PROTOCOL.md"

if python3 "$check" "$t" >"$t/out" 2>"$t/err"; then
    echo "FAIL: the check passed a tree with stale names" >&2
    exit 1
fi
got=$(sed -n "s/^[^:]*:[0-9]*: [a-z]* '\([^']*\)'.*/\1/p" "$t/out" | LC_ALL=C sort |
    tr '\n' ' ')
want="daemon/td_a.c frob scripts/gone.sh tally_nope td_c td_gone td_missing.h th_nope tr_none"
want="$want tr_py2 "
if [ "$got" != "$want" ]; then
    echo "FAIL: reported: $got" >&2
    echo "      expected: $want" >&2
    cat "$t/out" >&2
    exit 1
fi
echo "the check reports exactly the planted stale names"
