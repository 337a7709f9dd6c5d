/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_readme_tour.c — the tour (docs/tour.md, then docs/histograms.md) runs as written against
 * a fresh tallyd and prints what the pages say it prints (test_readme.sh checks the C examples
 * of the README and docs/, and their prompts).
 *
 * The pages are parsed, never copied: in their sections "# A tour" and "# Looking at
 * histograms", every ```sh block runs, in order, in one scratch folder, through bash, with
 * stdout and stderr together; when a ```text block follows it (blank lines between at most),
 * that is exactly what it must print. A block right after a line "<!-- test_readme_tour: skip"
 * is not run (for an example that needs more than a fresh tallyd). The environment is a new
 * user's: PATH leads to the tally under test, TALLY_ENDPOINT names the tallyd the harness
 * started (CPU backend, defaults otherwise) on a free port, LANG=C.UTF-8 so watch draws blocks.
 *
 * What depends on the clock is normalised on both sides before comparing, so only its form is
 * checked (a line whose form changed no longer matches, and fails):
 *   "pong 0.455 ms"                                    -> "pong T ms"
 *   "window     15:39:11.000 - 15:39:20.276 UTC (9.276 s), 367k values/s" -> "window     T"
 *   watch's title line, "...  linear  15:39:23"        -> "...  linear  T"
 *   "tcp://127.0.0.1:5555" (any port)                  -> "tcp://127.0.0.1:PORT"
 * and spaces at the ends of lines go (watch's bars pad their lines; editors strip them).
 *
 * TALLY_README_ACTUAL=FILE writes what every block printed to FILE, each after a line
 * "=== block N", and does not fail on a difference: that is how the README's blocks are
 * brought up to date after a change of output (then read the diff).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <regex.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#if !defined(TALLY_TOUR_MD) || !defined(TALLY_HISTOGRAMS_MD)
#error "TALLY_TOUR_MD and TALLY_HISTOGRAMS_MD must name the tour's pages"
#endif

#define SKIP_MARK "<!-- test_readme_tour: skip"

typedef struct {
    char *cmd;    /* the ```sh block's lines */
    char *expect; /* the ```text block after it, or NULL */
    int line;     /* where the sh block starts in the README */
} block_t;

static th_daemon_t daemon_;
static char dir[64];

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(dir, sizeof dir, "tally-tour") != 0)
        return -1;
    const char *args[] = {"--backend", "cpu", NULL};
    return th_daemon_start(&daemon_, args);
}

static int teardown(void **state)
{
    (void)state;
    return th_daemon_teardown(&daemon_, 20000, dir);
}

/* ---- The README's blocks -------------------------------------------------------------------- */

static bool starts(const char *line, const char *prefix)
{
    return strncmp(line, prefix, strlen(prefix)) == 0;
}

static bool tour_section(const char *heading)
{
    return !strcmp(heading, "# A tour") || !strcmp(heading, "# Looking at histograms");
}

/* Appends the fence's lines after lines[*i] up to the closing ``` (moved past it). */
static char *fenced(char **lines, size_t n, size_t *i)
{
    size_t cap = 1, len = 0;
    for (size_t j = *i + 1; j < n && !starts(lines[j], "```"); j++)
        cap += strlen(lines[j]) + 1;
    char *text = calloc(1, cap);
    assert_non_null(text);
    for ((*i)++; *i < n && !starts(lines[*i], "```"); (*i)++)
        len += (size_t)sprintf(text + len, "%s\n", lines[*i]);
    return text;
}

/* The tour's sh blocks, each with the text block that follows it. */
static size_t parse_tour(char *readme, block_t *blocks, size_t max)
{
    static char *lines[4096];
    size_t n = 0, count = 0;
    for (char *p = readme; p && *p && n < 4096;) {
        lines[n++] = p;
        p = strchr(p, '\n');
        if (p)
            *p++ = '\0';
    }
    bool in_tour = false, skip = false;
    for (size_t i = 0; i < n; i++) {
        if (starts(lines[i], "# "))
            in_tour = tour_section(lines[i]);
        if (!in_tour)
            continue;
        if (starts(lines[i], SKIP_MARK))
            skip = true;
        if (!starts(lines[i], "```sh")) {
            if (lines[i][0] && !starts(lines[i], SKIP_MARK))
                skip = false; /* the mark holds for the block right after it */
            continue;
        }
        int at = (int)i + 1;
        char *cmd = fenced(lines, n, &i);
        size_t k = i + 1;
        while (k < n && !lines[k][0])
            k++;
        char *expect = k < n && starts(lines[k], "```text") ? fenced(lines, n, &k) : NULL;
        if (expect)
            i = k;
        if (skip || count == max) {
            free(cmd);
            free(expect);
            skip = false;
            continue;
        }
        blocks[count++] = (block_t){.cmd = cmd, .expect = expect, .line = at};
    }
    return count;
}

