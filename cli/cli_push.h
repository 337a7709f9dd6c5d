/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli_push.h — the streamed push behind filter, scan and hist: read the input chunk by chunk,
 * keep a window of chunks in flight through a libtally push, print each chunk's output as it
 * comes, and on Ctrl-C or a failure say exactly what was applied.
 */
#ifndef TALLY_CLI_PUSH_H
#define TALLY_CLI_PUSH_H

#include "cli_io.h"

/* What a data command was asked to do. */
typedef struct {
    const char *cmd;
    const char *in;
    const char *out;
    bool text;
    bool binary; /* --binary: send input that looks like text anyway */
    bool no_seq;
    bool resume;
    bool count_only; /* filter --count */
    bool have_range; /* hist --range */
    int progress;    /* --progress 1, --no-progress 0, else -1: on when both are terminals */
    size_t frame;    /* --frames: chunks hold whole frames of this many bytes */
    const char *chunk_arg; /* --chunk as given (said again when the chunk sent differs), or NULL */
    tally_run_opts_t opts;
    tally_req_t req;
} data_args_t;

/* Runs the push and prints (or writes to --out) its output. 0 or an exit status. */
int cli_push(cli_t *cli, data_args_t *a);

#endif
