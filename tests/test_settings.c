/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_settings.c — the table of settings (daemon/base/td_settings.c) where a running tallyd
 * does not take it: what each kind of value becomes, and the copies reload makes.
 *   - users and groups by name in the shared-memory allow-lists and the socket's group: looked up
 *     in the passwd and group databases (the names of uid and gid 0 and of nobody's, whatever
 *     this system calls them), mixed with numbers; a name that does not exist, an empty item
 *     and a 33rd entry are refused;
 *   - the formatting of id lists and bind lists as logs and documents show them;
 *   - copying a bind list (td_setting_copy, which a reload of a setting that applies would do,
 *     and which no reload reaches today since bind needs a restart): every string copied, the
 *     old ones freed, `same` after and not after a change;
 *   - copying and comparing id lists (what a reload of allow_uids does);
 *   - the command line's and the file's refusals, each with its exact words (an unknown option,
 *     a missing value, a stray argument, a value out of range or of the wrong kind; an unknown
 *     key or section, a key outside any section, a bad value with its line, a syntax error, a
 *     file that cannot be read), the first of several errors reported, and the values the
 *     accepted spellings give (on/yes/true, log levels by name or number);
 *   - the man pages' generated parts (scdoc): tallyd(8)'s options and tallyd.conf(5)'s keys,
 *     scdoc's characters escaped, hidden options left out;
 *   - what follows from values: which endpoints are local, the bind list's bound, the shard
 *     count a test run asks for, $STATE_DIRECTORY and $CREDENTIALS_DIRECTORY, a file named in a
 *     setting that cannot be read; error names and exit codes; a log line longer than its buffer.
 * The ASan build checks that nothing leaks or is freed twice.
 */
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "td_err.h"
#include "td_log.h"
#include "td_settings.h"

static char why[256];

static const td_setting_t *row(const char *option)
{
    const td_setting_t *s = td_setting_by_option(option);
    assert_non_null(s);
    return s;
}

static td_err_t set(td_config_t *cfg, const char *option, const char *value)
{
    return td_setting_parse(row(option), cfg, value, why, sizeof why);
}

static void test_names_in_allow_lists(void **state)
{
    (void)state;
    struct passwd *root = getpwuid(0);
    assert_non_null(root);
    char root_name[64];
    snprintf(root_name, sizeof root_name, "%s", root->pw_name);
    struct group *root_group = getgrgid(0);
    assert_non_null(root_group);
    char root_group_name[64];
    snprintf(root_group_name, sizeof root_group_name, "%s", root_group->gr_name);

    td_config_t cfg;
    td_config_init(&cfg);
    char list[160];
    snprintf(list, sizeof list, "%s,1234,%s", root_name, root_name);
    assert_int_equal(set(&cfg, "shm-allow-uids", list), TD_OK);
    assert_int_equal(cfg.shm_allow_uid_count, 3);
    assert_int_equal(cfg.shm_allow_uids[0], 0);
    assert_int_equal(cfg.shm_allow_uids[1], 1234);
    assert_int_equal(cfg.shm_allow_uids[2], 0);
    snprintf(list, sizeof list, "77,%s", root_group_name);
    assert_int_equal(set(&cfg, "shm-allow-gids", list), TD_OK);
    assert_int_equal(cfg.shm_allow_gid_count, 2);
    assert_int_equal(cfg.shm_allow_gids[0], 77);
    assert_int_equal(cfg.shm_allow_gids[1], 0);
    assert_int_equal(set(&cfg, "shm-socket-group", root_group_name), TD_OK);
    assert_int_equal(cfg.shm_socket_gid, 0);
    assert_int_equal(set(&cfg, "shm-socket-group", "4321"), TD_OK);
    assert_int_equal(cfg.shm_socket_gid, 4321);
    assert_int_equal(set(&cfg, "shm-socket-group", ""), TD_OK); /* tallyd's own */
    assert_int_equal(cfg.shm_socket_gid, -1);

    /* Logs and documents show numbers. */
    char shown[256];
    td_setting_format(row("shm-allow-uids"), &cfg, false, shown, sizeof shown);
    assert_string_equal(shown, "0,1234,0");
    td_setting_format(row("shm-allow-gids"), &cfg, true, shown, sizeof shown);
    assert_string_equal(shown, "77,0");

    /* Refused: a name nobody has, an empty item, a number out of range read as a name, more
     * than 32 entries (the count stays). */
    const char *bad[] = {"no-such-user-tally37", "0,,1", ",", "4294967296x", NULL};
    for (int i = 0; bad[i]; i++) {
        assert_int_equal(set(&cfg, "shm-allow-uids", bad[i]), TD_ERR_CONFIG);
        assert_int_equal(cfg.shm_allow_uid_count, 3);
    }
    assert_int_equal(set(&cfg, "shm-allow-gids", "no-such-group-tally37"), TD_ERR_CONFIG);
    assert_int_equal(cfg.shm_allow_gid_count, 2);
    assert_int_equal(set(&cfg, "shm-socket-group", "no-such-group-tally37"), TD_ERR_CONFIG);
    assert_int_equal(cfg.shm_socket_gid, -1);
    char many[33 * 4 + 1] = "";
    for (int i = 0; i < 33; i++)
        strcat(many, i ? ",1" : "1");
    assert_int_equal(set(&cfg, "shm-allow-uids", many), TD_ERR_CONFIG);
    many[strlen(many) - 2] = '\0'; /* 32 entries: the most */
    assert_int_equal(set(&cfg, "shm-allow-uids", many), TD_OK);
    assert_int_equal(cfg.shm_allow_uid_count, 32);
    assert_int_equal(set(&cfg, "shm-allow-uids", ""), TD_OK); /* none */
    assert_int_equal(cfg.shm_allow_uid_count, 0);
    td_config_clear(&cfg);
}

