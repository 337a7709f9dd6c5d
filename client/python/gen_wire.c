/* SPDX-License-Identifier: Apache-2.0 */
/*
 * gen_wire.c — prints client/python/tally/_wire.py, the C facts the Python binding uses: the
 * numbers it sends and checks (opcodes, dtypes, predicates, flags, statuses, seq modes, limits,
 * the default endpoint) and the layout (sizeof, and each field's offsetof and sizeof) of every
 * C struct it mirrors with ctypes.
 *
 * Why a program and not a parser: every value and offset comes from the compiler reading the
 * installed headers (tally.h and tally_wire.h, which the build copies from tally_proto.h's
 * PUBLIC sections), so no macro expression or padding rule can be misread, and a name that no
 * longer exists in the headers stops this file compiling. The fields are listed by hand: a field
 * added to one of these structs goes here and into the ctypes mirror (one that fits into
 * padding moves no offset and no size, so nothing else would notice it).
 *
 * The output is committed (pip installs ./client/python without running CMake); tally/__init__.py
 * checks its ctypes structs against LAYOUT at import, and tests/test_python_wire.sh fails when
 * the committed file differs from what this program prints. Built with the client (CMake target
 * tally_gen_wire), not installed.
 */
#include "tally.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* ---- Constants --------------------------------------------------------------------------- */

/* A C name and its value; the Python name is the C name without its prefix. */
typedef struct {
    const char *name;
    long long value;
} constant_t;
/* clang-format off */
#define CONSTANT(macro) {#macro, (long long)(macro)}
/* clang-format on */
#define COUNT_OF(array) (sizeof(array) / sizeof((array)[0]))

static const constant_t ops[] = {
    CONSTANT(TALLY_OP_PING),   CONSTANT(TALLY_OP_INFO),    CONSTANT(TALLY_OP_FILTER),
    CONSTANT(TALLY_OP_SCAN),   CONSTANT(TALLY_OP_HIST),    CONSTANT(TALLY_OP_QUERY),
    CONSTANT(TALLY_OP_RESET),  CONSTANT(TALLY_OP_STREAMS), CONSTANT(TALLY_OP_STATS),
    CONSTANT(TALLY_OP_DELETE),
};

static const constant_t preds[] = {
    CONSTANT(TALLY_PRED_GT),      CONSTANT(TALLY_PRED_GE), CONSTANT(TALLY_PRED_LT),
    CONSTANT(TALLY_PRED_LE),      CONSTANT(TALLY_PRED_EQ), CONSTANT(TALLY_PRED_NE),
    CONSTANT(TALLY_PRED_BETWEEN),
};

/* Every dtype, named as tally_dtype_name names it ("i32", "rgb8", ...). */
static const constant_t dtypes[] = {
    CONSTANT(TALLY_DTYPE_NONE), CONSTANT(TALLY_DTYPE_I32),  CONSTANT(TALLY_DTYPE_U8),
    CONSTANT(TALLY_DTYPE_I64),  CONSTANT(TALLY_DTYPE_U64),  CONSTANT(TALLY_DTYPE_TEXT),
    CONSTANT(TALLY_DTYPE_U16),  CONSTANT(TALLY_DTYPE_RGB8), CONSTANT(TALLY_DTYPE_RGBA8),
};

static const constant_t numbers[] = {
    CONSTANT(TALLY_DTYPE_I32),
    CONSTANT(TALLY_DTYPE_U8),
    CONSTANT(TALLY_FLAG_SCAN_EXCLUSIVE),
    CONSTANT(TALLY_FLAG_SCAN_OUT_I32),
    CONSTANT(TALLY_FLAG_FILTER_STABLE),
    CONSTANT(TALLY_E_UNKNOWN_STREAM),
    CONSTANT(TALLY_E_WINDOW),
    CONSTANT(TALLY_E_TIMEOUT),
    CONSTANT(TALLY_E_REPLY),
    CONSTANT(TALLY_E_ARG),
    CONSTANT(TALLY_E_IO),
    CONSTANT(TALLY_RUN_SEQ_OFF),
    CONSTANT(TALLY_RUN_SEQ_APPEND),
    CONSTANT(TALLY_RUN_SEQ_RESUME),
    CONSTANT(TALLY_HIST_BINS),
    CONSTANT(TALLY_HIST_VALUES_MAX),
    CONSTANT(TALLY_HIST_CHANNELS_MAX),
    CONSTANT(TALLY_WINDOW_MS_MAX),
    CONSTANT(TALLY_PUB_UPDATE),
    CONSTANT(TALLY_PUB_DELETED),
    CONSTANT(TALLY_STREAM_NAME_MAX),
    CONSTANT(TALLY_ERROR_MESSAGE_MAX),
    CONSTANT(TALLY_DEFAULT_TIMEOUT_MS),
};

