/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_info.c — the daemon's `info` text as a list of keys and values (PROTOCOL.md §5 `info`).
 *
 * The text is `key=value\n` lines. The daemon only ever appends keys, so a client reads what it
 * knows by name and keeps the rest: every key is kept, in the daemon's order, whether this
 * library knows it or not, and nothing here depends on a key's position. What the protocol
 * rules out is refused as a whole (TALLY_E_REPLY) rather than half read: a line without `=`, a
 * key that is empty or not lower-case ASCII letters, digits and `_`, a key twice (which of the
 * two would be meant?), a NUL byte, and a last line without its `\n` (a truncated reply).
 *
 * One allocation holds a copy of the text, cut into NUL-terminated keys and values in place,
 * and the two arrays of pointers into it; tally_info_destroy frees it all at once.
 */
#include "tally.h"

#include <stdlib.h>
#include <string.h>

struct tally_info {
    size_t count;
    const char **keys;   /* count keys, in the order of the text */
    const char **values; /* values[i] is keys[i]'s */
    char *text;          /* the copy keys and values point into */
};

/* True for a key as PROTOCOL.md §5 spells it: one or more of [a-z0-9_]. */
static bool key_valid(const char *key, size_t len)
{
    if (len == 0)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = key[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'))
            return false;
    }
    return true;
}

static int cmp_keys(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* True when some key appears twice: sorted, a repeat stands next to its twin (O(n log n), so
 * a long hostile text costs no quadratic time). `scratch` has room for count pointers. */
static bool has_duplicate(const tally_info_t *self, const char **scratch)
{
    memcpy(scratch, self->keys, self->count * sizeof *scratch);
    qsort(scratch, self->count, sizeof *scratch, cmp_keys);
    for (size_t i = 1; i < self->count; i++)
        if (strcmp(scratch[i - 1], scratch[i]) == 0)
            return true;
    return false;
}

/* Cuts self->text (len bytes, each line ending in '\n') into keys and values. */
static tally_status_t split_lines(tally_info_t *self, size_t len)
{
    char *line = self->text;
    char *end = self->text + len;
    while (line < end) {
        char *nl = memchr(line, '\n', (size_t)(end - line));
        char *eq = memchr(line, '=', (size_t)(nl - line));
        if (!eq || !key_valid(line, (size_t)(eq - line)))
            return TALLY_E_REPLY;
        *eq = '\0';
        *nl = '\0';
        self->keys[self->count] = line;
        self->values[self->count] = eq + 1;
        self->count++;
        line = nl + 1;
    }
    return TALLY_OK;
}

tally_status_t tally_info_parse(const char *text, size_t len, tally_info_t **out)
{
    if (!out || (!text && len))
        return TALLY_E_ARG;
    *out = NULL;
    if ((len && text[len - 1] != '\n') || (len && memchr(text, '\0', len)))
        return TALLY_E_REPLY; /* truncated, or not text */
    size_t lines = 0;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    /* One block: the struct, three arrays of `lines` pointers (keys, values, sort scratch),
     * then the text. */
    size_t ptrs = 3 * lines * sizeof(const char *);
    tally_info_t *self = malloc(sizeof *self + ptrs + len + 1);
    if (!self)
        return TALLY_E_NOMEM;
    self->count = 0;
    self->keys = (const char **)(self + 1);
    self->values = self->keys + lines;
    self->text = (char *)(self->values + 2 * lines);
    if (len)
        memcpy(self->text, text, len);
    self->text[len] = '\0';
    tally_status_t status = split_lines(self, len);
    if (status == TALLY_OK && has_duplicate(self, self->values + lines))
        status = TALLY_E_REPLY;
    if (status != TALLY_OK) {
        free(self);
        return status;
    }
    *out = self;
    return TALLY_OK;
}

void tally_info_destroy(tally_info_t **self_p)
{
    if (!self_p)
        return;
    free(*self_p);
    *self_p = NULL;
}

size_t tally_info_count(const tally_info_t *self)
{
    return self ? self->count : 0;
}

const char *tally_info_key(const tally_info_t *self, size_t i)
{
    return self && i < self->count ? self->keys[i] : NULL;
}

const char *tally_info_value(const tally_info_t *self, size_t i)
{
    return self && i < self->count ? self->values[i] : NULL;
}

const char *tally_info_lookup(const tally_info_t *self, const char *key)
{
    if (!self || !key)
        return NULL;
    for (size_t i = 0; i < self->count; i++)
        if (strcmp(self->keys[i], key) == 0)
            return self->values[i];
    return NULL;
}

tally_status_t tally_info_u64(const tally_info_t *self, const char *key, uint64_t *value)
{
    const char *s = tally_info_lookup(self, key);
    if (!s || !value)
        return TALLY_E_ARG;
    /* PROTOCOL.md §5: no sign, no leading zeros but "0" itself, no separators, fits a u64. */
    if (!*s || (s[0] == '0' && s[1]))
        return TALLY_E_REPLY;
    uint64_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return TALLY_E_REPLY;
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10)
            return TALLY_E_REPLY;
        v = v * 10 + d;
    }
    *value = v;
    return TALLY_OK;
}
