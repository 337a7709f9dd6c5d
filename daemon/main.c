/* SPDX-License-Identifier: Apache-2.0 */
/*
 * main.c — tallyd's entry point: settings (defaults < configuration file < command line, see
 * td_config_load), then the server.
 */
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <systemd/sd-daemon.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_config.h"
#include "td_settings.h"
#ifdef TALLY_HAVE_NATS
#include "td_fleet.h"
#endif
#include "td_log.h"
#include "td_notify.h"
#include "td_server.h"

/* Before any thread starts (td_config.h says why): the thresholds and the arena limit. An
 * operator's own glibc.malloc tunables (GLIBC_TUNABLES) are left alone: mallopt would override
 * them. */
static void set_malloc_thresholds(const td_config_t *cfg)
{
    const char *tunables = getenv("GLIBC_TUNABLES");
    if (tunables && strstr(tunables, "glibc.malloc.")) {
        td_info("malloc thresholds left to GLIBC_TUNABLES");
        return;
    }
    if (!mallopt(M_MMAP_THRESHOLD, TD_MALLOC_MMAP_THRESHOLD) ||
        !mallopt(M_TRIM_THRESHOLD, TD_MALLOC_TRIM_THRESHOLD))
        td_warn("cannot set malloc's thresholds: received frames will page-fault");
    if (!mallopt(M_ARENA_MAX, cfg->nats_servers ? TD_MALLOC_ARENA_MAX_FLEET : TD_MALLOC_ARENA_MAX))
        td_warn("cannot limit malloc's arenas: freed memory may pile up in one per thread");
}

/* The [nats] settings: checked with the rest, before anything starts. */
static td_err_t check_fleet(const td_config_t *cfg, char *msg, size_t cap)
{
#ifdef TALLY_HAVE_NATS
    return td_fleet_check_config(cfg, msg, cap);
#else
    if (!cfg->nats_servers)
        return TD_OK;
    snprintf(msg, cap,
             "[nats] servers is set, but this tallyd was built without NATS (libnats-dev)");
    return TD_ERR_CONFIG;
#endif
}

/* The server, with the fleet worker beside it when [nats] servers is set: [nats]
 * members_per_process members, each a td_fleet (td_fleet.h). */
static int run(const td_config_t *cfg, td_server_t *server)
{
#ifdef TALLY_HAVE_NATS
    td_fleet_t *fleet[TD_NATS_MEMBERS_PER_PROCESS_LIMIT] = {NULL};
    unsigned members = cfg->nats_servers ? cfg->nats_members_per_process : 0;
    int code = 1;
    for (unsigned i = 0; i < members; i++) {
        td_fleet_host_t host = {.loop = td_server_loop(server),
                                .streams = td_server_streams(server),
                                .cfg = cfg,
                                .path = td_server_path(server),
                                .status = td_server_fleet_status(server),
                                .instance = i};
        if (td_fleet_new(&host, &fleet[i]) != TD_OK)
            goto done;
    }
    code = td_server_run(server);
done:
    for (unsigned i = 0; i < members; i++)
        td_fleet_destroy(&fleet[i]);
    return code;
#else
    (void)cfg;
    return td_server_run(server);
#endif
}

int main(int argc, char **argv)
{
    td_config_t cfg;
    td_config_init(&cfg);
    bool exit_now = false;
    char msg[256];
    int code = 1;
    td_err_t err = td_config_load(&cfg, argc, argv, &exit_now, msg, sizeof msg);
    if (err != TD_OK) {
        fprintf(stderr, SD_ERR "tallyd: %s\n", msg);
        code = td_err_exit_code(err);
        goto done;
    }
    if (exit_now) {
        code = 0;
        goto done;
    }
    /* Protected mode: before anything starts, and what --check-config reports too. */
    err = td_config_check_protected(&cfg, msg, sizeof msg);
    if (err != TD_OK) {
        fprintf(stderr, SD_ERR "tallyd: %s\n", msg);
        code = td_err_exit_code(err);
        goto done;
    }
    err = check_fleet(&cfg, msg, sizeof msg);
    if (err != TD_OK) {
        fprintf(stderr, SD_ERR "tallyd: %s\n", msg);
        code = td_err_exit_code(err);
        goto done;
    }
    /* Every file the start reads, with the start's messages: --check-config too. */
    err = td_server_check_files(&cfg);
    if (err != TD_OK) {
        if (err == TD_ERR_NOMEM)
            td_err("not started: out of memory");
        code = td_err_exit_code(err);
        goto done;
    }
    if (cfg.check_only) {
        printf("configuration ok (%s)\n",
               cfg.config_file ? cfg.config_file : TD_DEFAULT_CONFIG_FILE " if present");
        code = 0;
        goto done;
    }
    /* Under socket activation the passed sockets replace the default endpoint. */
    if (cfg.bind_count == 0 && td_listen_fds_count() == 0 &&
        td_config_add_bind(&cfg, TD_DEFAULT_ENDPOINT) != TD_OK) {
        fprintf(stderr, SD_ERR "tallyd: out of memory\n");
        goto done;
    }
    td_log_set_level((td_log_level_t)cfg.log_level);

    /* libuv sizes its worker pool from this variable when the pool first starts. */
    if (!getenv("UV_THREADPOOL_SIZE")) {
        unsigned workers = cfg.workers ? cfg.workers : td_config_cores();
        snprintf(msg, sizeof msg, "%u", workers);
        setenv("UV_THREADPOOL_SIZE", msg, 1);
    }
    signal(SIGPIPE, SIG_IGN);
    set_malloc_thresholds(&cfg);
    td_server_block_signals(); /* before any thread starts: the loop thread takes them */

    td_server_t *server = NULL;
    err = td_server_new(&cfg, &server);
    if (err != TD_OK) {
        /* Most failures were logged where they happened; out of memory often was not (alloc
         * sweep, issue 25: tallyd exited 1 without a word). One line says that it did not start. */
        td_err("not started: %s", err == TD_ERR_NOMEM ? "out of memory" : td_err_name(err));
        goto done;
    }
    code = run(&cfg, server);
    td_server_destroy(&server);
done:
    td_config_clear(&cfg);
    return code;
}
