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
 *   - copying and comparing id lists (what a reload of allow_uids does).
 * The ASan build checks that nothing leaks or is freed twice.
 */
#include <grp.h>
#include <pwd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_in_allow_lists),
        cmocka_unit_test(test_id_lists_compare_and_copy),
        cmocka_unit_test(test_bind_lists_copy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
