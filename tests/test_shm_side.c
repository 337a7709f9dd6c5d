/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_shm_side.c — the shared-memory side channel (daemon/core/td_shm.c, PROTOCOL.md §10) under
 * hostile or careless peers (issue 21), against a real tallyd:
 * - a uid that may not register is refused at accept: a flood of its connections takes no slot
 *   and no descriptor, and an allowed producer still registers (run as root: a child switches to
 *   nobody, 65534; skipped otherwise);
 * - max_connections_per_uid: the connection past it is answered `quota` (op 0) and closed, for
 *   another allowed uid too, while tallyd's own uid still gets in; a uid allowed by its user
 *   name, or by its group's name, or by a supplementary group, is let in as by its number;
 * - refusals past one logged a second are summed in one line;
 * - a connection that registers nothing within register_timeout_ms is closed, one that did is
 *   kept; each connection's deadline counts from its own accept;
 * - a release of another connection's handle, or of an unknown one, is refused and the
 *   connection stays;
 * - a malformed message (bad magic, version, op, reserved byte, short, too long, the wrong number
 *   of descriptors) is answered, echoing its op, and closes the connection; the descriptors that
 *   came with it are closed (tallyd's /proc/PID/fd count returns to where it was), and so are
 *   those of the messages queued behind it;
 * - a side-channel directory another user owns, or others may write, is refused at start;
 * - a second tallyd on a live side-channel path refuses to start (explicit path, the default
 *   path, and a path whose lock file was removed), a stale socket left by a killed tallyd is
 *   replaced.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "shm_side.h"
#include "tally.h"

#define SEALS (F_SEAL_SHRINK | F_SEAL_GROW)
#define NOBODY 65534

static char dir[64];       /* this run's scratch directory (0711: nobody may pass) */
static char sock_path[96]; /* the side channel in it */

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(dir, sizeof dir, "tallyd-shm-side") != 0 || chmod(dir, 0711) != 0)
        return -1;
    snprintf(sock_path, sizeof sock_path, "%s/shm.sock", dir);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return th_rmrf(dir);
}

/* Starts tallyd with its side channel at sock_path, plus extra (NULL-terminated). */
static void start(th_daemon_t *d, const char *const *extra)
{
    const char *const args[] = {"--shm-socket", sock_path, NULL};
    assert_int_equal(th_daemon_start_with(d, args, extra), 0);
}

static int connect_side(void)
{
    int fd = th_side_connect(sock_path);
    assert_true(fd >= 0);
    return fd;
}

/* Registers a sealed 4 KiB memfd on side: the answer's status. */
static int register_4k(int side, th_answer_t *ans)
{
    int fd = th_memfd(4096, SEALS);
    int st = th_side_call(side, TALLY_SHM_OP_REGISTER, "producer", 0, fd, ans);
    close(fd);
    return st;
}

/* Waits (up to 10 s) until the daemon holds at most `most` descriptors: the count it ends
 * with. (At most: a connection of the harness's readiness ping may still be closing.) */
static int wait_fd_count(pid_t pid, int most)
{
    int n = -1;
    for (int i = 0; i < 1000 && (n = th_fd_count(pid)) > most; i++)
        th_sleep_ms(10);
    return n;
}

/* How many lines of d's log contain text. */
static int log_count(const th_daemon_t *d, const char *text)
{
    char *log = th_slurp(d->log_path);
    int n = 0;
    for (const char *at = log; at && (at = strstr(at, text)); at++)
        n++;
    free(log);
    return n;
}

/* Waits (up to 10 s) until d's log holds `want` lines with text. */
static bool wait_log_count(const th_daemon_t *d, const char *text, int want)
{
    for (int i = 0; i < 1000; i++) {
        if (log_count(d, text) >= want)
            return true;
        th_sleep_ms(10);
    }
    return false;
}

/* ---- connections refused at accept ------------------------------------------------------- */

/* In a child that has become uid/gid NOBODY: opens `count` side connections and keeps them,
 * tells the parent on `ready` how many connected, and waits for the parent to close `hold`. */
static gid_t nobody_group; /* a supplementary group nobody_opens joins first (0: none) */

static void nobody_opens(int count, int ready, int hold)
{
    struct rlimit lim = {.rlim_cur = (rlim_t)count + 64, .rlim_max = (rlim_t)count + 64};
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0 ||
        setgroups(nobody_group ? 1 : 0, nobody_group ? &nobody_group : NULL) != 0 ||
        setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
        _exit(2);
    int connected = 0;
    for (int i = 0; i < count; i++)
        connected += th_side_connect(sock_path) >= 0;
    if (write(ready, &connected, sizeof connected) != (ssize_t)sizeof connected)
        _exit(3);
    char x;
    (void)!read(hold, &x, 1); /* until the parent is done: the connections stay open */
    _exit(0);
}

