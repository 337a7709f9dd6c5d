/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_keys.c — see tally_keys.h.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tally_keys.h"

#define KEY_FILE_MAX 4096 /* a certificate is a few hundred bytes */

/* Z85's alphabet (ZeroMQ RFC 32). */
static const char z85_chars[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                ".-:+=^!/*?&<>()[]{}@%$#";

bool tally_key_valid(const char *text, size_t len)
{
    if (len != TALLY_KEY_LEN)
        return false;
    /* Each 5 characters are a base-85 number that must fit 32 bits: "%nSc0" is 2^32 - 1, and
     * ZeroMQ's decoder refuses anything above (a key of '%' only is 40 characters of the
     * alphabet, and no key). */
    for (size_t group = 0; group < len; group += 5) {
        uint64_t value = 0;
        for (size_t i = group; i < group + 5; i++) {
            const char *c = text[i] ? strchr(z85_chars, text[i]) : NULL;
            if (!c)
                return false;
            value = value * 85 + (uint64_t)(c - z85_chars);
        }
        if (value > UINT32_MAX)
            return false;
    }
    return true;
}

/* A line without its surrounding blanks: [*start, *start + *len). */
static void trim(const char **start, size_t *len)
{
    while (*len && (**start == ' ' || **start == '\t')) {
        (*start)++;
        (*len)--;
    }
    while (*len && strchr(" \t\r", (*start)[*len - 1]))
        (*len)--;
}

/* `name = "value"` (quotes optional): the value, when the line is that name's. */
static bool named_value(const char *line, size_t len, const char *name, const char **value,
                        size_t *value_len)
{
    size_t n = strlen(name);
    if (len < n || memcmp(line, name, n) != 0)
        return false;
    const char *v = line + n;
    size_t vlen = len - n;
    trim(&v, &vlen);
    if (!vlen || *v != '=')
        return false;
    v++;
    vlen--;
    trim(&v, &vlen);
    if (vlen >= 2 && v[0] == '"' && v[vlen - 1] == '"') {
        v++;
        vlen -= 2;
    }
    *value = v;
    *value_len = vlen;
    return true;
}

static tally_status_t take_key(const char *what, const char *v, size_t vlen, char *out, char *msg,
                               size_t msg_cap)
{
    if (!tally_key_valid(v, vlen)) {
        snprintf(msg, msg_cap, "the %s key is not 40 characters of Z85 text", what);
        return TALLY_E_PARAM;
    }
    memcpy(out, v, TALLY_KEY_LEN);
    out[TALLY_KEY_LEN] = '\0';
    return TALLY_OK;
}

tally_status_t tally_key_parse(const char *text, bool bare_is_secret,
                               char public_key[TALLY_KEY_LEN + 1],
                               char secret_key[TALLY_KEY_LEN + 1], char *msg, size_t msg_cap)
{
    public_key[0] = secret_key[0] = '\0';
    tally_status_t st = TALLY_OK;
    for (const char *p = text; *p && st == TALLY_OK;) {
        size_t len = strcspn(p, "\n");
        const char *line = p;
        p += len + (p[len] == '\n');
        trim(&line, &len);
        const char *v;
        size_t vlen;
        if (!len || line[0] == '#')
            continue;
        if (named_value(line, len, "public-key", &v, &vlen))
            st = take_key("public", v, vlen, public_key, msg, msg_cap);
        else if (named_value(line, len, "secret-key", &v, &vlen))
            st = take_key("secret", v, vlen, secret_key, msg, msg_cap);
        else if (len == TALLY_KEY_LEN && tally_key_valid(line, len))
            st =
                take_key("bare", line, len, bare_is_secret ? secret_key : public_key, msg, msg_cap);
        /* anything else (metadata, section names) is the certificate's, not ours */
    }
    if (st == TALLY_OK && !public_key[0] && !secret_key[0]) {
        snprintf(msg, msg_cap, "no CURVE key in it (expected public-key = \"...\" lines)");
        st = TALLY_E_PARAM;
    }
    return st;
}

tally_status_t tally_key_file_read(const char *path, bool secret,
                                   char public_key[TALLY_KEY_LEN + 1],
                                   char secret_key[TALLY_KEY_LEN + 1], char *msg, size_t msg_cap)
{
    char why[256];
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(msg, msg_cap, "cannot read %s: %s", path, strerror(errno));
        return TALLY_E_IO;
    }
    tally_status_t st = TALLY_E_PARAM;
    struct stat sb;
    char *text = calloc(1, KEY_FILE_MAX + 1);
    if (!text || fstat(fileno(f), &sb) != 0) {
        snprintf(msg, msg_cap, "cannot read %s: %s", path, strerror(errno));
        st = TALLY_E_IO;
        goto done;
    }
    size_t n = fread(text, 1, KEY_FILE_MAX, f);
    if (ferror(f) || !feof(f)) {
        snprintf(msg, msg_cap, "cannot read %s: %s", path,
                 ferror(f) ? strerror(errno) : "larger than a key file");
        st = ferror(f) ? TALLY_E_IO : TALLY_E_PARAM;
        goto done;
    }
    text[n] = '\0';
    /* What the file holds first: a public file given as the secret one is told so, not asked
     * to be made private first. */
    st = tally_key_parse(text, secret, public_key, secret_key, why, sizeof why);
    if (st == TALLY_OK && secret && !secret_key[0]) {
        snprintf(why, sizeof why, "it holds no secret-key (is it the public file?)");
        st = TALLY_E_PARAM;
    }
    if (st != TALLY_OK) {
        snprintf(msg, msg_cap, "%s: %s", path, why);
    } else if (secret && (sb.st_mode & 077)) {
        snprintf(msg, msg_cap,
                 "%s has mode %04o: a secret key must not be accessible to group or others "
                 "(chmod 600 %s)",
                 path, (unsigned)(sb.st_mode & 07777), path);
        explicit_bzero(secret_key, TALLY_KEY_LEN + 1);
        st = TALLY_E_PARAM;
    }
done:
    if (text)
        explicit_bzero(text, KEY_FILE_MAX); /* it may have held a secret key */
    free(text);
    fclose(f);
    return st;
}
