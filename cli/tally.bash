# SPDX-License-Identifier: Apache-2.0
# bash completion for tally (installed as share/bash-completion/completions/tally).
#
# The words come from the tally being completed: `tally --complete` prints its commands and each
# command's options from the same tables it parses them with (cli/cli_doc.c), so this file never
# lists an option itself. Completes the command name, then options: those before the command
# (common and top-level), or the command's own and the common ones after it. Where an option
# takes an argument (a file, a number), bash's default (file names) applies.

_tally() {
    local table line cmd="" cur="" i word opts want words
    COMPREPLY=()
    # The words up to the cursor, split at blanks only: COMP_WORDS splits at ':' and '=' too,
    # which would cut -e tcp://HOST:PORT into pieces.
    read -r -a words <<<"${COMP_LINE:0:COMP_POINT}"
    [[ ${COMP_LINE:COMP_POINT-1:1} == [[:blank:]] ]] && words+=("")
    ((${#words[@]} > 1)) || return 0
    cur=${words[-1]}
    table=$("${words[0]}" --complete 2>/dev/null) || return 0

    # The command, skipping options and their arguments (an option ends in one '=' per
    # argument in the table: --range== takes two).
    for ((i = 1; i < ${#words[@]} - 1; i++)); do
        word=${words[i]}
        if [[ $word == -* ]]; then
            [[ $word == *=* ]] && continue # --opt=value
            line=$(_tally_line "$table" "${cmd:--}")
            want=$(_tally_args "$line" "$word")
            if ((want > 0 && i + want >= ${#words[@]} - 1)); then
                return 0 # the word at the cursor is this option's argument: file names
            fi
            ((i += want))
        elif [[ -z $cmd ]]; then
            cmd=$word
        fi
    done

    if [[ $cur == -* ]]; then
        line=$(_tally_line "$table" "${cmd:--}")
        opts=${line#* }
        opts=${opts//=/}
        mapfile -t COMPREPLY < <(compgen -W "$opts" -- "$cur")
    elif [[ -z $cmd ]]; then
        line=$(_tally_line "$table" commands)
        mapfile -t COMPREPLY < <(compgen -W "${line#* }" -- "$cur")
    fi
    return 0
}

# The table's line for scope $2 ("commands", "-" for before the command, or a command).
_tally_line() {
    local line
    while IFS= read -r line; do
        if [[ ${line%% *} == "$2" ]]; then
            printf '%s\n' "$line"
            return
        fi
    done <<<"$1"
}

# How many arguments option $2 takes in table line $1 (0 when it takes none or is unknown).
_tally_args() {
    local opt rest
    for opt in ${1#* }; do
        rest=${opt%%=*}
        if [[ $rest == "$2" ]]; then
            rest=${opt#"$rest"}
            printf '%s\n' "${#rest}"
            return
        fi
    done
    printf '0\n'
}

complete -o default -F _tally tally
