/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_args.h — what people type, parsed once for tallyd and the tally CLI: byte sizes
 * ("16M", "1GiB") and ZeroMQ endpoints ("tcp://127.0.0.1:5555", "tcp://[::1]:5555",
 * "ipc:///run/tallyd/tallyd.sock").
 *
 * Both parsers explain a refusal in `why` (a short clause without the offending option's name,
 * so the caller can write "invalid size '1T' for --chunk: unknown suffix 'T' (use K, M or G)").
 * Private to the project: linked into tallyd and the CLI, not exported by libtally.
 */
#ifndef TALLY_ARGS_H
#define TALLY_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

/* A byte count: decimal digits, then optionally K, M or G (powers of 1024), optionally
 * followed by "i", "iB" or "B" ("64K", "64KiB", "64KB" are all 65536). TALLY_E_PARAM with
 * `why` for anything else, a negative number or a value that does not fit in size_t. */
tally_status_t tally_size_parse(const char *text, size_t *out, char *why, size_t why_cap);

/* How an endpoint is used: a bind may name "*" or an interface as its host. */
typedef enum { TALLY_ENDPOINT_CONNECT, TALLY_ENDPOINT_BIND } tally_endpoint_use_t;

/* Checks an endpoint before ZeroMQ sees it (ZeroMQ accepts "tcp://127.0.0.1:5570x" and
 * connects to nothing): tcp://HOST:PORT with a decimal port 1..65535 and a host that
 * getaddrinfo resolves (an IPv6 address in brackets; for a bind also "*" or an interface
 * name), or ipc://PATH with a path that fits a Unix socket address. TALLY_E_PARAM with `why`
 * otherwise. */
tally_status_t tally_endpoint_check(const char *endpoint, tally_endpoint_use_t use, char *why,
                                    size_t why_cap);

/* Splits "HOST:PORT" or "[V6]:PORT" (as in tcp://... endpoints and the metrics listen address)
 * into host (brackets removed) and port. False when it has no port. */
bool tally_hostport_split(const char *text, char *host, size_t host_cap, char *port,
                          size_t port_cap);

/* True for a tcp:// endpoint whose host is an IPv6 address in brackets ("tcp://[::1]:5555"):
 * ZeroMQ binds or connects to it only with ZMQ_IPV6 set on the socket (a host name is left to
 * IPv4, as before, so that "localhost" keeps meaning 127.0.0.1). */
bool tally_endpoint_ipv6(const char *endpoint);
/* A duration: a decimal number (no sign) and a unit, ms, s, m or h; a bare number is seconds
 * ("10s", "500ms", "1.5m", "2h", "10"). Rounded to whole milliseconds. TALLY_E_PARAM for
 * anything else or a value outside [min_ms, max_ms]. `tally query --last` and the HTTP API's
 * `last=` read it. */
tally_status_t tally_duration_parse(const char *text, uint64_t min_ms, uint64_t max_ms,
                                    uint64_t *out_ms);

#endif /* TALLY_ARGS_H */
