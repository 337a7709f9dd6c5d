/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli_io.h — input and output of the data commands (filter, scan, hist), streamed: the input
 * is read chunk by chunk (binary elements, whole frames, or --text integers parsed as they
 * come), so memory stays bounded whatever the input's length, and results are printed as they
 * arrive.
 */
#ifndef TALLY_CLI_IO_H
#define TALLY_CLI_IO_H

#include <signal.h>

#include "cli.h"

/* Set by SIGINT/SIGTERM (cli_catch_interrupts): stop reading, finish what is in flight. */
extern volatile sig_atomic_t cli_interrupted;
void cli_catch_interrupts(void);

/* A file or stdin being read. */
typedef struct {
    int fd;
    const char *name; /* for messages: the path, or "stdin" */
    uint64_t size;    /* a regular file's size (binary input), 0 when not known */
    bool text;        /* --text: decimal integers */
    bool checked;     /* binary: the does-it-look-like-text check was done */
    bool force_binary;
    tally_dtype_t dtype;
    size_t unit;      /* binary: bytes that must not be split (an element or a --frames frame) */
    bool live;        /* a pipe or terminal: send what came when the producer pauses */
    uint8_t *pending; /* binary: the start of a unit that a pause cut, for the next fill */
    size_t pending_len;
    size_t trailing; /* bytes at the end of the input short of a whole unit: not sent */
    uint64_t bytes_read;
    /* --text: a window of the raw text, [pos, len) not parsed yet. */
    char *raw;
    size_t pos, len, cap;
    bool eof;
    uint64_t token;      /* tokens parsed, for messages */
    uint64_t line;       /* the line at raw[pos] (from 1), for messages */
    uint64_t line_start; /* the input offset where that line starts */
    uint64_t raw_offset; /* the input offset of raw[0] */
} reader_t;

/* Opens path (NULL or "-": stdin). Binary input from a regular file is checked here, before
 * anything is sent: that it does not look like text, and that its size is a whole number of
 * elements (or --frames frames). 0 or an exit status (after reporting). */
int reader_open(reader_t *r, const char *path, bool text, tally_dtype_t dtype, size_t frame,
                bool force_binary);
void reader_close(reader_t *r);
/* Fills buf with up to cap bytes of input elements (cap a multiple of r->unit) and sets *len;
 * *len < cap at the end of the input, on Ctrl-C, or when a live producer pauses (then what
 * came is sent rather than held). 0 or an exit status. */
int reader_fill(reader_t *r, uint8_t *buf, size_t cap, size_t *len);
/* The input has ended and everything read was handed out (but r->trailing bytes, too few for
 * a whole element, frame or pixel, which reader_tail_error reports). */
bool reader_done(const reader_t *r);
/* After the input ended: 0, or EXIT_USAGE after saying that its last r->trailing bytes were
 * too few for a unit and were not sent (a pipe: what came before them was). */
int reader_tail_error(const reader_t *r);

/* Prints n little-endian integers, one per line: u8 (size 1), int32 (4) or int64 (8). */
void print_values(FILE *f, const uint8_t *p, size_t n, size_t size);

/* The progress line on a terminal: bytes, rate, and ETA when the size is known. */
typedef struct {
    bool on;
    uint64_t total;
    int64_t start_ms, last_ms;
} progress_t;

void progress_start(progress_t *p, bool on, uint64_t total);
void progress_update(progress_t *p, uint64_t bytes);
void progress_end(progress_t *p);

#endif