/* What reload does with an id list: compared by count and values, copied whole. */
static void test_id_lists_compare_and_copy(void **state)
{
    (void)state;
    const td_setting_t *uids = row("shm-allow-uids");
    td_config_t live, next;
    td_config_init(&live);
    td_config_init(&next);
    assert_true(td_setting_same(uids, &live, &next));
    assert_int_equal(set(&next, "shm-allow-uids", "5,6"), TD_OK);
    assert_false(td_setting_same(uids, &live, &next));
    assert_int_equal(td_setting_copy(uids, &live, &next), TD_OK);
    assert_true(td_setting_same(uids, &live, &next));
    assert_int_equal(live.shm_allow_uid_count, 2);
    assert_int_equal(live.shm_allow_uids[1], 6);
    assert_int_equal(set(&next, "shm-allow-uids", "5,7"), TD_OK); /* same count, other value */
    assert_false(td_setting_same(uids, &live, &next));
    td_config_clear(&live);
    td_config_clear(&next);
}

/* A bind list copied: strings of its own (next freed first: live still reads them), the old
 * ones freed, and `same` after. An empty list in next means "the default": the same as any. */
static void test_bind_lists_copy(void **state)
{
    (void)state;
    const td_setting_t *bind = row("bind");
    td_config_t live, next;
    td_config_init(&live);
    td_config_init(&next);
    assert_int_equal(set(&live, "bind", "tcp://127.0.0.1:5555"), TD_OK);
    assert_true(td_setting_same(bind, &live, &next)); /* next has none: the default */
    assert_int_equal(set(&next, "bind", "ipc:///tmp/tally-37-a.sock"), TD_OK);
    assert_int_equal(set(&next, "bind", "tcp://127.0.0.1:6000"), TD_OK);
    assert_int_equal(next.bind_count, 2);
    assert_false(td_setting_same(bind, &live, &next)); /* another count */
    assert_int_equal(td_setting_copy(bind, &live, &next), TD_OK);
    assert_int_equal(live.bind_count, 2);
    assert_true(td_setting_same(bind, &live, &next));
    assert_ptr_not_equal(live.binds[0], next.binds[0]);
    char shown[256];
    td_setting_format(bind, &live, false, shown, sizeof shown);
    assert_string_equal(shown, "ipc:///tmp/tally-37-a.sock,tcp://127.0.0.1:6000");
    td_config_clear(&next);
    assert_string_equal(live.binds[1], "tcp://127.0.0.1:6000"); /* its own copy */
    /* Same count, one endpoint changed: not the same. */
    td_config_init(&next);
    assert_int_equal(set(&next, "bind", "ipc:///tmp/tally-37-a.sock"), TD_OK);
    assert_int_equal(set(&next, "bind", "tcp://127.0.0.1:6001"), TD_OK);
    assert_false(td_setting_same(bind, &live, &next));
    assert_int_equal(td_setting_copy(bind, &live, &next), TD_OK);
    assert_string_equal(live.binds[1], "tcp://127.0.0.1:6001");
    /* An endpoint that is not one is refused with the reason; the list stays. */
    assert_int_equal(set(&next, "bind", "udp://127.0.0.1:1"), TD_ERR_CONFIG);
    assert_non_null(strstr(why, "invalid endpoint 'udp://127.0.0.1:1' for --bind"));
    assert_int_equal(next.bind_count, 2);
    td_config_clear(&live);
    td_config_clear(&next);
}

