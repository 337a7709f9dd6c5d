/* SPDX-License-Identifier: Apache-2.0 */
/*
 * gen_wire.c — prints client/python/tally/_wire.py, the C facts the Python binding uses: the
 * numbers it sends and checks (opcodes and the dtypes each takes, dtypes, predicates, flags,
 * statuses, seq modes, limits, the default endpoint, libtally's SONAME) and the layout (sizeof,
 * and each field's offsetof and sizeof) of every C struct it mirrors with ctypes.
 *
 * Why a program and not a parser: the operations, dtypes and predicates come from proto/'s
 * tables (the operation table, tally_ops.h, and the name functions), and every other value and
 * offset from the compiler reading the installed headers (tally.h and tally_wire.h, which the build
 * copies from tally_proto.h's PUBLIC sections), so no macro expression or padding rule can be
 * misread, and a name that no longer exists in the headers stops this file compiling. The fields
 * are listed by hand: a field added to one of these structs goes here and into the ctypes mirror
 * (one that fits into padding moves no offset and no size, so nothing else would notice it).
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

static const constant_t numbers[] = {
    CONSTANT(TALLY_DTYPE_I32),
    CONSTANT(TALLY_DTYPE_U8),
    CONSTANT(TALLY_FLAG_SCAN_EXCLUSIVE),
    CONSTANT(TALLY_FLAG_SCAN_OUT_I32),
    CONSTANT(TALLY_FLAG_FILTER_STABLE),
    CONSTANT(TALLY_E_UNKNOWN_STREAM),
    CONSTANT(TALLY_E_WINDOW),
    CONSTANT(TALLY_E_NOT_OWNER),
    CONSTANT(TALLY_E_NOT_DURABLE),
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

/* `NAME = {"name": value, ...}` for the values 0..count-1 that name() names. */
static void print_names(const char *dict, unsigned count, const char *(*name)(unsigned))
{
    printf("%s = {\n", dict);
    for (unsigned v = 0; v < count; v++)
        if (name(v) != NULL)
            printf("    \"%s\": %u,\n", name(v), v);
    printf("}\n");
}

static const char *op_name(unsigned op)
{
    return tally_op_name((tally_op_t)op);
}
static const char *pred_name(unsigned pred)
{
    return tally_pred_name((tally_pred_t)pred);
}
static const char *dtype_name(unsigned dtype)
{
    return tally_dtype_name((tally_dtype_t)dtype);
}

/* From the operation table (tally_ops.h): the dtypes each operation with a batch takes,
 * `OP_DTYPES = {"filter": ("i32", "u8"), ...}`, in dtype order. */
