/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_fleet.c — the partition of a stream and the fleet's names (PROTOCOL.md §13). Pure
 * functions on byte buffers, shared by libtally's NATS producer and the daemon's worker so
 * that both, and any other client that follows the document, put a stream in one partition.
 */
#include <stdio.h>
#include <string.h>

#include "tally_fleet.h"

uint64_t tally_fnv1a64(const void *data, size_t len)
{
    return tally_fnv1a64_from(TALLY_FNV1A64_BASIS, data, len);
}

uint32_t tally_partition(const char *stream, size_t len, uint32_t partitions)
{
    if (partitions == 0)
        return 0;
    return (uint32_t)(tally_fnv1a64(stream, len) % partitions);
}

size_t tally_fleet_name(char *buf, size_t cap, const char *prefix, uint32_t k)
{
    int n = snprintf(buf, cap, "%s%u", prefix, (unsigned)k);
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
}

bool tally_fleet_member_id_valid(const char *id)
{
    size_t len = id ? strlen(id) : 0;
    if (len == 0 || len > TALLY_NATS_MEMBER_ID_MAX)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = id[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '-' || c == '_';
        if (!ok)
            return false;
    }
    return true;
}

size_t tally_fleet_subject(char *buf, size_t cap, const char *prefix, int64_t k, const char *user)
{
    int n = k >= 0 ? snprintf(buf, cap, "%s%u.%s", prefix, (unsigned)k, user)
                   : snprintf(buf, cap, "%s.%s", prefix, user);
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
}

const char *tally_fleet_subject_user(const char *subject)
{
    const char *dot = subject ? strrchr(subject, '.') : NULL;
    return dot && tally_fleet_member_id_valid(dot + 1) ? dot + 1 : NULL;
}

bool tally_fleet_reply_allowed(const char *reply, const char *user)
{
    size_t pre = strlen(TALLY_NATS_INBOX), ulen = user ? strlen(user) : 0;
    if (!reply || !ulen || strncmp(reply, TALLY_NATS_INBOX, pre) != 0 ||
        strncmp(reply + pre, user, ulen) != 0 || reply[pre + ulen] != '.')
        return false;
    const char *rest = reply + pre + ulen + 1;
    if (!*rest || rest[strlen(rest) - 1] == '.')
        return false;
    for (const char *c = rest; *c; c++)
        if (*c == '*' || *c == '>' || *c <= ' ' || *c == 0x7f || (*c == '.' && c[1] == '.'))
            return false;
    return true;
}

bool tally_fleet_id_allowed(const char *id, const char *user)
{
    size_t ulen = user ? strlen(user) : 0;
    return id && ulen && strncmp(id, user, ulen) == 0 && id[ulen] == '.' && id[ulen + 1];
}

size_t tally_fleet_owned_format(const bool *owned, uint32_t partitions, char *out, size_t cap)
{
    size_t n = (partitions + 3) / 4;
    if (n + 1 > cap)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned v = 0;
        for (uint32_t j = 0; j < 4 && 4 * i + j < partitions; j++)
            v |= owned[4 * i + j] ? 1u << j : 0;
        out[i] = "0123456789abcdef"[v];
    }
    out[n] = '\0';
    return n;
}

int tally_fleet_owned_merge(const char *text, uint32_t partitions, bool *covered)
{
    size_t n = text ? strlen(text) : 0;
    if (n == 0 || n > (partitions + 3) / 4)
        return -1;
    for (size_t i = 0; i < n; i++) { /* checked whole before anything is marked */
        const char *at = strchr("0123456789abcdef", text[i]);
        unsigned v = at && text[i] ? (unsigned)(at - "0123456789abcdef") : 16;
        if (v > 15 || (4 * i + 4 > partitions && (v >> (partitions - 4 * i)) != 0))
            return -1;
    }
    int fresh = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned v = (unsigned)(strchr("0123456789abcdef", text[i]) - "0123456789abcdef");
        for (uint32_t j = 0; j < 4; j++)
            if ((v >> j & 1) && !covered[4 * i + j]) {
                covered[4 * i + j] = true;
                fresh++;
            }
    }
    return fresh;
}

const char *tally_fleet_redact(const char *servers, char *out, size_t cap)
{
    size_t w = 0;
    if (cap == 0)
        return out;
    out[0] = 0;
    for (const char *url = servers ? servers : ""; *url;) {
        size_t len = strcspn(url, ",");
        const char *scheme = strstr(url, "://");
        const char *p = scheme && scheme < url + len ? scheme + 3 : url;
        size_t info = strcspn(p, "@/,");
        const char *at = p + info < url + len && p[info] == '@' ? p + info : NULL;
        const char *colon = at ? memchr(p, ':', (size_t)(at - p)) : NULL;
        int n;
        if (!at) /* no credentials */
            n = snprintf(out + w, cap - w, "%.*s", (int)len, url);
        else if (colon) /* user:password@ */
            n = snprintf(out + w, cap - w, "%.*s:***%.*s", (int)(colon - url), url,
                         (int)(url + len - at), at);
        else /* token@ */
            n = snprintf(out + w, cap - w, "%.*s***%.*s", (int)(p - url), url,
                         (int)(url + len - at), at);
        if (n < 0 || (size_t)n >= cap - w)
            break;
        w += (size_t)n;
        url += len;
        if (*url == ',') {
            if (w + 1 >= cap)
                break;
            out[w++] = *url++;
            out[w] = 0;
        }
    }
    return out;
}

bool tally_fleet_endpoint_get(const char *value, size_t len, const char *key, char *out, size_t cap)
{
    size_t klen = strlen(key);
    for (size_t at = 0; at < len;) {
        const char *line = value + at;
        const char *nl = memchr(line, '\n', len - at);
        size_t n = nl ? (size_t)(nl - line) : len - at;
        at += n + 1;
        if (n <= klen + 1 || memcmp(line, key, klen) != 0 || line[klen] != '=')
            continue;
        size_t vlen = n - klen - 1;
        if (vlen >= cap)
            return false;
        memcpy(out, line + klen + 1, vlen);
        out[vlen] = '\0';
        return true;
    }
    return false;
}

bool tally_fleet_host_id(char *out, size_t cap)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (!f)
        return false;
    bool ok = fgets(out, (int)cap, f) != NULL;
    fclose(f);
    if (ok)
        out[strcspn(out, "\n")] = '\0';
    return ok && out[0];
}