/* ---- The command line and the file: refusals in their exact words ------------------------- */

static char msg[1024];

/* td_config_parse_args over a fresh configuration with `args` (NULL-terminated, after argv[0]). */
static td_err_t parse(td_config_t *cfg, const char *const *args)
{
    char *argv[16] = {"tallyd"};
    int argc = 1;
    while (args[argc - 1])
        argv[argc] = (char *)args[argc - 1], argc++;
    bool exit_now = true;
    msg[0] = '\0';
    td_err_t err = td_config_parse_args(cfg, argc, argv, &exit_now, msg, sizeof msg);
    assert_false(exit_now);
    return err;
}

/* The command line's refusal of `args`, in these words. */
static void refused_args(const char *const *args, const char *words)
{
    td_config_t cfg;
    td_config_init(&cfg);
    assert_int_equal(parse(&cfg, args), TD_ERR_CONFIG);
    assert_string_equal(msg, words);
    td_config_clear(&cfg);
}

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

static void test_command_line_refusals(void **state)
{
    (void)state;
    refused_args(ARGS("--no-such-option"), "unknown option --no-such-option (try --help)");
    refused_args(ARGS("-x"), "unknown option -x (try --help)");
    refused_args(ARGS("--max-batch"), "option --max-batch needs a value");
    refused_args(ARGS("--backend", "cpu", "stray"), "unexpected argument 'stray' (try --help)");
    /* Numbers: below the row's minimum, above its maximum, signed, not a number, too long for
     * any integer, empty. */
    const char *numbers[] = {"0", "65537", "-1", "12abc", "99999999999999999999", ""};
    for (size_t i = 0; i < sizeof numbers / sizeof numbers[0]; i++) {
        char words[128];
        snprintf(words, sizeof words, "invalid value '%s' for --max-inflight (try --help)",
                 numbers[i]);
        refused_args(ARGS("--max-inflight", numbers[i]), words);
    }
    refused_args(ARGS("--max-batch", "0"), "invalid value '0' for --max-batch (try --help)");
    refused_args(ARGS("--shm", "maybe"), "invalid value 'maybe' for --shm (try --help)");
    refused_args(ARGS("--backend", "gpu"), "invalid value 'gpu' for --backend (try --help)");
    refused_args(ARGS("--log-level", "loud"), "invalid value 'loud' for --log-level (try --help)");
    refused_args(ARGS("--log-level", "8"), "invalid value '8' for --log-level (try --help)");
    refused_args(ARGS("--log-level", "77"), "invalid value '77' for --log-level (try --help)");
    refused_args(ARGS("--curve-clients", "cam1:short"),
                 "invalid value 'cam1:short' for --curve-clients (try --help)");
    /* A name and a key of the right length with no ':' between them. */
    const char *no_colon = "cam1-rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
    char words[160];
    snprintf(words, sizeof words, "invalid value '%s' for --curve-clients (try --help)", no_colon);
    refused_args(ARGS("--curve-clients", no_colon), words);

    /* What the accepted spellings give; the last of a repeated option wins. */
    td_config_t cfg;
    td_config_init(&cfg);
    static const struct {
        const char *value;
        bool on;
    } bools[] = {{"yes", true}, {"off", false}, {"true", true},
                 {"no", false}, {"on", true},   {"false", false}};
    for (size_t i = 0; i < sizeof bools / sizeof bools[0]; i++) {
        assert_int_equal(parse(&cfg, ARGS("--protected-mode", bools[i].value)), TD_OK);
        assert_int_equal(cfg.protected_mode, bools[i].on);
    }
    static const struct {
        const char *value;
        int level;
    } levels[] = {{"3", TD_LOG_ERR},        {"7", TD_LOG_DEBUG},       {"error", TD_LOG_ERR},
                  {"WARN", TD_LOG_WARNING}, {"Notice", TD_LOG_NOTICE}, {"warning", TD_LOG_WARNING},
                  {"info", TD_LOG_INFO}};
    for (size_t i = 0; i < sizeof levels / sizeof levels[0]; i++) {
        assert_int_equal(parse(&cfg, ARGS("--log-level", levels[i].value)), TD_OK);
        assert_int_equal(cfg.log_level, levels[i].level);
    }
    assert_int_equal(parse(&cfg, ARGS("--backend", "cuda", "--backend", "cpu")), TD_OK);
    assert_int_equal(cfg.backend, TD_BACKEND_CPU);
    assert_int_equal(parse(&cfg, ARGS("--max-inflight", "65536", "--max-batch", "2M")), TD_OK);
    assert_int_equal(cfg.max_inflight, 65536);
    assert_int_equal(cfg.max_batch, 2u << 20);
    td_config_clear(&cfg);
    assert_string_equal(td_log_level_name(TD_LOG_NOTICE), "notice");
    assert_string_equal(td_log_level_name((td_log_level_t)99), "?");
}

