/*
 * cli_io.h — input and output of the data commands (filter, scan, hist).
 */
#ifndef TALLY_CLI_IO_H
#define TALLY_CLI_IO_H

#include "cli.h"

/* The whole input in memory: a regular file is mapped, anything else read into a buffer. */
typedef struct {
    const uint8_t *data;
    size_t len;
    void *map;
    tally_buf_t buf;
} input_t;

int read_input(const char *path, input_t *in);
void input_free(input_t *in);
/* Turns whitespace-separated decimal integers into little-endian elements of `dtype`,
 * naming the first token that is not an integer of that type. 0 or an exit status. */
int parse_text(const input_t *text, tally_dtype_t dtype, tally_buf_t *out);
/* Prints n little-endian integers, one per line: u8 (size 1), int32 (4) or int64 (8). */
void print_values(const uint8_t *p, size_t n, size_t size);
int write_binary(const char *path, const tally_buf_t *buf);

#endif
