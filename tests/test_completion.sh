#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_completion.sh TALLY SOURCE_DIR: the bash completion (cli/tally.bash), sourced in bash
# with TALLY's folder first on PATH, completes what `tally --help` and `tally CMD --help` list
# (a path independent of `tally --complete`, which the completion reads): the command names
# (`tally q<TAB>` gives query), each command's options (`tally query --<TAB>`), the options
# before a command, none where an option's argument goes, and a command found after -e with a
# tcp://HOST:PORT endpoint. Skipped (77) without bash.
set -eu
tally=$1
src=$2
command -v bash >/dev/null || { echo "no bash: skipping"; exit 77; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-completion.XXXXXX")
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/bin"
ln -s "$tally" "$dir/bin/tally"

# The long options of a --help text, sorted, one a line.
help_options() {
    sed -n 's/^  \(-[a-zA-Z], \)\{0,1\}\(--[a-z0-9-]*\).*/\2/p' | sort -u
}
"$tally" --help | sed -n '/^Commands:/,/^$/s/^  \([a-z]*\) .*/\1/p' >"$dir/commands"
[ "$(wc -l <"$dir/commands")" -ge 10 ] || { echo "FAIL: too few commands in tally --help"; exit 1; }

cat >"$dir/complete.bash" <<BASH
set -u
PATH="$dir/bin:\$PATH"
. "$src/cli/tally.bash"
complete -p tally | grep -q -- '-F _tally' || { echo "FAIL: not registered for tally"; exit 1; }
# Completes the line up to its end; prints the candidates, one a line, sorted.
c() {
    COMP_LINE=\$1 COMP_POINT=\${#1}
    COMP_WORDS=(\$1) COMP_CWORD=\$((\${#COMP_WORDS[@]} - 1))
    [[ \$1 == *" " ]] && COMP_WORDS+=("") && COMP_CWORD=\${#COMP_WORDS[@]}-1
    _tally
    printf '%s\n' "\${COMPREPLY[@]}" | sed '/^\$/d' | sort
}
expect() { # LINE EXPECTED-FILE-OR-TEXT
    c "\$1" >"$dir/got"
    if [ -f "\$2" ]; then cp "\$2" "$dir/want"; else printf '%s\n' "\$2" | sed '/^\$/d' >"$dir/want"; fi
    diff -u "$dir/want" "$dir/got" >&2 || { echo "FAIL: tally completion of '\$1'"; exit 1; }
    echo "ok   '\$1' -> \$(tr '\n' ' ' <"$dir/got")"
}
expect "tally q" "query"
expect "tally -e tcp://127.0.0.1:5555 -t 100 q" "query"
expect "tally --endpoint=ipc:///run/x.sock que" "query"
expect "tally query --last " ""
expect "tally -e " ""
expect "tally hist --range 0 10 --stre" "--stream"
expect "tally hist --type u16 --range 0 " ""
expect "tally query --j" "--json"
# A data command's options are those its operation takes: minmax has no stream, no --shm.
expect "tally minmax --s" "--server-key"
expect "tally scan --s" "--seq-base
--server-key
--shm
--stream"
BASH
# Every command, and every command's options, as its --help lists them.
{ cat "$dir/commands"; echo help; } | sort >"$dir/all-commands"
echo 'expect "tally " "'"$dir/all-commands"'"' >>"$dir/complete.bash"
{ "$tally" --help | help_options; } >"$dir/top"
echo 'expect "tally --" "'"$dir/top"'"' >>"$dir/complete.bash"
while read -r cmd; do
    "$tally" "$cmd" --help | help_options >"$dir/opts-$cmd"
    [ -s "$dir/opts-$cmd" ] || { echo "FAIL: no options in tally $cmd --help"; exit 1; }
    echo 'expect "tally '"$cmd"' --" "'"$dir/opts-$cmd"'"' >>"$dir/complete.bash"
done <"$dir/commands"
bash "$dir/complete.bash"
# A tally whose --complete fails (an older one) completes nothing, without an error.
printf '#!/bin/sh\nexit 2\n' >"$dir/bin/tally-old"
chmod +x "$dir/bin/tally-old"
out=$(bash -c ". '$src/cli/tally.bash'; PATH='$dir/bin':\$PATH; COMP_LINE='tally-old q' COMP_POINT=11; \
  COMP_WORDS=(tally-old q) COMP_CWORD=1; _tally; echo \"[\${COMPREPLY[*]}]\"" 2>&1)
[ "$out" = "[]" ] || { echo "FAIL: a failing --complete gave '$out'"; exit 1; }
echo "completion ok"
