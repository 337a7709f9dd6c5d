/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_web_assets.h — the web page's files (web/), embedded at build time by web/embed.cmake and
 * served from memory by td_web.c: nothing is read from disk at run time, so the page always
 * matches the daemon that serves it.
 */
#ifndef TD_WEB_ASSETS_H
#define TD_WEB_ASSETS_H

#include <stddef.h>

typedef struct {
    const char *url;          /* "/", "/app.js", ... */
    const char *content_type; /* with "; charset=utf-8" for text */
    const unsigned char *data;
    size_t len;
    const char *etag; /* "\"<16 hex digits of SHA-256>\"", for If-None-Match */
} td_web_asset_t;

extern const td_web_asset_t td_web_assets[];
extern const unsigned td_web_asset_count;

#endif
