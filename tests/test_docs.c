/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_docs.c PAGE...: the documentation's pages (the README, docs/) run as written
 * against a fresh tallyd and print what they say they print. CTest runs every page, alone or
 * after the pages it continues (docs/histograms.md after docs/tour.md), one test per group
 * (tests/CMakeLists.txt, tally_docs_test; test_docs_index checks that no page is left out).
 * test_readme.sh compiles the pages' C examples and test_python runs their Python.
 *
 * The pages are parsed, never copied: every ```sh block runs, in order, in one scratch folder,
 * through bash, with stdout and stderr together; when a ```text block follows it (blank lines
 * between at most), that is exactly what it must print. The environment is a new user's: PATH
 * leads to the tally and tallyd under test, TALLY_ENDPOINT names the tallyd the harness started
 * (CPU backend, defaults otherwise) on a free port, LANG=C.UTF-8 so watch draws blocks.
 *
 * A page may say, in HTML comments of their own lines (a reader of the rendered page sees none):
 *   <!-- test_docs: tallyd ARGS -->      arguments for the tallyd the pages run against
 *   <!-- test_docs: before COMMANDS -->  run (sh) in the scratch folder before tallyd starts
 *   <!-- test_docs: sub FROM TO -->      in the page's commands, the tallyd arguments and the
 *                                        before commands, FROM reads TO: a host, a port or a path
 *                                        the page shows as a reader would have it, the test's
 *                                        own in its place; in TO, @DIR@ is the scratch folder
 *                                        and @METRICS@ the HTTP port of the tallyd (--metrics
 *                                        127.0.0.1:0)
 *   <!-- test_docs: skip REASON -->      the next sh block is not run; the reason is required and
 *                                        printed (what needs root, systemd or other hosts, and
 *                                        which test runs it instead). A block with sudo or
 *                                        systemctl that is neither skipped nor replaced fails
 *                                        unrun: this test never changes the host
 *   <!-- test_docs: instead              the next sh block needs a person (Ctrl-C): these lines
 *   COMMANDS                             run in its place, and what they print is compared
 *   -->                                  with the text block after it
 *
 * What depends on the clock is normalised on both sides before comparing, so only its form is
 * checked (a line whose form changed no longer matches, and fails):
 *   "pong 0.455 ms"                                    -> "pong T ms"
 *   "window     15:39:11.000 - 15:39:20.276 UTC (9.276 s), 367k values/s" -> "window     T"
 *   watch's title line, "...  linear  15:39:23"        -> "...  linear  T"
 *   "tcp://127.0.0.1:5555" (any port)                  -> "tcp://127.0.0.1:PORT"
 *   JSON's "time_ms":N, "updated_ms":N, "rate":X       -> "time_ms":T, "updated_ms":T, "rate":R
 * and spaces at the ends of lines go (watch's bars pad their lines; editors strip them).
 *
 * TALLY_DOCS_ACTUAL=FILE writes what every block printed to FILE, each after a line
 * "=== block N", and does not fail on a difference: that is how the pages' blocks are brought
 * up to date after a change of output (then read the diff).
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

#define MARK "<!-- test_docs: "
#define MAX_PAGES 16
#define MAX_BLOCKS 256
#define MAX_SUBS 16

typedef struct {
    char *cmd;        /* the ```sh block's lines, or the `instead` lines */
    char *expect;     /* the ```text block after it, or NULL */
    char *skip;       /* why it is not run, or NULL */
    const char *page; /* where it is */
    int line;         /* where the sh block starts in its page */
} block_t;

typedef struct {
    char *from, *to;
} sub_t;

/* What the pages say, gathered before tallyd starts. */
typedef struct {
    block_t blocks[MAX_BLOCKS];
    size_t count;
    sub_t subs[MAX_SUBS];
    size_t nsubs;
    char *tallyd_args[24];
    size_t nargs;
    char *before[8];
    size_t nbefore;
} doc_t;

static const char *pages[MAX_PAGES];
static int npages;
static doc_t doc;
static th_daemon_t daemon_;
static char dir[64];
static int metrics_port = -1;

/* ---- Reading the pages ---------------------------------------------------------------------- */

static bool starts(const char *line, const char *prefix)
{
    return strncmp(line, prefix, strlen(prefix)) == 0;
}

static char *dup_range(const char *from, size_t len)
{
    char *s = calloc(1, len + 1);
    assert_non_null(s);
    memcpy(s, from, len);
    return s;
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

/* The lines after an `instead` mark up to its closing "-->" (moved onto it). */
static char *instead_lines(char **lines, size_t n, size_t *i)
{
    size_t cap = 1, len = 0;
    for (size_t j = *i + 1; j < n && strcmp(lines[j], "-->"); j++)
        cap += strlen(lines[j]) + 1;
    char *text = calloc(1, cap);
    assert_non_null(text);
    for ((*i)++; *i < n && strcmp(lines[*i], "-->"); (*i)++)
        len += (size_t)sprintf(text + len, "%s\n", lines[*i]);
    return text;
}

/* A one-line mark's words after "<!-- test_docs: KEY ", without the " -->"; NULL for another. */
static char *mark_arg(const char *line, const char *key)
{
    size_t at = strlen(MARK);
    if (!starts(line, MARK) || strncmp(line + at, key, strlen(key)) != 0)
        return NULL;
    const char *from = line + at + strlen(key);
    const char *end = strstr(from, " -->");
    assert_non_null(end); /* a one-line mark ends on its line */
    while (*from == ' ')
        from++;
    return dup_range(from, (size_t)(end - from));
}

/* A page-wide mark (tallyd, before, sub) into doc; false for any other line. */
static bool page_mark(doc_t *d, const char *line)
{
    char *arg;
    if ((arg = mark_arg(line, "tallyd "))) {
        for (char *w = strtok(arg, " "); w && d->nargs < 23; w = strtok(NULL, " "))
            d->tallyd_args[d->nargs++] = strdup(w);
        free(arg);
    } else if ((arg = mark_arg(line, "before "))) {
        assert_true(d->nbefore < 8);
        d->before[d->nbefore++] = arg;
    } else if ((arg = mark_arg(line, "sub "))) {
        char *space = strchr(arg, ' ');
        assert_non_null(space); /* sub FROM TO */
        assert_true(d->nsubs < MAX_SUBS);
        d->subs[d->nsubs++] = (sub_t){dup_range(arg, (size_t)(space - arg)), strdup(space + 1)};
        free(arg);
    } else {
        return false;
    }
    return true;
}

/* Frees what parse_page kept in d. */
static void doc_clear(doc_t *d)
{
    for (size_t i = 0; i < d->count; i++) {
        free(d->blocks[i].cmd);
        free(d->blocks[i].expect);
        free(d->blocks[i].skip);
    }
    for (size_t i = 0; i < d->nsubs; i++) {
        free(d->subs[i].from);
        free(d->subs[i].to);
    }
    for (size_t i = 0; i < d->nargs; i++)
        free(d->tallyd_args[i]);
    for (size_t i = 0; i < d->nbefore; i++)
        free(d->before[i]);
    memset(d, 0, sizeof *d);
}

/* Splits text into lines in place; returns how many (at most max). */
static size_t split_lines(char *text, char **lines, size_t max)
{
    size_t n = 0;
    for (char *p = text; p && *p && n < max;) {
        lines[n++] = p;
        p = strchr(p, '\n');
        if (p)
            *p++ = '\0';
    }
    return n;
}

/* The page's marks into doc, and its sh blocks, each with its skip or instead and the text
 * block that follows it. */
static void parse_page(doc_t *d, char *text, const char *page)
{
    static char *lines[8192];
    size_t n = split_lines(text, lines, 8192);
    char *skip = NULL, *instead = NULL;
    for (size_t i = 0; i < n; i++) {
        if (page_mark(d, lines[i]))
            continue;
        char *reason = mark_arg(lines[i], "skip");
        if (reason) {
            assert_true(reason[0] != '\0'); /* every skip says why */
            skip = reason;
            continue;
        }
        if (!strcmp(lines[i], MARK "instead")) {
            instead = instead_lines(lines, n, &i);
            continue;
        }
        assert_false(starts(lines[i], MARK)); /* a mark this test does not know */
        if (!starts(lines[i], "```sh")) {
            if (lines[i][0] && (skip || instead))
                fail_msg("%s:%zu: a mark must stand right before its sh block", page, i + 1);
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
        if (instead) {
            free(cmd);
            cmd = instead;
        }
        assert_true(d->count < MAX_BLOCKS);
        d->blocks[d->count++] =
            (block_t){.cmd = cmd, .expect = expect, .skip = skip, .page = page, .line = at};
        skip = instead = NULL;
    }
    assert_null(skip);
    assert_null(instead);
}

/* ---- Substitutions ------------------------------------------------------------------------- */

/* text with every occurrence of from replaced by to; malloc'ed. */
static char *replace_all(const char *text, const char *from, const char *to)
{
    size_t count = 0, nf = strlen(from), nt = strlen(to);
    for (const char *p = text; nf && (p = strstr(p, from)); p += nf)
        count++;
    char *out = calloc(1, strlen(text) + count * (nt > nf ? nt - nf : 0) + 1);
    assert_non_null(out);
    char *w = out;
    for (const char *p = text, *hit; *p;) {
        hit = nf ? strstr(p, from) : NULL;
        size_t keep = hit ? (size_t)(hit - p) : strlen(p);
        memcpy(w, p, keep);
        w += keep;
        p += keep;
        if (hit) {
            memcpy(w, to, nt);
            w += nt;
            p += nf;
        }
    }
    return out;
}

/* text after the pages' substitutions, @DIR@ and @METRICS@ filled in; malloc'ed. */
static char *substitute(const char *text)
{
    char metrics[16];
    snprintf(metrics, sizeof metrics, "%d", metrics_port);
    char *out = strdup(text);
    for (size_t s = 0; s < doc.nsubs; s++) {
        char *to = replace_all(doc.subs[s].to, "@DIR@", dir);
        char *to2 = replace_all(to, "@METRICS@", metrics);
        char *next = replace_all(out, doc.subs[s].from, to2);
        free(out);
        free(to);
        free(to2);
        out = next;
    }
    return out;
}

/* ---- Normalising what depends on the clock ------------------------------------------------- */

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
    {"\"(time_ms|updated_ms)\":[0-9]+", "\"\\1\":T"},
    {"\"rate\":[0-9.e+-]+", "\"rate\":R"},
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

/* ---- Running the blocks -------------------------------------------------------------------- */

/* What the block prints (stdout and stderr), run by bash in the scratch folder, in a session of
 * its own whose processes are all ended with it: a block that leaves one running in the
 * background (a `tallyd &` that a skip mark missed) leaves nothing behind. */
static char *run_block(const block_t *b, int index)
{
    char script[32], cmd[512], out[128];
    snprintf(script, sizeof script, "block-%02d.sh", index);
    char *text = substitute(b->cmd);
    assert_int_equal(th_write_file(dir, script, text, strlen(text)), 0);
    free(text);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && timeout 240 setsid -w bash --noprofile --norc -c "
             "'trap \"trap \\\"\\\" TERM; kill -TERM 0\" EXIT; bash --noprofile --norc %s' "
             "> block.out 2>&1 < /dev/null",
             dir, script);
    int rc = system(cmd);
    (void)rc; /* a block's status shows in its output ("exit $?") where it matters */
    snprintf(out, sizeof out, "%s/block.out", dir);
    char *got = th_slurp(out);
    assert_non_null(got);
    return got;
}

/* The folder of path (a program's), in buf. */
static const char *folder_of(const char *path, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s", path);
    char *slash = strrchr(buf, '/');
    if (!slash)
        return ".";
    *slash = '\0';
    return buf;
}

/* A new user's environment: the tally and tallyd under test first on PATH, the harness's
 * tallyd as the endpoint, no terminal size, state and home in the scratch folder. */
static void docs_environment(void)
{
    char cli[512], daemon[512], path[4096];
    snprintf(path, sizeof path, "%s:%s:%s", folder_of(th_tally_bin(), cli, sizeof cli),
             folder_of(th_tallyd_bin(), daemon, sizeof daemon),
             getenv("PATH") ? getenv("PATH") : "");
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

/* The pages read, their before commands run, and their tallyd started. */
static int setup(void **state)
{
    (void)state;
    for (int i = 0; i < npages; i++) {
        char *text = th_slurp(pages[i]);
        assert_non_null(text);
        parse_page(&doc, text, pages[i]);
        free(text); /* what the blocks keep is their own */
    }
    if (th_tmpdir(dir, sizeof dir, "tally-docs") != 0)
        return -1;
    for (size_t i = 0; i < doc.nbefore; i++) {
        char *cmd = substitute(doc.before[i]);
        int rc = th_sh("cd '%s' && %s", dir, cmd);
        free(cmd);
        if (rc != 0)
            return -1;
    }
    char *own[24] = {0};
    const char *args[32] = {"--backend", "cpu"};
    size_t argc = 2;
    for (size_t i = 0; i < doc.nargs; i++)
        args[argc++] = own[i] = substitute(doc.tallyd_args[i]);
    args[argc] = NULL;
    int rc = th_daemon_start(&daemon_, args);
    for (size_t i = 0; i < doc.nargs; i++)
        free(own[i]);
    if (rc != 0)
        return -1;
    metrics_port = th_metrics_port(&daemon_);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    doc_clear(&doc);
    return th_daemon_teardown(&daemon_, 20000, dir);
}

static void test_pages(void **state)
{
    (void)state;
    docs_environment();
    const char *actual_path = getenv("TALLY_DOCS_ACTUAL");
    FILE *actual = actual_path && *actual_path ? fopen(actual_path, "w") : NULL;
    int failures = 0, ran = 0;
    for (size_t i = 0; i < doc.count; i++) {
        const block_t *b = &doc.blocks[i];
        if (b->skip) {
            print_message("%s:%d: not run: %s\n", b->page, b->line, b->skip);
            continue;
        }
        if (strstr(b->cmd, "sudo ") || strstr(b->cmd, "systemctl ")) {
            failures++; /* never run: this test must not change the host */
            print_error("%s:%d: a block with sudo or systemctl needs a skip mark (with the test "
                        "that runs it) or an instead\n",
                        b->page, b->line);
            continue;
        }
        char *got = run_block(b, (int)i);
        ran++;
        if (actual)
            fprintf(actual, "=== block %zu (%s line %d)\n%s", i, b->page, b->line, got);
        if (b->expect) {
            char *want = normalise(b->expect), *have = normalise(got);
            if (strcmp(want, have)) {
                failures++;
                print_error("%s:%d: the block\n%s printed\n%s instead of\n%s\n", b->page, b->line,
                            b->cmd, have, want);
            }
            free(want);
            free(have);
        }
        free(got);
    }
    print_message("%d of %zu blocks run, %d printed other than their page says\n", ran, doc.count,
                  failures);
    if (actual)
        fclose(actual);
    if (!actual)
        assert_int_equal(failures, 0);
}

/* The normaliser and the parser themselves: the clock's parts go, everything else stays; marks
 * apply to the block right after them. */
static void test_reader(void **state)
{
    (void)state;
    char *n = normalise("pong 0.455 ms\n"
                        "window     15:39:11.000 - 15:39:20.276 UTC (9.276 s), 367k values/s\n"
                        "window     15:39:11 - 15:39:20 UTC\n"
                        "tally watch  tcp://127.0.0.1:40123  every 1s  linear  15:39:23\n"
                        "{\"time_ms\":1795658733559,\"rate\":10461.3,\"updated_ms\":17}\n"
                        "count      1000000   ");
    assert_string_equal(n, "pong T ms\n"
                           "window     T\n"
                           "window     15:39:11 - 15:39:20 UTC\n"
                           "tally watch  tcp://127.0.0.1:PORT  every 1s  linear  T\n"
                           "{\"time_ms\":T,\"rate\":R,\"updated_ms\":T}\n"
                           "count      1000000");
    free(n);
    char page[] = "# A tour\n<!-- test_docs: tallyd --metrics 127.0.0.1:0 -->\n"
                  "<!-- test_docs: sub /etc/x @DIR@/x -->\n"
                  "```sh\necho a\n```\n\n```text\na\n```\n"
                  "<!-- test_docs: skip needs a GPU -->\n```sh\necho b\n```\n"
                  "<!-- test_docs: instead\necho c2\n-->\n```sh\necho c\n```\n"
                  "```python\nprint(1)\n```\n"
                  "# Another\n```sh\ncat /etc/x\n```\n```text\nd\n```\n";
    doc_t *d = calloc(1, sizeof *d);
    assert_non_null(d);
    parse_page(d, page, "page.md");
    assert_int_equal(d->count, 4);
    assert_string_equal(d->blocks[0].cmd, "echo a\n");
    assert_string_equal(d->blocks[0].expect, "a\n");
    assert_string_equal(d->blocks[1].skip, "needs a GPU");
    assert_string_equal(d->blocks[2].cmd, "echo c2\n");
    assert_null(d->blocks[2].expect);
    assert_string_equal(d->blocks[3].expect, "d\n");
    assert_int_equal(d->blocks[3].line, 25);
    assert_int_equal(d->nargs, 2);
    assert_string_equal(d->tallyd_args[1], "127.0.0.1:0");
    assert_int_equal(d->nsubs, 1);
    assert_string_equal(d->subs[0].from, "/etc/x");
    assert_string_equal(d->subs[0].to, "@DIR@/x");
    char *r = replace_all("a /etc/x b /etc/x", "/etc/x", "/tmp/y/x");
    assert_string_equal(r, "a /tmp/y/x b /tmp/y/x");
    free(r);
    doc_clear(d);
    free(d);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc && npages < MAX_PAGES; i++)
        pages[npages++] = argv[i];
    if (npages == 0) {
        fprintf(stderr, "usage: test_docs PAGE...\n");
        return 2;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reader),
        cmocka_unit_test_setup_teardown(test_pages, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