/* The Python name of a C constant: `name` after `prefix`, lowercased or not. */
static void print_name(const char *name, const char *prefix, int lower)
{
    for (const char *c = name + strlen(prefix); *c; c++)
        putchar(lower && *c >= 'A' && *c <= 'Z' ? *c - 'A' + 'a' : *c);
}

/* `NAME = {"member": value, ...}`, the members named in lowercase without `prefix`. */
static void print_dict(const char *name, const constant_t *table, size_t count, const char *prefix)
{
    printf("%s = {\n", name);
    for (size_t i = 0; i < count; i++) {
        printf("    \"");
        print_name(table[i].name, prefix, 1);
        printf("\": %lld,\n", table[i].value);
    }
    printf("}\n");
}

/* A C string as a Python string literal (the endpoint: printable ASCII). */
static void print_string(const char *name, const char *value)
{
    printf("%s = \"", name);
    for (const char *c = value; *c; c++) {
        if (*c == '"' || *c == '\\')
            putchar('\\');
        putchar(*c);
    }
    printf("\"\n");
}

static void print_constants(void)
{
    print_dict("OP", ops, COUNT_OF(ops), "TALLY_OP_");
    print_dict("PRED", preds, COUNT_OF(preds), "TALLY_PRED_");
    print_dict("DTYPE", dtypes, COUNT_OF(dtypes), "TALLY_DTYPE_");
    for (size_t i = 0; i < COUNT_OF(numbers); i++) {
        /* TALLY_RUN_SEQ_OFF is SEQ_OFF in Python: "RUN_" says nothing there. */
        const char *prefix = strncmp(numbers[i].name, "TALLY_RUN_", 10) ? "TALLY_" : "TALLY_RUN_";
        print_name(numbers[i].name, prefix, 0);
        printf(" = %lld\n", numbers[i].value);
    }
    print_string("DEFAULT_ENDPOINT", TALLY_DEFAULT_ENDPOINT);
}

/* ---- Struct layouts ---------------------------------------------------------------------- */

typedef struct {
    const char *name;
    size_t offset, size;
} field_t;
/* clang-format off */
#define FIELD(type, member) {#member, offsetof(type, member), sizeof(((type *)0)->member)}
/* clang-format on */

typedef struct {
    const char *name;
    size_t size;
    const field_t *fields;
    size_t count;
} layout_t;
/* clang-format off */
#define LAYOUT(type, fields) {#type, sizeof(type), fields, COUNT_OF(fields)}
/* clang-format on */

static const field_t req_fields[] = {
    FIELD(tally_req_t, version),    FIELD(tally_req_t, opcode),     FIELD(tally_req_t, dtype),
    FIELD(tally_req_t, flags),      FIELD(tally_req_t, request_id), FIELD(tally_req_t, pred),
    FIELD(tally_req_t, lo),         FIELD(tally_req_t, hi),         FIELD(tally_req_t, seq),
    FIELD(tally_req_t, stream_len), FIELD(tally_req_t, stream),
};

static const field_t rep_fields[] = {
    FIELD(tally_rep_t, version), FIELD(tally_rep_t, opcode),     FIELD(tally_rep_t, dtype),
    FIELD(tally_rep_t, flags),   FIELD(tally_rep_t, request_id), FIELD(tally_rep_t, status),
    FIELD(tally_rep_t, count),   FIELD(tally_rep_t, aux0),       FIELD(tally_rep_t, aux1),
};

static const field_t reply_fields[] = {
    FIELD(tally_reply_t, rep),   FIELD(tally_reply_t, payload), FIELD(tally_reply_t, len),
    FIELD(tally_reply_t, error), FIELD(tally_reply_t, msg_),
};

static const field_t stream_info_fields[] = {
    FIELD(tally_stream_info_t, batches),        FIELD(tally_stream_info_t, elements),
    FIELD(tally_stream_info_t, bytes),          FIELD(tally_stream_info_t, filter_seen),
    FIELD(tally_stream_info_t, filter_kept),    FIELD(tally_stream_info_t, scan_carry),
    FIELD(tally_stream_info_t, scan_elements),  FIELD(tally_stream_info_t, hist_dtype),
    FIELD(tally_stream_info_t, hist_lo),        FIELD(tally_stream_info_t, hist_hi),
    FIELD(tally_stream_info_t, hist_underflow), FIELD(tally_stream_info_t, hist_overflow),
    FIELD(tally_stream_info_t, hist_total),     FIELD(tally_stream_info_t, last_seq),
    FIELD(tally_stream_info_t, bins),
};

static const field_t run_opts_fields[] = {
    FIELD(tally_run_opts_t, chunk_bytes), FIELD(tally_run_opts_t, window),
    FIELD(tally_run_opts_t, shm),         FIELD(tally_run_opts_t, seq),
    FIELD(tally_run_opts_t, seq_base),    FIELD(tally_run_opts_t, total_bytes),
};