/* A scratch folder of this test's own. */
static char dir[64];

static int make_dir(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/tally-settings-XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int remove_dir(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* DIR/NAME holding text: its path in path. */
static void write_conf(const char *name, const char *text, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
}

/* The file's refusal of `text`, in these words after "PATH:". */
static void refused_file(const char *text, const char *words)
{
    char path[128], want[512];
    write_conf("bad.conf", text, path, sizeof path);
    td_config_t cfg;
    td_config_init(&cfg);
    msg[0] = '\0';
    assert_int_equal(td_config_load_file(&cfg, path, msg, sizeof msg), TD_ERR_CONFIG);
    snprintf(want, sizeof want, "%s:%s", path, words);
    assert_string_equal(msg, want);
    td_config_clear(&cfg);
}

static void test_file_refusals(void **state)
{
    (void)state;
    refused_file("max_batch = 1M\n", "1: key 'max_batch' outside any [section]");
    refused_file("[server]\nmax_batch = 1M\n\n[nosuch]\nkey = 1\n", "4: unknown section [nosuch]");
    /* A section without keys is checked too (tallyd.conf(5): an unknown section stops tallyd);
     * indented after a key, inih reads it as more of that key's value. */
    refused_file("[server]\nmax_batch = 1M\n[nosuch]\n", "3: unknown section [nosuch]");
    refused_file("[server]\n  [nosuch]\n", "2: unknown section [nosuch]");
    refused_file(
        "[server]\nmax_batch = 1M\n  [nosuch]\n",
        "3: invalid value '[nosuch]' for max_batch in [server] (see --max-batch in --help)");
    /* A line longer than inih reads at once (tallyd.conf(5): 198 characters) is refused as
     * such at its line, whatever its pieces would have looked like to inih. */
    char longline[3000] = "[server]\nmax_inflight = 8\n# ";
    for (int i = 0; i < 1000; i++)
        strcat(longline, "[]");
    strcat(longline, "\nmax_inflight = 9\n");
    refused_file(longline, "3: line longer than 198 characters");
    char fits[300];
    snprintf(fits, sizeof fits, "[server]\n#%0197d\nnosuch = 1\n", 0); /* 198 characters */
    refused_file(fits, "3: unknown key 'nosuch' in [server]");
    refused_file("[server]\n# a comment\nnosuch = 1\n", "3: unknown key 'nosuch' in [server]");
    refused_file("[shm]\nenabled = maybe\n",
                 "2: invalid value 'maybe' for enabled in [shm] (see --shm in --help)");
    /* Several errors: the first is the one reported. */
    refused_file(
        "[server]\nmax_inflight = 0\nbackend = gpu\nnosuch = 1\n",
        "2: invalid value '0' for max_inflight in [server] (see --max-inflight in --help)");
    refused_file("[server]\nmax_batch = 1M\nthis line is neither\n",
                 "3: syntax error (expected [section] or key = value)");

    char path[128], want[256];
    snprintf(path, sizeof path, "%s/none.conf", dir);
    td_config_t cfg;
    td_config_init(&cfg);
    assert_int_equal(td_config_load_file(&cfg, path, msg, sizeof msg), TD_ERR_IO);
    snprintf(want, sizeof want, "cannot read %s: No such file or directory", path);
    assert_string_equal(msg, want);

    /* A good file: each key as its option would set it. */
    write_conf("good.conf",
               "[server]\nmax_batch = 2M\nlog_level = debug\nbackend = cpu\n"
               "[shm]\nenabled = no\n[windows]\nintervals = 0\n",
               path, sizeof path);
    assert_int_equal(td_config_load_file(&cfg, path, msg, sizeof msg), TD_OK);
    assert_int_equal(cfg.max_batch, 2u << 20);
    assert_int_equal(cfg.log_level, TD_LOG_DEBUG);
    assert_int_equal(cfg.backend, TD_BACKEND_CPU);
    assert_false(cfg.shm);
    assert_int_equal(cfg.window_intervals, 0);
    td_config_clear(&cfg);
}

/* The whole load: --config FILE that must exist, $STATE_DIRECTORY's first entry as the state
 * directory when none is set, and a relative path under $CREDENTIALS_DIRECTORY (too long a
 * result refused; one that is not there said so, with where it was looked up). */
static void test_load_and_environment(void **state)
{
    (void)state;
    char path[128], want[512];
    snprintf(path, sizeof path, "%s/missing.conf", dir);
    td_config_t cfg;
    td_config_init(&cfg);
    bool exit_now = false;
    char *argv[] = {"tallyd", "--config", path, NULL};
    assert_int_equal(td_config_load(&cfg, 3, argv, &exit_now, msg, sizeof msg), TD_ERR_CONFIG);
    snprintf(want, sizeof want, "cannot read %s: No such file or directory", path);
    assert_string_equal(msg, want);

    write_conf("empty.conf", "", path, sizeof path);
    setenv("STATE_DIRECTORY", "/var/lib/tallyd-a:/var/lib/tallyd-b", 1);
    assert_int_equal(td_config_load(&cfg, 3, argv, &exit_now, msg, sizeof msg), TD_OK);
    unsetenv("STATE_DIRECTORY");
    assert_string_equal(cfg.state_dir, "/var/lib/tallyd-a");
    td_config_clear(&cfg);

    setenv("CREDENTIALS_DIRECTORY", dir, 1);
    assert_int_equal(set(&cfg, "curve-secret-key", "server.key"), TD_OK);
    snprintf(want, sizeof want, "%s/server.key", dir);
    assert_string_equal(cfg.curve_secret_key, want);
    assert_int_equal(td_config_check_files(&cfg, msg, sizeof msg), TD_ERR_IO);
    snprintf(want, sizeof want,
             "[security] curve_secret_key (--curve-secret-key): cannot read %s/server.key: No "
             "such file or directory (looked up in $CREDENTIALS_DIRECTORY: does the unit have "
             "LoadCredential=server.key:PATH?)",
             dir);
    assert_string_equal(msg, want);
    assert_int_equal(set(&cfg, "curve-secret-key", "/abs/server.key"), TD_OK); /* as given */
    assert_string_equal(cfg.curve_secret_key, "/abs/server.key");
    char *longer = malloc(5000);
    memset(longer, 'k', 4999);
    longer[4999] = '\0';
    assert_int_equal(set(&cfg, "curve-secret-key", longer), TD_ERR_CONFIG);
    assert_string_equal(cfg.curve_secret_key, "/abs/server.key"); /* kept */
    free(longer);
    unsetenv("CREDENTIALS_DIRECTORY");
    /* A file of [metrics] is read only when metrics are on. */
    assert_int_equal(set(&cfg, "curve-secret-key", ""), TD_OK);
    assert_int_equal(set(&cfg, "metrics-auth-file", "/nonexistent/metrics.auth"), TD_OK);
    assert_int_equal(td_config_check_files(&cfg, msg, sizeof msg), TD_OK);
    assert_int_equal(set(&cfg, "metrics", "127.0.0.1:9464"), TD_OK);
    assert_int_equal(td_config_check_files(&cfg, msg, sizeof msg), TD_ERR_IO);
    assert_non_null(strstr(msg, "[metrics] auth_file (--metrics-auth-file): cannot read "
                                "/nonexistent/metrics.auth: No such file or directory"));
    td_config_clear(&cfg);
}

/* ---- The man pages' generated parts --------------------------------------------------------- */

static char *printed(void (*print)(FILE *))
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    print(f);
    assert_int_equal(fclose(f), 0);
    return text;
}

/* What print writes: it starts with head, holds each of present, none of absent (NULL-ended). */
static void check_printed(void (*print)(FILE *), const char *head, const char *const *present,
                          const char *const *absent)
{
    char *text = printed(print);
    if (strncmp(text, head, strlen(head)) != 0)
        fail_msg("'%.80s' does not start with '%s'", text, head);
    for (; *present; present++)
        if (!strstr(text, *present))
            fail_msg("no '%s' in what was printed", *present);
    for (; *absent; absent++)
        if (strstr(text, *absent))
            fail_msg("'%s' printed", *absent);
    free(text);
}

static void test_man_page_parts(void **state)
{
    (void)state;
    /* tallyd(8): every option not hidden, its short form and argument, its key in the file;
     * scdoc's * and _ escaped in words (a key's underscore), never in the markup. */
    check_printed(
        td_settings_print_options_scd,
        "*-b, --bind* _ENDPOINT_\n\tZeroMQ endpoint to bind, repeatable; ",
        (const char *const[]){
            "(*bind* in [server]). Default: " TD_DEFAULT_ENDPOINT ".\n\n",
            "*--max-batch* _BYTES_\n\tLargest request payload, K/M/G suffixes; it sizes the GPU "
            "staging buffers at start (*max\\_batch* in [server]). Default: 16M.\n\n",
            "*-c, --config* _FILE_\n\tConfiguration file. Default: " TD_DEFAULT_CONFIG_FILE
            " if present.\n\n",
            "*--check-config*\n\tCheck the configuration file",
            "*-V, --version*\n\tPrint the version.\n\n", NULL},
        (const char *const[]){"--test-clock", "--print-settings-scd", NULL});
    /* tallyd.conf(5): each [section] with its words, each key with its option and what a
     * reload does; the command line's own options are not keys. */
    check_printed(
        td_settings_print_conf_scd,
        "## [server]\n\n*bind* = _ENDPOINT_ (repeatable)\n\tZeroMQ endpoint",
        (const char *const[]){
            "(*--bind*). Default: " TD_DEFAULT_ENDPOINT ". Restart to change.\n\n",
            "*max\\_batch* = _BYTES_\n\tLargest request payload, K/M/G suffixes; it sizes the "
            "GPU staging buffers at start (*--max-batch*). Default: 16M. Changes at reload, up "
            "to the value tallyd started with (it sized the buffers).\n\n",
            "## [security]\n\nCURVE authentication and encryption (PROTOCOL.md §12).\n\n",
            "subdomains; \\*: any)", "*socket\\_group* = _G_\n", NULL},
        (const char *const[]){"--config", "test\\_clock", NULL});
}

/* ---- What follows from values ------------------------------------------------------------- */

static void test_local_endpoints_and_binds(void **state)
{
    (void)state;
    static const struct {
        const char *endpoint;
        bool local;
    } cases[] = {
        {"ipc:///run/tallyd.sock", true},
        {"inproc://x", true},
        {"tcp://127.0.0.1:5555", true},
        {"tcp://127.200.1.1:1", true},
        {"tcp://10.0.0.1:5555", false},
        {"tcp://[::1]:5555", true},
        {"tcp://[::ffff:127.0.0.9]:1", true},
        {"tcp://[::ffff:10.0.0.1]:1", false},
        {"tcp://[::]:1", false},
        {"tcp://*:5555", false},
        {"tcp://localhost:1", true},
        {"tcp://lo:1", true},
        {"tcp://eth0:1", false},
        {"udp://127.0.0.1:1", false},
        {"127.0.0.1:9464", true},
        {"[::1]:9464", true},
        {"0.0.0.0:9464", false},
        {":9464", false},
        {"tcp://[]:1", false},
        {"127.0.0.1", true},
        {"tcp://aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa:1", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (td_endpoint_is_local(cases[i].endpoint) != cases[i].local)
            fail_msg("%s: local should be %d", cases[i].endpoint, cases[i].local);

    td_config_t cfg;
    td_config_init(&cfg);
    assert_int_equal(td_config_add_bind(&cfg, "udp://127.0.0.1:1"), TD_ERR_CONFIG);
    for (int i = 0; i < TD_MAX_BINDS; i++) {
        char endpoint[64];
        snprintf(endpoint, sizeof endpoint, "tcp://127.0.0.1:%d", 6000 + i);
        assert_int_equal(td_config_add_bind(&cfg, endpoint), TD_OK);
    }
    assert_int_equal(td_config_add_bind(&cfg, "tcp://127.0.0.1:7000"), TD_ERR_CONFIG);
    assert_int_equal(cfg.bind_count, TD_MAX_BINDS);
    td_config_clear(&cfg);
}

/* --shards wins; else TALLYD_TEST_SHARDS from 1 to the limit; else a count from the cores. */
static void test_shard_count(void **state)
{
    (void)state;
    const char *was = getenv("TALLYD_TEST_SHARDS");
    char *saved = was ? strdup(was) : NULL;
    td_config_t cfg;
    td_config_init(&cfg);
    setenv("TALLYD_TEST_SHARDS", "3", 1);
    assert_int_equal(td_config_shards(&cfg), 3);
    cfg.shards = 2;
    assert_int_equal(td_config_shards(&cfg), 2);
    cfg.shards = 0;
    static const char *const ignored[] = {"0", "65", "x"};
    for (size_t i = 0; i < 3; i++) {
        setenv("TALLYD_TEST_SHARDS", ignored[i], 1);
        unsigned n = td_config_shards(&cfg);
        assert_true(n >= 1 && n <= TD_SHARDS_DEFAULT_MAX);
    }
    if (saved)
        setenv("TALLYD_TEST_SHARDS", saved, 1);
    else
        unsetenv("TALLYD_TEST_SHARDS");
    free(saved);
    td_config_clear(&cfg);
}

/* The default shard count from the cores: the cores less the I/O threads and the sockets'
 * thread; for a worker fed by JetStream the cores less its fleet threads, at least 2 from 3
 * cores (its fleet thread is a port of the request path only with 2 shards or more); 1 to 4. */
static void test_default_shards(void **state)
{
    (void)state;
    assert_int_equal(td_config_default_shards(2, 2, 0), 1); /* the CI box */
    assert_int_equal(td_config_default_shards(3, 2, 0), 1); /* a pinned worker before */
    assert_int_equal(td_config_default_shards(8, 2, 0), 4); /* 8 - 2 - 1, capped */
    assert_int_equal(td_config_default_shards(6, 2, 0), 3);
    assert_int_equal(td_config_default_shards(2, 2, 1), 1); /* a worker on 2 cores */
    assert_int_equal(td_config_default_shards(3, 2, 1), 2); /* ... on 3 pinned cores */
    assert_int_equal(td_config_default_shards(3, 2, 2), 2); /* two members: still a port */
    assert_int_equal(td_config_default_shards(4, 2, 1), 3);
    assert_int_equal(td_config_default_shards(16, 4, 1), TD_SHARDS_DEFAULT_MAX);
    assert_int_equal(td_config_default_shards(1, 2, 1), 1);
    td_config_t cfg;
    td_config_init(&cfg);
    assert_false(td_config_fleet_ingest(&cfg));
    cfg.nats_servers = strdup("nats://127.0.0.1:4222");
    assert_true(td_config_fleet_ingest(&cfg));
    cfg.nats_direct = strdup("off");
    assert_true(td_config_fleet_ingest(&cfg));
    free(cfg.nats_direct);
    cfg.nats_direct = strdup("replicated"); /* producers' ZeroMQ load: the plain default */
    assert_false(td_config_fleet_ingest(&cfg));
    td_config_clear(&cfg);
}

/* The defaults count the cores tallyd may run on (its affinity: taskset, CPUAffinity=), not the
 * cores online: pinned to one core, one shard and the fewest I/O threads. */
static void test_cores_follow_affinity(void **state)
{
    (void)state;
    cpu_set_t was;
    assert_int_equal(sched_getaffinity(0, sizeof was, &was), 0);
    assert_int_equal(td_config_cores(), (unsigned)CPU_COUNT(&was));
    if (CPU_COUNT(&was) < 2)
        skip(); /* one core already: nothing to narrow */
    const char *test_shards = getenv("TALLYD_TEST_SHARDS");
    char *saved = test_shards ? strdup(test_shards) : NULL;
    unsetenv("TALLYD_TEST_SHARDS");
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &was)) {
            CPU_SET(c, &one);
            break;
        }
    assert_int_equal(sched_setaffinity(0, sizeof one, &one), 0);
    td_config_t cfg;
    td_config_init(&cfg);
    unsigned cores = td_config_cores(), shards = td_config_shards(&cfg),
             io = td_config_io_threads(&cfg);
    assert_int_equal(sched_setaffinity(0, sizeof was, &was), 0);
    if (saved)
        setenv("TALLYD_TEST_SHARDS", saved, 1);
    free(saved);
    td_config_clear(&cfg);
    assert_int_equal(cores, 1);
    assert_int_equal(shards, 1);
    assert_int_equal(io, TD_IO_THREADS_MIN);
}

/* How values are shown: none as (none) in a log and as nothing in a document; a group unset as
 * -1 in a log. Names: a setting of [server] by its key, of another section with it, of the
 * command line alone by its option. An action takes no value; an option nobody has is NULL. */
static void test_shown_and_named(void **state)
{
    (void)state;
    td_config_t a, b;
    td_config_init(&a);
    td_config_init(&b);
    char shown[128];
    td_setting_format(row("shm-allow-uids"), &a, false, shown, sizeof shown);
    assert_string_equal(shown, "(none)");
    td_setting_format(row("shm-allow-uids"), &a, true, shown, sizeof shown);
    assert_string_equal(shown, "");
    td_setting_format(row("bind"), &a, true, shown, sizeof shown);
    assert_string_equal(shown, TD_DEFAULT_ENDPOINT);
    td_setting_format(row("state-dir"), &a, false, shown, sizeof shown);
    assert_string_equal(shown, "(none)");
    td_setting_format(row("state-dir"), &a, true, shown, sizeof shown);
    assert_string_equal(shown, "");
    td_setting_format(row("shm-socket-group"), &a, false, shown, sizeof shown);
    assert_string_equal(shown, "-1");
    td_setting_format(row("shm-socket-group"), &a, true, shown, sizeof shown);
    assert_string_equal(shown, "");
    td_setting_format(row("max-state-bytes"), &a, true, shown, sizeof shown);
    assert_string_equal(shown, "2G");

    td_setting_name(row("max-batch"), shown, sizeof shown);
    assert_string_equal(shown, "max_batch");
    td_setting_name(row("shm"), shown, sizeof shown);
    assert_string_equal(shown, "shm enabled");
    td_setting_name(row("config"), shown, sizeof shown);
    assert_string_equal(shown, "config");
    assert_null(td_setting_by_option("no-such-option"));

    /* An action: no value, the same in any two configurations, nothing to copy. */
    assert_int_equal(set(&a, "help", ""), TD_ERR_CONFIG);
    assert_true(td_setting_same(row("help"), &a, &b));
    assert_int_equal(td_setting_copy(row("help"), &a, &b), TD_OK);
    /* Strings: one set and one not are not the same; copied, they are. */
    assert_int_equal(set(&b, "state-dir", "/var/lib/x"), TD_OK);
    assert_false(td_setting_same(row("state-dir"), &a, &b));
    assert_false(td_setting_same(row("state-dir"), &b, &a));
    assert_int_equal(td_setting_copy(row("state-dir"), &a, &b), TD_OK);
    assert_true(td_setting_same(row("state-dir"), &a, &b));
    td_config_clear(&a);
    td_config_clear(&b);

    assert_string_equal(td_err_name(TD_ERR_IO), "io");
    assert_string_equal(td_err_name((td_err_t)99), "unknown");
    assert_int_equal(td_err_exit_code(TD_OK), 0);
    assert_int_equal(td_err_exit_code(TD_ERR_CONFIG), 2);
    assert_int_equal(td_err_exit_code(TD_ERR_BIND), 1);
}

/* A line longer than the log's buffer is cut to one line of 1023 bytes, written at once, never
 * split in two; a level above the one set writes nothing. */
static void test_long_log_line(void **state)
{
    (void)state;
    char path[128];
    snprintf(path, sizeof path, "%s/log", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    int saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_int_equal(dup2(fd, STDERR_FILENO), STDERR_FILENO);
    char *text = malloc(3000);
    memset(text, 'w', 2999);
    text[2999] = '\0';
    td_log_set_level(TD_LOG_INFO);
    td_debug("not written at info");
    td_info("%s", text);
    assert_int_equal(dup2(saved, STDERR_FILENO), STDERR_FILENO);
    close(saved);
    close(fd);
    free(text);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[4096];
    size_t got = fread(line, 1, sizeof line - 1, f);
    fclose(f);
    line[got] = '\0';
    assert_int_equal(got, 1023);
    assert_int_equal(line[1022], '\n');
    assert_ptr_equal(strchr(line, '\n'), line + 1022);
    assert_non_null(strstr(line, "wwww"));
    assert_null(strstr(line, "not written"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_in_allow_lists),
        cmocka_unit_test(test_id_lists_compare_and_copy),
        cmocka_unit_test(test_bind_lists_copy),
        cmocka_unit_test(test_command_line_refusals),
        cmocka_unit_test(test_file_refusals),
        cmocka_unit_test(test_load_and_environment),
        cmocka_unit_test(test_man_page_parts),
        cmocka_unit_test(test_local_endpoints_and_binds),
        cmocka_unit_test(test_shard_count),
        cmocka_unit_test(test_default_shards),
        cmocka_unit_test(test_cores_follow_affinity),
        cmocka_unit_test(test_shown_and_named),
        cmocka_unit_test(test_long_log_line),
    };
    return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