static void print_op_dtypes(void)
{
    size_t count;
    const tally_op_info_t *ops = tally_op_table(&count);
    printf("OP_DTYPES = {\n");
    for (size_t i = 0; i < count; i++) {
        if (ops[i].name == NULL || !ops[i].batch)
            continue;
        unsigned n = 0;
        printf("    \"%s\": (", ops[i].name);
        for (unsigned d = 0; d < TALLY_DTYPE_COUNT; d++)
            if (tally_op_takes_dtype(ops[i].opcode, d))
                printf("%s\"%s\"", n++ ? ", " : "", tally_dtype_name((tally_dtype_t)d));
        printf("%s),\n", n == 1 ? "," : ""); /* ("i32",) is a tuple, ("i32") is not */
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
    print_names("OP", TALLY_OP_COUNT, op_name);
    print_op_dtypes();
    print_names("PRED", TALLY_PRED_BETWEEN + 1, pred_name);
    print_names("DTYPE", TALLY_DTYPE_COUNT, dtype_name);
    for (size_t i = 0; i < COUNT_OF(numbers); i++) {
        /* TALLY_RUN_SEQ_OFF is SEQ_OFF in Python: "RUN_" says nothing there. */
        const char *prefix = strncmp(numbers[i].name, "TALLY_RUN_", 10) ? "TALLY_" : "TALLY_RUN_";
        print_name(numbers[i].name, prefix, 0);
        printf(" = %lld\n", numbers[i].value);
    }
    print_string("DEFAULT_ENDPOINT", TALLY_DEFAULT_ENDPOINT);
    /* The file name the binding loads libtally by: the shared library's SONAME, which the build
     * passes in (client/CMakeLists.txt), so a new major version of libtally is a new name here
     * and an old binding never loads a library it does not fit. */
    print_string("SONAME", TALLY_SONAME);
}

/* ---- Struct layouts ---------------------------------------------------------------------- */

/* Every mirrored struct, then its fields: STRUCT(type) opens a struct, each FIELD(member) after
 * it is one of its fields. One list, expanded once into the printing code below (STRUCT declares
 * the type the FIELDs that follow it measure). */
/* clang-format off */
#define LAYOUTS(STRUCT, FIELD)                                                                    \
    STRUCT(tally_req_t) FIELD(version) FIELD(opcode) FIELD(dtype) FIELD(flags) FIELD(request_id)  \
        FIELD(pred) FIELD(lo) FIELD(hi) FIELD(seq) FIELD(stream_len) FIELD(stream)                \
    STRUCT(tally_rep_t) FIELD(version) FIELD(opcode) FIELD(dtype) FIELD(flags) FIELD(request_id)  \
        FIELD(status) FIELD(count) FIELD(aux0) FIELD(aux1)                                        \
    STRUCT(tally_reply_t) FIELD(rep) FIELD(payload) FIELD(len) FIELD(error) FIELD(msg_)           \
    STRUCT(tally_stream_info_t) FIELD(batches) FIELD(elements) FIELD(bytes) FIELD(filter_seen)    \
        FIELD(filter_kept) FIELD(scan_carry) FIELD(scan_elements) FIELD(hist_dtype)               \
        FIELD(hist_lo) FIELD(hist_hi) FIELD(hist_underflow) FIELD(hist_overflow)                  \
        FIELD(hist_total) FIELD(last_seq) FIELD(bins)                                             \
    STRUCT(tally_run_opts_t) FIELD(chunk_bytes) FIELD(window) FIELD(shm) FIELD(seq)               \
        FIELD(seq_base) FIELD(total_bytes)                                                        \
    STRUCT(tally_run_result_t) FIELD(chunks) FIELD(elements) FIELD(count) FIELD(seen)             \
        FIELD(carry) FIELD(hist_total) FIELD(input_chunks) FIELD(seq_base) FIELD(applied)         \
        FIELD(skipped) FIELD(last_seq) FIELD(applied_known) FIELD(bytes) FIELD(applied_bytes)     \
        FIELD(status) FIELD(error)                                                                \
    STRUCT(tally_buf_t) FIELD(data) FIELD(len) FIELD(cap)                                         \
    STRUCT(tally_pub_t) FIELD(kind) FIELD(pub_seq) FIELD(time_ms) FIELD(interval_ms)              \
    STRUCT(tally_pub_msg_t) FIELD(pub) FIELD(stream) FIELD(info)                                  \
    STRUCT(tally_hist_t) FIELD(dtype) FIELD(lo) FIELD(hi) FIELD(bins) FIELD(underflow)            \
        FIELD(overflow)                                                                           \
    STRUCT(tally_quantile_t) FIELD(value) FIELD(side)                                             \
    STRUCT(tally_hist_summary_t) FIELD(count) FIELD(in_range) FIELD(underflow) FIELD(overflow)    \
        FIELD(mean) FIELD(min_bin) FIELD(max_bin) FIELD(p50) FIELD(p90) FIELD(p99)                \
    STRUCT(tally_curve_keys_t) FIELD(server_public) FIELD(client_public) FIELD(client_secret)   \
    STRUCT(tally_nats_opts_t) FIELD(servers) FIELD(credentials) FIELD(nkey) FIELD(nkey_seed)      \
        FIELD(tls_ca) FIELD(tls_cert) FIELD(tls_key) FIELD(producer_id) FIELD(timeout_ms)         \
        FIELD(partitions) FIELD(window_bytes) FIELD(user)

/* A struct's line, `"type": (sizeof, {`, after the line that closes the struct before it. Each
 * struct's fields are measured in a block of their own (the one STRUCT opens), where measured_t
 * is that struct. */
#define PRINT_STRUCT(type)                                                                        \
    }                                                                                             \
    {                                                                                             \
        typedef type measured_t;                                                                  \
        printf("%s    \"%s\": (%zu, {\n", first ? "" : "    }),\n", #type, sizeof(type));          \
        first = 0;
#define PRINT_FIELD(member)                                                                       \
    printf("        \"%s\": (%zu, %zu),\n", #member, offsetof(measured_t, member),                 \
           sizeof(((measured_t *)0)->member));
/* clang-format on */

static void print_layouts(void)
{
    int first = 1;
    printf("# C struct -> (sizeof, {field: (offsetof, sizeof)}), as the compiler lays them out.\n"
           "LAYOUT = {\n");
    {LAYOUTS(PRINT_STRUCT, PRINT_FIELD)} printf("    }),\n}\n");
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