static const field_t run_result_fields[] = {
    FIELD(tally_run_result_t, chunks),       FIELD(tally_run_result_t, elements),
    FIELD(tally_run_result_t, count),        FIELD(tally_run_result_t, seen),
    FIELD(tally_run_result_t, carry),        FIELD(tally_run_result_t, hist_total),
    FIELD(tally_run_result_t, input_chunks), FIELD(tally_run_result_t, seq_base),
    FIELD(tally_run_result_t, applied),      FIELD(tally_run_result_t, skipped),
    FIELD(tally_run_result_t, last_seq),     FIELD(tally_run_result_t, applied_known),
    FIELD(tally_run_result_t, bytes),        FIELD(tally_run_result_t, applied_bytes),
    FIELD(tally_run_result_t, status),       FIELD(tally_run_result_t, error),
};

static const field_t buf_fields[] = {
    FIELD(tally_buf_t, data),
    FIELD(tally_buf_t, len),
    FIELD(tally_buf_t, cap),
};

static const field_t pub_fields[] = {
    FIELD(tally_pub_t, kind),
    FIELD(tally_pub_t, pub_seq),
    FIELD(tally_pub_t, time_ms),
    FIELD(tally_pub_t, interval_ms),
};

static const field_t pub_msg_fields[] = {
    FIELD(tally_pub_msg_t, pub),
    FIELD(tally_pub_msg_t, stream),
    FIELD(tally_pub_msg_t, info),
};

static const field_t hist_fields[] = {
    FIELD(tally_hist_t, dtype), FIELD(tally_hist_t, lo),        FIELD(tally_hist_t, hi),
    FIELD(tally_hist_t, bins),  FIELD(tally_hist_t, underflow), FIELD(tally_hist_t, overflow),
};

static const field_t quantile_fields[] = {
    FIELD(tally_quantile_t, value),
    FIELD(tally_quantile_t, side),
};

static const field_t summary_fields[] = {
    FIELD(tally_hist_summary_t, count),     FIELD(tally_hist_summary_t, in_range),
    FIELD(tally_hist_summary_t, underflow), FIELD(tally_hist_summary_t, overflow),
    FIELD(tally_hist_summary_t, mean),      FIELD(tally_hist_summary_t, min_bin),
    FIELD(tally_hist_summary_t, max_bin),   FIELD(tally_hist_summary_t, p50),
    FIELD(tally_hist_summary_t, p90),       FIELD(tally_hist_summary_t, p99),
};

static const field_t curve_keys_fields[] = {
    FIELD(tally_curve_keys_t, server_public),
    FIELD(tally_curve_keys_t, client_public),
    FIELD(tally_curve_keys_t, client_secret),
};

static const layout_t layouts[] = {
    LAYOUT(tally_req_t, req_fields),
    LAYOUT(tally_rep_t, rep_fields),
    LAYOUT(tally_reply_t, reply_fields),
    LAYOUT(tally_stream_info_t, stream_info_fields),
    LAYOUT(tally_run_opts_t, run_opts_fields),
    LAYOUT(tally_run_result_t, run_result_fields),
    LAYOUT(tally_buf_t, buf_fields),
    LAYOUT(tally_pub_t, pub_fields),
    LAYOUT(tally_pub_msg_t, pub_msg_fields),
    LAYOUT(tally_hist_t, hist_fields),
    LAYOUT(tally_quantile_t, quantile_fields),
    LAYOUT(tally_hist_summary_t, summary_fields),
    LAYOUT(tally_curve_keys_t, curve_keys_fields),
};

static void print_layouts(void)
{
    printf("# C struct -> (sizeof, {field: (offsetof, sizeof)}), as the compiler lays them out.\n"
           "LAYOUT = {\n");
    for (size_t i = 0; i < COUNT_OF(layouts); i++) {
        const layout_t *l = &layouts[i];
        printf("    \"%s\": (%zu, {\n", l->name, l->size);
        for (size_t f = 0; f < l->count; f++)
            printf("        \"%s\": (%zu, %zu),\n", l->fields[f].name, l->fields[f].offset,
                   l->fields[f].size);
        printf("    }),\n");
    }
    printf("}\n");
}

int main(void)
{
    printf("# SPDX-License-Identifier: Apache-2.0\n"
           "# Generated by client/python/gen_wire.c from tally.h and tally_wire.h: do not edit.\n"
           "# Regenerate after changing them: BUILD/client/tally_gen_wire > "
           "client/python/tally/_wire.py\n"
           "# (tests/test_python_wire.sh fails, printing that command, while this file "
           "differs).\n\n");
    print_constants();
    printf("\n");
    print_layouts();
    return ferror(stdout) ? 1 : 0;
}