/* Forks nobody_opens; returns its pid and the write end of its hold pipe (close it to end it);
 * *connected is how many of its connections the kernel accepted. */
static pid_t spawn_nobody(int count, int *hold_w, int *connected)
{
    int ready[2], hold[2];
    assert_int_equal(pipe(ready), 0);
    assert_int_equal(pipe(hold), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(ready[0]);
        close(hold[1]);
        nobody_opens(count, ready[1], hold[0]);
    }
    close(ready[1]);
    close(hold[0]);
    assert_int_equal(read(ready[0], connected, sizeof *connected), (ssize_t)sizeof *connected);
    close(ready[0]);
    *hold_w = hold[1];
    return pid;
}

static void end_nobody(pid_t pid, int hold_w)
{
    close(hold_w);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Starts tallyd with the socket's group nobody's and `extra`; nobody opens `count` side
 * connections and keeps them; tallyd holds at most `kept` of them (its descriptors), and a
 * producer of tallyd's own uid still registers a region. Returns with tallyd running. */
static void nobody_round(th_daemon_t *d, int count, int kept);

static void nobody_keeps_no_one_out(th_daemon_t *d, const char *const *extra, int count, int kept)
{
    char group[16];
    snprintf(group, sizeof group, "%d", NOBODY); /* nobody can reach the socket */
    const char *args[16] = {"--shm-socket-group", group};
    int argc = 2;
    for (int i = 0; extra[i] && argc < 15; i++)
        args[argc++] = extra[i];
    args[argc] = NULL;
    start(d, args);
    nobody_round(d, count, kept);
}

/* nobody opens `count` side connections and keeps them; tallyd (running) holds at most `kept`
 * of them, and a producer of tallyd's own uid still registers a region. */
static void nobody_round(th_daemon_t *d, int count, int kept)
{
    /* A first producer, kept: whatever tallyd opens on its first side connection is in base. */
    th_answer_t ans;
    int first = connect_side();
    assert_int_equal(register_4k(first, &ans), TALLY_OK);
    int base = th_fd_count(d->pid);
    int hold, connected = 0;
    pid_t child = spawn_nobody(count, &hold, &connected);
    assert_int_equal(connected, count);
    /* Accepted after all of nobody's (the backlog is in order): once it is answered, tallyd
     * has taken or refused each of them (and closed the memfd it sent, before answering). */
    int side = connect_side();
    assert_int_equal(register_4k(side, &ans), TALLY_OK);
    assert_true(th_fd_count(d->pid) <= base + kept + 1); /* + 1: this one */
    close(side);
    close(first);
    end_nobody(child, hold);
}

/* 1,100 connections of a uid that may not register (more than tallyd's 1,024 slots): each is
 * refused at accept, none keeps a descriptor in tallyd, and an allowed producer registers.
 * Neither the per-uid cap nor the register timeout may be what frees the slots. */
static void test_not_allowed_flood(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip(); /* switching to nobody needs root (as in CI) */
    th_daemon_t d;
    static const char *const args[] = {"--shm-max-connections-per-uid", "1024",
                                       "--shm-register-timeout-ms", "3600000", NULL};
    nobody_keeps_no_one_out(&d, args, 1100, 0);
    assert_true(th_daemon_log_contains(&d, "uid 65534 refused: uid 65534 gid 65534 may not"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Refusals beyond one logged a second are summed up in one line when the next second's first
 * comes (bursts until a second boundary falls after a burst). */
static void test_refusals_summed(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    th_daemon_t d;
    static const char *const args[] = {"--shm-register-timeout-ms", "3600000", NULL};
    nobody_keeps_no_one_out(&d, args, 20, 0);
    for (int round = 0; round < 4 && !th_daemon_log_contains(&d, "more side connections refused");
         round++) {
        th_sleep_ms(1100);
        nobody_round(&d, 20, 0);
    }
    assert_true(th_daemon_log_contains(&d, "more side connections refused, not logged"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* A uid let in by a supplementary group of its (SO_PEERGROUPS) in shm_allow_gids (root only). */
static void test_supplementary_group_allowed(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    nobody_group = 4242;
    th_daemon_t d;
    static const char *const args[] = {"--shm-allow-gids",
                                       "4242",
                                       "--shm-max-connections-per-uid",
                                       "3",
                                       "--shm-register-timeout-ms",
                                       "3600000",
                                       NULL};
    nobody_keeps_no_one_out(&d, args, 5, 3);
    nobody_group = 0;
    assert_true(th_daemon_log_contains(&d, "uid 65534 already holds 3 side-channel"));
    assert_false(th_daemon_log_contains(&d, "may not register"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* A uid whose groups (its own and its supplementary one) are none of shm_allow_gids is refused
 * at accept, as a stranger (root only). */
static void test_supplementary_group_not_allowed(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    nobody_group = 4343;
    th_daemon_t d;
    static const char *const args[] = {"--shm-allow-gids", "4242", "--shm-register-timeout-ms",
                                       "3600000", NULL};
    nobody_keeps_no_one_out(&d, args, 3, 0);
    nobody_group = 0;
    assert_true(th_daemon_log_contains(&d, "uid 65534 gid 65534 may not register"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* tallyd's own cap of 1,024 side connections, whatever the per-uid caps allow: nobody (allowed)
 * holds 40, tallyd's own uid opens 1,000, and those past the 1,024th are answered `quota` for
 * tallyd's maximum (op 0) and closed, not for their uid's cap (root only). */
static void test_connections_max(void **state)
{
    (void)state;
    struct rlimit lim;
    if (geteuid() != 0 || getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_max < 2200)
        skip();
    if (lim.rlim_cur < 2200) { /* ours and tallyd's (inherited): 1,040 connections each */
        lim.rlim_cur = 2200;
        assert_int_equal(setrlimit(RLIMIT_NOFILE, &lim), 0);
    }
    char uid[16], group[16];
    snprintf(uid, sizeof uid, "%d", NOBODY);
    snprintf(group, sizeof group, "%d", NOBODY);
    const char *const args[] = {"--shm-allow-uids",
                                uid,
                                "--shm-socket-group",
                                group,
                                "--shm-max-connections-per-uid",
                                "1024",
                                "--shm-register-timeout-ms",
                                "3600000",
                                NULL};
    th_daemon_t d;
    start(&d, args);
    int hold, connected = 0;
    pid_t child = spawn_nobody(40, &hold, &connected);
    assert_int_equal(connected, 40);
    enum { OWN = 1000 };
    static int sides[OWN];
    for (int i = 0; i < OWN; i++)
        sides[i] = connect_side();
    th_answer_t ans;
    assert_int_equal(th_side_recv(sides[OWN - 1], &ans, 10000), 1); /* unasked, at accept */
    assert_int_equal(ans.a.status, TALLY_E_QUOTA);
    assert_int_equal(ans.a.op, 0);
    assert_non_null(strstr(ans.msg, "tallyd already serves its maximum of 1024 side-channel"));
    assert_true(th_side_closed(sides[OWN - 1], 5000));
    assert_int_equal(register_4k(sides[0], &ans), TALLY_OK); /* the first ones are served */
    for (int i = 0; i < OWN; i++)
        close(sides[i]);
    end_nobody(child, hold);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* The connection past max_connections_per_uid: one answer, `quota` with op 0, then closed. */
static void expect_quota_refusal(void)
{
    int side = connect_side();
    th_answer_t ans;
    assert_int_equal(th_side_recv(side, &ans, 5000), 1); /* sent unasked, at accept */
    assert_int_equal(ans.a.status, TALLY_E_QUOTA);
    assert_int_equal(ans.a.op, 0);
    assert_non_null(strstr(ans.msg, "max_connections_per_uid"));
    assert_true(th_side_closed(side, 5000));
    close(side);
}

static void test_per_uid_cap(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *const args[] = {"--shm-max-connections-per-uid", "3", NULL};
    start(&d, args);
    th_answer_t ans;
    int sides[3];
    for (int i = 0; i < 3; i++)
        sides[i] = connect_side();
    assert_int_equal(register_4k(sides[0], &ans), TALLY_OK); /* all three were taken */
    expect_quota_refusal();
    assert_int_equal(register_4k(sides[2], &ans), TALLY_OK); /* the three are served */
    close(sides[1]);
    /* Once tallyd has seen that close, there is room for one more. */
    int again = -1;
    for (int i = 0; i < 500 && again < 0; i++) {
        int side = connect_side();
        if (register_4k(side, &ans) == TALLY_OK) {
            again = side;
        } else {
            assert_int_equal(ans.a.status, TALLY_E_QUOTA);
            close(side);
            th_sleep_ms(10);
        }
    }
    assert_true(again >= 0);
    close(again);
    close(sides[0]);
    close(sides[2]);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Another allowed uid at its cap (it holds 3 of its 50) does not keep tallyd's own uid out
 * (root only). The register timeout is not what closes the others. */
static void test_per_uid_cap_other_uid(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    th_daemon_t d;
    char uid[16];
    snprintf(uid, sizeof uid, "%d", NOBODY);
    const char *const args[] = {
        "--shm-allow-uids", uid, "--shm-max-connections-per-uid", "3", "--shm-register-timeout-ms",
        "3600000",          NULL};
    nobody_keeps_no_one_out(&d, args, 50, 3);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Users and groups by name in the allow-lists (issue 37): nobody's user name, then its group's
 * name, lets nobody in as its number does (root only): its connections are taken up to the
 * per-uid cap (the one past it is refused for the cap, not as a stranger). The names are this
 * system's for uid and gid 65534. */
static void test_allowed_by_name(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    struct passwd *pw = getpwuid(NOBODY);
    struct group *gr = getgrgid(NOBODY);
    if (!pw || !gr) {
        print_message("no name for uid or gid %d here: skipped\n", NOBODY);
        skip();
    }
    char user[64], group[64];
    snprintf(user, sizeof user, "%s", pw->pw_name);
    snprintf(group, sizeof group, "%s", gr->gr_name);
    const char *lists[] = {"--shm-allow-uids", "--shm-allow-gids"};
    const char *names[] = {user, group};
    for (int i = 0; i < 2; i++) {
        th_daemon_t d;
        const char *const args[] = {
            lists[i],  names[i], "--shm-max-connections-per-uid", "3", "--shm-register-timeout-ms",
            "3600000", NULL};
        nobody_keeps_no_one_out(&d, args, 5, 3);
        assert_true(th_daemon_log_contains(&d, "uid 65534 already holds 3 side-channel"));
        assert_false(th_daemon_log_contains(&d, "may not register"));
        assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    }
}

/* ---- register timeout -------------------------------------------------------------------- */

static void test_register_timeout(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *const args[] = {"--shm-register-timeout-ms", "200", "--shm-max-bytes", "64K", NULL};
    start(&d, args);
    const char *closed = "no region registered within 200 ms";
    int idle = connect_side(), busy = connect_side();
    th_answer_t ans;
    assert_int_equal(register_4k(busy, &ans), TALLY_OK);
    uint64_t handle = ans.a.handle;
    assert_true(th_side_closed(idle, 10000)); /* closed by tallyd, unasked */
    close(idle);
    assert_true(wait_log_count(&d, closed, 1));
    /* The one that registered is still served, long after the deadline, even once it holds no
     * region any more. */
    assert_int_equal(th_side_call(busy, TALLY_SHM_OP_RELEASE, NULL, handle, -1, &ans), TALLY_OK);
    th_sleep_ms(600);
    assert_int_equal(register_4k(busy, &ans), TALLY_OK);
    close(busy);
    /* libtally: a registration refused (quota) leaves its side connection idle, tallyd closes
     * it, and the next registration opens a new one. */
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(d.endpoint, 5000, &c), TALLY_OK);
    tally_region_t *r = NULL;
    assert_int_equal(tally_region_create(c, 1 << 20, &r), TALLY_E_QUOTA);
    assert_true(wait_log_count(&d, closed, 2));
    assert_int_equal(tally_region_create(c, 4096, &r), TALLY_OK);
    tally_region_destroy(&r);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Each connection gets its own register_timeout_ms from its accept: those accepted after the
 * first (one 300 ms later, two together 600 ms later, taken while tallyd was stopped) are not
 * closed when the first's deadline passes, and each is closed once its own has. */
static void test_register_timeout_each(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *const args[] = {"--shm-register-timeout-ms", "1000", NULL};
    start(&d, args);
    int side[4];
    int64_t at[4];
    at[0] = th_now_ms();
    side[0] = connect_side();
    th_sleep_ms(300);
    at[1] = th_now_ms();
    side[1] = connect_side();
    th_sleep_ms(300);
    assert_int_equal(kill(d.pid, SIGSTOP), 0); /* the next two are accepted at once */
    side[2] = connect_side();
    side[3] = connect_side();
    at[2] = at[3] = th_now_ms();
    assert_int_equal(kill(d.pid, SIGCONT), 0);
    for (int i = 0; i < 4; i++) {
        assert_true(th_side_closed(side[i], 10000));
        /* 950: libuv's loop clock may be the coarse one, a few ms behind; a connection closed
         * at the first's deadline would be at 700 ms (side[1]) or 400 ms (side[2], side[3]). */
        if (th_now_ms() - at[i] < 950)
            fail_msg("connection %d closed %d ms after its accept", i, (int)(th_now_ms() - at[i]));
        close(side[i]);
    }
    assert_true(wait_log_count(&d, "no region registered within 1000 ms", 4));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Releases refused (PROTOCOL.md §10): another connection's handle, and an unknown one, are
 * answered bad_ref and the connection stays; the other connection's region is untouched. */
static void test_release_not_mine(void **state)
{
    (void)state;
    th_daemon_t d;
    start(&d, NULL);
    int a = connect_side(), b = connect_side();
    th_answer_t ans;
    assert_int_equal(register_4k(a, &ans), TALLY_OK);
    uint64_t ha = ans.a.handle;
    assert_int_equal(th_side_call(b, TALLY_SHM_OP_RELEASE, NULL, ha, -1, &ans), TALLY_E_BAD_REF);
    assert_int_equal(ans.a.handle, ha);
    assert_non_null(strstr(ans.msg, "is not a region of this connection"));
    assert_int_equal(th_side_call(b, TALLY_SHM_OP_RELEASE, NULL, ha ^ 1, -1, &ans),
                     TALLY_E_BAD_REF);
    assert_int_equal(register_4k(b, &ans), TALLY_OK); /* b still served */
    assert_int_equal(th_side_call(a, TALLY_SHM_OP_RELEASE, NULL, ha, -1, &ans), TALLY_OK);
    assert_int_equal(ans.a.size, 4096);
    close(a);
    close(b);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- malformed messages ------------------------------------------------------------------ */

typedef struct {
    const char *what;
    int len;         /* bytes sent */
    int byte, value; /* one byte of a good register header changed (-1: none) */
    uint8_t op;      /* the op of the message */
    int nfds;        /* memfds attached */
    uint32_t status; /* the answer's */
    uint8_t echo;    /* the answer's op */
} malformed_t;

static const malformed_t malformed[] = {
    {"bad magic", 16 + 1, 0, 'X', TALLY_SHM_OP_REGISTER, 1, TALLY_E_MAGIC, TALLY_SHM_OP_REGISTER},
    {"bad magic, release", 16, 1, 'X', TALLY_SHM_OP_RELEASE, 0, TALLY_E_MAGIC,
     TALLY_SHM_OP_RELEASE},
    {"bad version", 16 + 1, 4, 9, TALLY_SHM_OP_REGISTER, 1, TALLY_E_VERSION, TALLY_SHM_OP_REGISTER},
    {"bad op", 16 + 1, 5, 7, TALLY_SHM_OP_REGISTER, 1, TALLY_E_OPCODE, 7},
    {"reserved byte", 16 + 1, 7, 1, TALLY_SHM_OP_REGISTER, 1, TALLY_E_PARAM, TALLY_SHM_OP_REGISTER},
    {"short", 10, -1, 0, TALLY_SHM_OP_REGISTER, 1, TALLY_E_HEADER, 0},
    {"too long", 300, -1, 0, TALLY_SHM_OP_REGISTER, 1, TALLY_E_HEADER, TALLY_SHM_OP_REGISTER},
    {"two descriptors", 16 + 1, -1, 0, TALLY_SHM_OP_REGISTER, 2, TALLY_E_PARAM,
     TALLY_SHM_OP_REGISTER},
    {"a descriptor on a release", 16, -1, 0, TALLY_SHM_OP_RELEASE, 1, TALLY_E_PARAM,
     TALLY_SHM_OP_RELEASE},
    {"six descriptors", 16 + 1, -1, 0, TALLY_SHM_OP_REGISTER, 6, TALLY_E_HEADER,
     TALLY_SHM_OP_REGISTER},
};

/* Sends m on a new connection: the answer is as expected, the connection ends, and tallyd's
 * descriptors are as many as before it (the memfds sent closed too). */
static void send_malformed(const th_daemon_t *d, const malformed_t *m)
{
    int base = th_fd_count(d->pid);
    int side = connect_side();
    uint8_t buf[TALLY_SHM_MSG_MAX] = {0};
    tally_shm_msg_t msg = {.op = m->op, .handle = m->op == TALLY_SHM_OP_RELEASE ? 42 : 0};
    if (m->op == TALLY_SHM_OP_REGISTER) {
        msg.id_len = 1;
        msg.id[0] = 'p';
    }
    tally_shm_msg_encode(&msg, buf);
    if (m->byte >= 0)
        buf[m->byte] = (uint8_t)m->value;
    int fds[6];
    for (int i = 0; i < m->nfds; i++)
        fds[i] = th_memfd(4096, SEALS);
    assert_int_equal(th_side_send_raw(side, buf, (size_t)m->len, fds, m->nfds), 0);
    for (int i = 0; i < m->nfds; i++)
        close(fds[i]);
    th_answer_t ans;
    if (th_side_recv(side, &ans, 5000) != 1)
        fail_msg("%s: no answer", m->what);
    if (ans.a.status != m->status || ans.a.op != m->echo)
        fail_msg("%s: answered %s op %u (%s), expected %s op %u", m->what,
                 tally_status_name((tally_status_t)ans.a.status), ans.a.op, ans.msg,
                 tally_status_name((tally_status_t)m->status), m->echo);
    if (!th_side_closed(side, 5000))
        fail_msg("%s: the connection stayed open", m->what);
    close(side);
    int now = wait_fd_count(d->pid, base);
    if (now > base)
        fail_msg("%s: tallyd holds %d descriptors, %d before", m->what, now, base);
}

static void test_malformed_closes(void **state)
{
    (void)state;
    th_daemon_t d;
    /* The connections close for their message, not for registering nothing in time. */
    const char *const args[] = {"--shm-register-timeout-ms", "3600000", NULL};
    start(&d, args);
    for (size_t i = 0; i < sizeof malformed / sizeof malformed[0]; i++)
        send_malformed(&d, &malformed[i]);
    /* Still serving. */
    th_answer_t ans;
    int side = connect_side();
    assert_int_equal(register_4k(side, &ans), TALLY_OK);
    close(side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* A malformed message with a register queued behind it (tallyd stopped while both are sent):
 * the malformed one is answered, the connection closes, and the queued register's memfd is
 * closed with the rest of the queue (a release too), neither answered. */
static void test_malformed_drops_queue(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *const args[] = {"--shm-register-timeout-ms", "3600000", NULL};
    start(&d, args);
    int base = th_fd_count(d.pid);
    assert_int_equal(kill(d.pid, SIGSTOP), 0);
    int side = connect_side(); /* in the backlog until tallyd runs again */
    uint8_t buf[TALLY_SHM_MSG_MAX] = {0};
    tally_shm_msg_t msg = {.op = TALLY_SHM_OP_REGISTER, .id_len = 1, .id = {'p'}};
    tally_shm_msg_encode(&msg, buf);
    buf[0] = 'X'; /* bad magic */
    assert_int_equal(th_side_send_raw(side, buf, 17, NULL, 0), 0);
    int fd = th_memfd(4096, SEALS);
    assert_int_equal(th_side_send(side, TALLY_SHM_OP_REGISTER, "p", 0, fd), 0);
    assert_int_equal(th_side_send(side, TALLY_SHM_OP_RELEASE, NULL, 42, -1), 0);
    close(fd);
    assert_int_equal(kill(d.pid, SIGCONT), 0);
    th_answer_t ans;
    assert_int_equal(th_side_recv(side, &ans, 5000), 1);
    assert_int_equal(ans.a.status, TALLY_E_MAGIC);
    assert_int_equal(th_side_recv(side, &ans, 5000), 0); /* no answer to the register: the end */
    close(side);
    assert_true(wait_fd_count(d.pid, base) <= base);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- two tallyds, one path --------------------------------------------------------------- */

/* Runs tallyd with args (and RUNTIME_DIRECTORY=runtime when not NULL) until it exits, at most
 * 20 s; returns its exit status (-1 when it did not exit: then it is killed) and leaves its stderr
 * in dir/second.log. */
static int run_second(const char *const *args, const char *runtime)
{
    char log[128];
    snprintf(log, sizeof log, "%s/second.log", dir);
    char bind[96]; /* ipc:// in dir: no TCP port another process could take first */
    snprintf(bind, sizeof bind, "ipc://%s/second.sock", dir);
    const char *argv[16] = {th_tallyd_bin(), "--bind", bind, "--backend", "cpu"};
    int argc = 5;
    for (int i = 0; args && args[i] && argc < 15; i++)
        argv[argc++] = args[i];
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (runtime)
            setenv("RUNTIME_DIRECTORY", runtime, 1);
        if (!freopen(log, "w", stderr) || !freopen("/dev/null", "w", stdout))
            _exit(126);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    th_daemon_t d = {.pid = pid};
    int status = th_daemon_wait(&d, 20000);
    return status;
}

static bool second_log_contains(const char *text)
{
    th_daemon_t d = {0};
    snprintf(d.log_path, sizeof d.log_path, "%s/second.log", dir);
    return th_daemon_log_contains(&d, text);
}

/* The first tallyd still serves its side channel (a region registers). */
static void assert_still_serving(void)
{
    th_answer_t ans;
    int side = connect_side();
    assert_int_equal(register_4k(side, &ans), TALLY_OK);
    close(side);
}

/* A side-channel directory that another user owns, or that others may write without the sticky
 * bit: tallyd refuses to put its socket there (another user could replace it) and to start. */
static void test_socket_dir_refused(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip(); /* giving the directory to nobody needs root */
    char sub[96], path[128], want[160];
    const mode_t modes[] = {0755, 0777};
    for (int i = 0; i < 2; i++) {
        snprintf(sub, sizeof sub, "%s/dir%d", dir, i);
        assert_int_equal(mkdir(sub, modes[i]), 0);
        assert_int_equal(chmod(sub, modes[i]), 0); /* whatever the umask */
        if (i == 0)
            assert_int_equal(chown(sub, NOBODY, NOBODY), 0);
        snprintf(path, sizeof path, "%s/shm.sock", sub);
        const char *args[] = {"--shm-socket", path, NULL};
        assert_int_not_equal(run_second(args, NULL), 0);
        snprintf(want, sizeof want, "%s is not a directory owned by tallyd's user or root", sub);
        assert_true(second_log_contains(want));
    }
}

/* A directory that others may write but with the sticky bit (as /tmp): no other user can
 * replace tallyd's socket there, and tallyd serves from it. */
static void test_socket_dir_sticky(void **state)
{
    (void)state;
    char sub[80], saved[sizeof sock_path];
    snprintf(sub, sizeof sub, "%s/sticky", dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    assert_int_equal(chmod(sub, 01777), 0);
    memcpy(saved, sock_path, sizeof saved);
    snprintf(sock_path, sizeof sock_path, "%s/shm.sock", sub);
    th_daemon_t d;
    start(&d, NULL);
    assert_still_serving();
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    memcpy(sock_path, saved, sizeof sock_path);
}

static void set_runtime_directory(const void *path)
{
    setenv("RUNTIME_DIRECTORY", path, 1);
}

/* A side-channel path tallyd cannot use, for any user: a directory that cannot be made, a file
 * where the directory should be, a lock file that is a symbolic link (never followed), a
 * directory where the socket should be. Named (--shm-socket), tallyd says why and does not
 * start; the default path ($RUNTIME_DIRECTORY/tallyd-shm.sock) the same, tallyd serving with
 * shared memory off. */
static void test_socket_path_unusable(void **state)
{
    (void)state;
    char file[96], link_dir[96], lock[160], sock_dir[96], target[128];
    snprintf(file, sizeof file, "%s/afile", dir);
    assert_int_equal(th_write_file(dir, "afile", "x", 1), 0);
    snprintf(link_dir, sizeof link_dir, "%s/linked", dir);
    assert_int_equal(mkdir(link_dir, 0700), 0);
    snprintf(lock, sizeof lock, "%s/shm.sock.lock", link_dir);
    snprintf(target, sizeof target, "%s/elsewhere", dir);
    assert_int_equal(symlink(target, lock), 0);
    snprintf(sock_dir, sizeof sock_dir, "%s/taken", dir);
    assert_int_equal(mkdir(sock_dir, 0700), 0);
    snprintf(target, sizeof target, "%s/shm.sock", sock_dir);
    assert_int_equal(mkdir(target, 0700), 0);
    const struct {
        const char *sub; /* the socket path under dir */
        const char *said, *said_more;
    } cases[] = {
        {"missing/deeper/shm.sock", "shm: cannot create ", "/missing/deeper: No such file"},
        {"afile/shm.sock", "shm: ", "/afile is not a directory owned by tallyd's user or root"},
        {"linked/shm.sock", "shm: cannot open ",
         "/linked/shm.sock.lock: Too many levels of symbolic links"},
        {"taken/shm.sock", "shm: cannot listen on ", "/taken/shm.sock: Address already in use"},
    };
    char path[160], want[256];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, cases[i].sub);
        const char *args[] = {"--shm-socket", path, NULL};
        assert_int_equal(run_second(args, NULL), 1);
        snprintf(want, sizeof want, "%s%s%s", cases[i].said, dir, cases[i].said_more);
        if (!second_log_contains(want))
            fail_msg("case %zu: no '%s' in %s/second.log", i, want, dir);
        assert_false(second_log_contains(" ready: "));
    }
    assert_int_equal(access(target, F_OK), 0); /* the directory in its way left as it was */

    /* The default path in a "runtime directory" that is a file: a warning, and no side channel. */
    char bind[96], log[96];
    snprintf(bind, sizeof bind, "ipc://%s/third.sock", dir);
    snprintf(log, sizeof log, "%s/third.log", dir);
    const char *argv[] = {th_tallyd_bin(), "--bind", bind, "--backend", "cpu", NULL};
    th_daemon_t d = {.pid = th_spawn(argv, log, false, set_runtime_directory, file)};
    snprintf(d.endpoint, sizeof d.endpoint, "%s", bind);
    snprintf(d.log_path, sizeof d.log_path, "%s", log);
    assert_true(d.pid > 0);
    int status;
    assert_int_equal(th_await_pong(bind, d.pid, log, TH_START_WAIT_MS, &status), 1);
    snprintf(want, sizeof want,
             "shm: %s is not a directory owned by tallyd's user or root; shared memory is off",
             file);
    assert_true(th_daemon_log_contains(&d, want));
    void *sock = th_connect(bind, 10000);
    tally_req_t info = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 3);
    th_reply_t reply;
    assert_int_equal(th_call(sock, &info, NULL, 0, &reply), 0);
    assert_non_null(strstr((const char *)reply.payload, "\nshm=off\n"));
    th_reply_free(&reply);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

static void test_second_tallyd_refused(void **state)
{
    (void)state;
    th_daemon_t d;
    start(&d, NULL);
    /* The same explicit path. */
    const char *const same[] = {"--shm-socket", sock_path, NULL};
    assert_int_equal(run_second(same, NULL), 1);
    assert_true(second_log_contains("another tallyd serves the side channel"));
    assert_still_serving();
    /* The lock file removed under the running tallyd: the connection still tells. */
    char lock[128];
    snprintf(lock, sizeof lock, "%s.lock", sock_path);
    assert_int_equal(unlink(lock), 0);
    assert_int_equal(run_second(same, NULL), 1);
    assert_true(second_log_contains("it accepts connections"));
    assert_still_serving();
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);

    /* The default path ($RUNTIME_DIRECTORY/tallyd-shm.sock): refused too, not run without
     * shared memory. */
    snprintf(sock_path, sizeof sock_path, "%s/tallyd-shm.sock", dir);
    start(&d, NULL);
    assert_int_equal(run_second(NULL, dir), 1);
    assert_true(second_log_contains("another tallyd serves the side channel"));
    assert_still_serving();
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    snprintf(sock_path, sizeof sock_path, "%s/shm.sock", dir);
}

/* A tallyd killed with SIGKILL leaves its socket file: the next one replaces it. */
static void test_stale_socket_replaced(void **state)
{
    (void)state;
    th_daemon_t d;
    start(&d, NULL);
    assert_int_equal(th_daemon_stop(&d, SIGKILL, 10000), 128 + SIGKILL);
    assert_int_equal(access(sock_path, F_OK), 0); /* left behind */
    start(&d, NULL);
    assert_still_serving();
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_not_allowed_flood),
        cmocka_unit_test(test_per_uid_cap),
        cmocka_unit_test(test_per_uid_cap_other_uid),
        cmocka_unit_test(test_register_timeout),
        cmocka_unit_test(test_register_timeout_each),
        cmocka_unit_test(test_release_not_mine),
        cmocka_unit_test(test_malformed_drops_queue),
        cmocka_unit_test(test_malformed_closes),
        cmocka_unit_test(test_second_tallyd_refused),
        cmocka_unit_test(test_stale_socket_replaced),
        cmocka_unit_test(test_allowed_by_name),
        cmocka_unit_test(test_refusals_summed),
        cmocka_unit_test(test_supplementary_group_allowed),
        cmocka_unit_test(test_supplementary_group_not_allowed),
        cmocka_unit_test(test_connections_max),
        cmocka_unit_test(test_socket_dir_sticky),
        cmocka_unit_test(test_socket_dir_refused),
        cmocka_unit_test(test_socket_path_unusable),
    };
    const char *only = getenv("TALLY_TEST_FILTER"); /* one test by name (a mutation check) */
    if (only && *only)
        cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, setup, teardown);
}