/* ---- Normalising what depends on the clock ----------------------------------------------------
 */

typedef struct {
    const char *pattern; /* POSIX ERE */
    const char *replacement;
} rule_t;

static const rule_t rules[] = {
    {"pong [0-9]+\\.[0-9]+ ms", "pong T ms"},
    {"^window     [0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3} - [0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3} "
     "UTC \\([0-9]+\\.[0-9]{3} s\\), [0-9.]+[kMGTPE]? values/s$",
     "window     T"},
    {"^(tally watch  .*  (linear|log))  [0-9]{2}:[0-9]{2}:[0-9]{2}", "\\1  T"},
    {"tcp://127\\.0\\.0\\.1:[0-9]+", "tcp://127.0.0.1:PORT"},
};

/* One rule over one line, every match: the replacement, where "\1" is the first group. */
static void apply_rule(const rule_t *rule, const regex_t *re, char *line, size_t cap)
{
    char out[8192];
    size_t len = 0, at = 0, n = strlen(line);
    regmatch_t m[2];
    while (at <= n && regexec(re, line + at, 2, m, at ? REG_NOTBOL : 0) == 0) {
        size_t from = at + (size_t)m[0].rm_so, to = at + (size_t)m[0].rm_eo;
        len += (size_t)snprintf(out + len, sizeof out - len, "%.*s", (int)(from - at), line + at);
        for (const char *r = rule->replacement; *r && len < sizeof out - 1; r++) {
            if (r[0] == '\\' && r[1] == '1' && m[1].rm_so >= 0) {
                len += (size_t)snprintf(out + len, sizeof out - len, "%.*s",
                                        (int)(m[1].rm_eo - m[1].rm_so), line + at + m[1].rm_so);
                r++;
            } else {
                out[len++] = *r;
            }
        }
        at = to > from ? to : to + 1;
    }
    if (at == 0)
        return; /* no match */
    if (at < n)
        len += (size_t)snprintf(out + len, sizeof out - len, "%s", line + at);
    out[len < sizeof out ? len : sizeof out - 1] = '\0';
    snprintf(line, cap, "%s", out);
}

/* The text with every rule applied to every line; malloc'ed. */
static char *normalise(const char *text)
{
    static regex_t re[sizeof rules / sizeof rules[0]];
    static bool compiled;
    if (!compiled) {
        for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++)
            assert_int_equal(regcomp(&re[r], rules[r].pattern, REG_EXTENDED | REG_NEWLINE), 0);
        compiled = true;
    }
    size_t cap = strlen(text) + 1 + 64 * 1024, len = 0;
    char *out = calloc(1, cap);
    assert_non_null(out);
    for (const char *p = text; *p;) {
        const char *end = strchr(p, '\n');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        char line[8192];
        snprintf(line, sizeof line, "%.*s", (int)n, p);
        for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++)
            apply_rule(&rules[r], &re[r], line, sizeof line);
        for (size_t e = strlen(line); e > 0 && line[e - 1] == ' ';)
            line[--e] = '\0';
        len += (size_t)snprintf(out + len, cap - len, "%s%s", line, end ? "\n" : "");
        p = end ? end + 1 : p + n;
    }
    return out;
}

/* ---- Running the blocks -----------------------------------------------------------------------
 */

/* What the block prints (stdout and stderr), run by bash in the scratch folder. */
static char *run_block(const block_t *b, int index)
{
    char script[32], cmd[512], out[128];
    snprintf(script, sizeof script, "block-%02d.sh", index);
    assert_int_equal(th_write_file(dir, script, b->cmd, strlen(b->cmd)), 0);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && timeout 240 bash --noprofile --norc %s > block.out 2>&1 < /dev/null", dir,
             script);
    int rc = system(cmd);
    (void)rc; /* a block's status shows in its output ("exit $?") where it matters */
    snprintf(out, sizeof out, "%s/block.out", dir);
    char *text = th_slurp(out);
    assert_non_null(text);
    return text;
}

