#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_config_docs.sh TALLYD SOURCE_DIR: docs/service.md's configuration table and
# systemd/tallyd.conf.example are what the table of settings (daemon/base/td_settings.c)
# prints, so the documents cannot disagree with the code; to update them after changing a row:
#   tallyd --print-example-conf > systemd/tallyd.conf.example
#   tallyd --print-settings-md   (replaces the table under "Configuration" in docs/service.md)
# Also: the example file's values are valid (uncommented, it passes --check-config), and the
# hidden options work while --help leaves them out.
set -eu
tallyd=$1
src=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() {
    echo "FAIL: $*" >&2
    exit 1
}

"$tallyd" --print-settings-md >"$dir/table.md"
awk '/^\| section \| key \|/ { inside = 1 } inside && !/^\|/ { exit } inside' \
    "$src/docs/service.md" >"$dir/readme.md"
[ -s "$dir/readme.md" ] || fail "no '| section | key |' table in docs/service.md"
diff -u "$dir/readme.md" "$dir/table.md" >&2 ||
    fail "docs/service.md's settings table differs from tallyd --print-settings-md (+: the table's)"
echo "docs/service.md's table: $(($(wc -l <"$dir/table.md") - 2)) settings, as generated"

"$tallyd" --print-example-conf >"$dir/example.conf"
diff -u "$src/systemd/tallyd.conf.example" "$dir/example.conf" >&2 ||
    fail "systemd/tallyd.conf.example differs from tallyd --print-example-conf (+ is the table's)"
echo "tallyd.conf.example: as generated"

# A value that is not the key's default is marked as an example in its comment ("An example:"),
# so `#workers = 8` is not read as the default where the default is 0, the number of cores.
awk -F'|' 'NR == FNR {
        if ($2 ~ /`\[/) { section = $2; gsub(/[ `\[\]]/, "", section) }
        key = $3; sub(/ *\(repeatable\)/, "", key); gsub(/[ `]/, "", key)
        dflt = $6; if (match(dflt, /`[^`]*`/)) dflt = substr(dflt, RSTART + 1, RLENGTH - 2); else dflt = ""
        if (key != "" && key != "key") table[section "." key] = dflt
        next
    }
    /^\[/ { section = $0; gsub(/[\[\]]/, "", section); next }
    /^# / { text = $0; sub(/^# /, "", text); comment = comment " " text; next }
    /^#[a-z_]* = / {
        line = $0; sub(/^#/, "", line); key = line; sub(/ = .*/, "", key); value = line
        sub(/^[a-z_]* = /, "", value)
        if ((section "." key) in table && value != table[section "." key] &&
            comment !~ /An example:$/) {
            print "FAIL: [" section "] " key " = " value " is not the default (" \
                table[section "." key] ") and its comment does not say it is an example"
            bad = 1
        }
        comment = ""
    }
    END { exit bad }' "$dir/table.md" "$dir/example.conf" >&2 ||
    fail "tallyd.conf.example shows examples as if they were defaults"
echo "example values that are not defaults: marked"

# Every example value is one tallyd takes (user and group names are the host's: left out; so are
# the files the path keys name, which --check-config reads as the start would).
sed -n 's/^#\([a-z_]* = \)/\1/p; /^\[/p' "$dir/example.conf" |
    grep -v '^\(socket_group\|allow_uids\|allow_gids\) = ' |
    grep -v '^\(auth_file\|api_token_file\|curve_secret_key\|curve_clients_dir\) = ' |
    grep -v '^\(credentials\|nkey_seed\|tls_ca\|tls_cert\|tls_key\) = ' >"$dir/uncommented.conf"
[ "$(grep -c ' = ' "$dir/uncommented.conf")" -ge 30 ] || fail "too few keys in the example file"
"$tallyd" --config "$dir/uncommented.conf" --check-config >"$dir/check.out" 2>&1 ||
    { cat "$dir/check.out" >&2; fail "the example file's values do not pass --check-config"; }
echo "example values: $(grep -c ' = ' "$dir/uncommented.conf") keys pass --check-config"

# Hidden options: out of --help, still taken.
"$tallyd" --help >"$dir/help.txt"
grep -q -- '--max-inflight-per-peer N' "$dir/help.txt" || fail "--help lacks --max-inflight-per-peer"
if grep -q -- '--test-\|--gpu-spin-\|--print-' "$dir/help.txt"; then
    fail "--help shows a hidden option"
fi
"$tallyd" --config /dev/null --test-sim-gpus 2 --test-fault-every 3 --test-clock "$dir/clock" \
    --test-shm-deny-own-uid --gpu-spin-us 5 --gpu-spin-loop --check-config >/dev/null ||
    fail "a hidden option is refused"
if "$tallyd" --config /dev/null --gpu-spin-us 10001 --check-config 2>"$dir/err.txt"; then
    fail "--gpu-spin-us above its limit was taken"
fi
grep -q "invalid value '10001' for --gpu-spin-us" "$dir/err.txt" || fail "wrong message: $(cat "$dir/err.txt")"
echo "hidden options: taken, not in --help"
