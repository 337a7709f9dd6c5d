#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_man.sh MAN_DIR TALLYD TALLY: the man pages the build made (man/) render without a
# warning (`man --warnings -l`), and hold what the programs say they take:
#   - tallyd.conf(5): exactly the [section] key pairs of the table of settings (docs/service.md's
#     table, `tallyd --print-settings-md`), each under its section;
#   - tallyd(8): exactly the options `tallyd --help` lists;
#   - tally(1): every command `tally --help` lists, named in its DESCRIPTION and as a
#     subsection, and every option of each (`tally CMD --help`), with the common options;
#   - each page's generated part is what its program prints now (--print-commands-scd,
#     --print-options-scd, --print-settings-scd): a page built by an older binary is not.
set -eu
mandir=$1
tallyd=$2
tally=$3
command -v man >/dev/null || { echo "no man (Debian: man-db): skipping"; exit 77; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-man.XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() {
    echo "FAIL: $*" >&2
    exit 1
}

for page in tally.1 tallyd.8 tallyd.conf.5; do
    [ -s "$mandir/$page" ] || fail "no $mandir/$page"
    MANWIDTH=100 man --warnings -l -P cat "$mandir/$page" >"$dir/$page.txt" 2>"$dir/$page.err" ||
        fail "man -l $page failed: $(cat "$dir/$page.err")"
    [ ! -s "$dir/$page.err" ] || fail "$page renders with warnings: $(cat "$dir/$page.err")"
    name=${page%.*}
    head -1 "$dir/$page.txt" | grep -q "^$name(${page##*.})" || fail "$page: no $name(${page##*.}) title"
    for section in NAME SYNOPSIS DESCRIPTION "SEE ALSO"; do
        grep -qx "$section" "$dir/$page.txt" || fail "$page has no $section section"
    done
    ! grep -q '@GENERATED@' "$dir/$page.txt" || fail "$page still has its @GENERATED@ line"
    echo "ok   $page: $(wc -l <"$dir/$page.txt") lines, no warnings"
done

# Each page's assembled source (PAGE.scd beside the page, man/page.cmake) holds, whole, what its
# program prints now.
holds() { # FILE PIECE: FILE contains PIECE's text, newlines included
    awk -v RS='\001' 'NR == FNR { piece = $0; next } { exit index($0, piece) == 0 }' "$2" "$1"
}
current() { # PAGE PROGRAM OPTION
    "$2" "$3" >"$dir/generated" || fail "$2 $3 failed"
    [ -s "$dir/generated" ] || fail "$2 $3 printed nothing"
    holds "$mandir/$1.scd" "$dir/generated" ||
        fail "$1 is not what $(basename "$2") $3 prints now (rebuild the page)"
    echo "ok   $1: its generated part is what $(basename "$2") $3 prints"
}
current tally.1 "$tally" --print-commands-scd
current tallyd.8 "$tallyd" --print-options-scd
current tallyd.conf.5 "$tallyd" --print-settings-scd

# tallyd.conf(5): the keys, each under its section heading ("   [server]", "       key = ...").
"$tallyd" --print-settings-md |
    awk -F'|' 'NR > 2 { s = $2; k = $3; gsub(/[ `\[\]]/, "", s); gsub(/ \(repeatable\)/, "", k);
                        gsub(/[ `]/, "", k); if (s != "") sec = s; print sec, k }' |
    sort >"$dir/settings"
[ "$(wc -l <"$dir/settings")" -ge 30 ] || fail "too few settings in --print-settings-md"
awk '/^   \[[a-z]+\]$/ { gsub(/[][ ]/, ""); sec = $0; next }
     /^[A-Z]/ { sec = "" }
     sec != "" && /^       [a-z_]+ = / { print sec, $1 }' "$dir/tallyd.conf.5.txt" |
    sort >"$dir/conf-keys"
diff -u "$dir/settings" "$dir/conf-keys" >&2 ||
    fail "tallyd.conf(5)'s keys differ from the table of settings (+ is the page's)"
echo "ok   tallyd.conf(5): all $(wc -l <"$dir/settings") settings, each in its section"

# tallyd(8): the options of --help. An option's entry in --help starts a line with two spaces;
# in a page, it is a line at the paragraph's indentation (7) followed by its text (11).
options() { sed -n 's/^ *\(-[a-zA-Z], \)\{0,1\}\(--[a-z0-9-]*\).*/\2/p' | sort -u; }
help_options() { grep '^  -\|^      --' | options; }
page_options() { awk '/^           [^ ]/ && prev ~ /^       -/ { print prev } { prev = $0 }' | options; }
"$tallyd" --help | help_options >"$dir/tallyd-help"
sed -n '/^OPTIONS$/,/^[A-Z]/p' "$dir/tallyd.8.txt" | page_options >"$dir/tallyd-man"
diff -u "$dir/tallyd-help" "$dir/tallyd-man" >&2 ||
    fail "tallyd(8)'s options differ from tallyd --help (+ is the page's)"
echo "ok   tallyd(8): all $(wc -l <"$dir/tallyd-help") options of --help"

# tally(1): each command a subsection under COMMANDS, with its options.
"$tally" --help | sed -n '/^Commands:/,/^$/s/^  \([a-z]*\) .*/\1/p' >"$dir/commands"
[ "$(wc -l <"$dir/commands")" -ge 10 ] || fail "too few commands in tally --help"
while read -r cmd; do
    sed -n "/^   $cmd\$/,/^   [a-z]*\$/p" "$dir/tally.1.txt" >"$dir/cmd.txt"
    [ -s "$dir/cmd.txt" ] || fail "tally(1) has no subsection for $cmd"
    grep -q "^       tally $cmd" "$dir/cmd.txt" || fail "tally(1): $cmd without its usage line"
    # (in the source: the rendered page hyphenates words at its line ends)
    sed -n '/^# DESCRIPTION$/,/^# [A-Z]/p' "$mandir/tally.1.scd" | grep -qF "*$cmd*" ||
        fail "tally(1)'s DESCRIPTION does not name $cmd"
    "$tally" "$cmd" --help | sed '/^Common options/,$d' | help_options >"$dir/want"
    page_options <"$dir/cmd.txt" >"$dir/got"
    diff -u "$dir/want" "$dir/got" >&2 || fail "tally(1): $cmd's options differ from its --help"
done <"$dir/commands"
"$tally" --help | help_options >"$dir/want"
sed -n '/^OPTIONS$/,/^COMMANDS$/p' "$dir/tally.1.txt" | page_options >"$dir/got"
diff -u "$dir/want" "$dir/got" >&2 || fail "tally(1)'s OPTIONS differ from tally --help"
echo "ok   tally(1): $(wc -l <"$dir/commands") commands with their options, and the common ones"