/* A new user's environment: the tally under test first on PATH, the harness's tallyd. */
static void tour_environment(void)
{
    const char *tally = th_tally_bin();
    char bin[512], path[4096];
    snprintf(bin, sizeof bin, "%s", tally);
    char *slash = strrchr(bin, '/');
    if (slash)
        *slash = '\0';
    snprintf(path, sizeof path, "%s:%s", slash ? bin : ".", getenv("PATH") ? getenv("PATH") : "");
    setenv("PATH", path, 1);
    setenv("TALLY_ENDPOINT", daemon_.endpoint, 1);
    setenv("LANG", "C.UTF-8", 1);
    unsetenv("LC_ALL");
    unsetenv("LC_CTYPE");
    unsetenv("COLUMNS");
    unsetenv("LINES");
    setenv("XDG_STATE_HOME", dir, 1);
    setenv("HOME", dir, 1);
}

static void test_tour(void **state)
{
    (void)state;
    char *tour = th_slurp(TALLY_TOUR_MD), *histograms = th_slurp(TALLY_HISTOGRAMS_MD);
    assert_non_null(tour);
    assert_non_null(histograms);
    char *readme = calloc(1, strlen(tour) + strlen(histograms) + 1);
    assert_non_null(readme);
    strcat(strcat(readme, tour), histograms);
    free(tour);
    free(histograms);
    static block_t blocks[256];
    size_t n = parse_tour(readme, blocks, 256);
    print_message("%zu blocks in the README's tour\n", n);
    assert_true(n >= 10);
    tour_environment();
    const char *actual_path = getenv("TALLY_README_ACTUAL");
    FILE *actual = actual_path && *actual_path ? fopen(actual_path, "w") : NULL;
    int failures = 0;
    for (size_t i = 0; i < n; i++) {
        char *got = run_block(&blocks[i], (int)i);
        if (actual)
            fprintf(actual, "=== block %zu (README line %d)\n%s", i, blocks[i].line, got);
        if (blocks[i].expect) {
            char *want = normalise(blocks[i].expect), *have = normalise(got);
            if (strcmp(want, have)) {
                failures++;
                print_error("README line %d: the block\n%s printed\n%s instead of\n%s\n",
                            blocks[i].line, blocks[i].cmd, have, want);
            }
            free(want);
            free(have);
        }
        free(got);
        free(blocks[i].cmd);
        free(blocks[i].expect);
    }
    if (actual)
        fclose(actual);
    free(readme);
    if (!actual)
        assert_int_equal(failures, 0);
}

/* The normaliser itself: the clock's parts go, everything else stays. */
static void test_normalise(void **state)
{
    (void)state;
    char *n = normalise("pong 0.455 ms\n"
                        "window     15:39:11.000 - 15:39:20.276 UTC (9.276 s), 367k values/s\n"
                        "window     15:39:11 - 15:39:20 UTC\n"
                        "tally watch  tcp://127.0.0.1:40123  every 1s  linear  15:39:23\n"
                        "count      1000000   ");
    assert_string_equal(n, "pong T ms\n"
                           "window     T\n"
                           "window     15:39:11 - 15:39:20 UTC\n"
                           "tally watch  tcp://127.0.0.1:PORT  every 1s  linear  T\n"
                           "count      1000000");
    free(n);
    /* The blocks: sh, then its text block; a marked block is skipped; other sections too. */
    char readme[] = "# A tour\n```sh\necho a\n```\n\n```text\na\n```\n"
                    "<!-- test_readme_tour: skip (needs a GPU) -->\n```sh\necho b\n```\n"
                    "```sh\necho c\n```\n"
                    "# The tally command\n```sh\necho d\n```\n```text\nd\n```\n";
    block_t b[4];
    assert_int_equal(parse_tour(readme, b, 4), 2);
    assert_string_equal(b[0].cmd, "echo a\n");
    assert_string_equal(b[0].expect, "a\n");
    assert_string_equal(b[1].cmd, "echo c\n");
    assert_null(b[1].expect);
    for (int i = 0; i < 2; i++) {
        free(b[i].cmd);
        free(b[i].expect);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_normalise),
        cmocka_unit_test(test_tour),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
