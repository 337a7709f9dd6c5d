/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_settings_doc.c — the documents generated from the table of settings: `tallyd --help`, the
 * configuration table of docs/service.md (--print-settings-md) and systemd/tallyd.conf.example
 * (--print-example-conf). tests/test_config_docs.sh compares the last two with the committed
 * files, so a change to a row here shows up as a diff to commit, never as a disagreement. The
 * man pages take their options (tallyd(8), --print-options-scd) and keys (tallyd.conf(5),
 * --print-settings-scd) from here too, in scdoc, at build time (man/CMakeLists.txt).
 */
#include <ctype.h>
#include <string.h>

#include "td_settings.h"

#define HELP_WIDTH 80  /* --help lines, at most */
#define HELP_COLUMN 26 /* where an option's description starts */
#define CONF_WIDTH 100 /* the example file's comment lines, at most */

/* Prints text word by word from column col, starting a new line (with lead) before a word that
 * would pass width; ends with a newline. */
static void wrap(FILE *out, const char *text, size_t col, const char *lead, size_t width)
{
    bool line_start = true;
    for (const char *p = text + strspn(text, " "); *p; p += strspn(p, " ")) {
        size_t len = strcspn(p, " ");
        if (!line_start && col + 1 + len > width) {
            fprintf(out, "\n%s", lead);
            col = strlen(lead);
            line_start = true;
        }
        if (!line_start) {
            fputc(' ', out);
            col++;
        }
        fwrite(p, 1, len, out);
        col += len;
        line_start = false;
        p += len;
    }
    fputc('\n', out);
}

/* The setting's default as the file takes it ("16M", "on"; "" for none). */
static void default_value(const td_setting_t *s, char *buf, size_t cap)
{
    td_config_t defaults;
    td_config_init(&defaults);
    td_setting_format(s, &defaults, true, buf, cap);
}

/* "VALUE: DOC", "VALUE" or "DOC", with open and close around VALUE; "" when neither. */
static void default_text(const td_setting_t *s, const char *open, const char *close, char *buf,
                         size_t cap)
{
    char value[256];
    default_value(s, value, sizeof value);
    if (s->type == TD_SET_FLAG || s->type == TD_SET_ACTION)
        buf[0] = '\0';
    else if (value[0] && s->default_doc)
        snprintf(buf, cap, "%s%s%s: %s", open, value, close, s->default_doc);
    else if (value[0])
        snprintf(buf, cap, "%s%s%s", open, value, close);
    else
        snprintf(buf, cap, "%s", s->default_doc ? s->default_doc : "");
}

/* ---- tallyd --help ------------------------------------------------------------------------ */

static void help_entry(FILE *out, const td_setting_t *s)
{
    char label[64], dflt[512], text[1024];
    int n = s->short_flag ? snprintf(label, sizeof label, "  -%c, --%s", s->short_flag, s->option)
                          : snprintf(label, sizeof label, "      --%s", s->option);
    if (s->arg && n > 0 && (size_t)n < sizeof label)
        snprintf(label + n, sizeof label - (size_t)n, " %s", s->arg);
    default_text(s, "", "", dflt, sizeof dflt);
    snprintf(text, sizeof text, "%s%s%s%s", s->help, dflt[0] ? " (default " : "", dflt,
             dflt[0] ? ")" : "");
    size_t col = strlen(label);
    fputs(label, out);
    size_t pad = col + 2 <= HELP_COLUMN ? HELP_COLUMN - col : 2;
    fprintf(out, "%*s", (int)pad, "");
    wrap(out, text, col + pad, "                          ", HELP_WIDTH);
}

void td_settings_print_help(FILE *out, const char *argv0)
{
    fprintf(out,
            "usage: %s [options]\n\n"
            "tallyd serves filter, scan and histogram requests over ZeroMQ on the GPU or CPU.\n"
            "\n",
            argv0);
    for (size_t i = 0; i < td_settings_count; i++)
        if (!td_settings[i].hidden)
            help_entry(out, &td_settings[i]);
}

/* ---- What a reload does, in words --------------------------------------------------------- */

static const char *reload_words(td_reload_t reload, bool conf)
{
    switch (reload) {
    case TD_RELOAD_APPLIES:
        return conf ? "Changes at reload" : "applies";
    case TD_RELOAD_UP_TO_START:
        return conf ? "Changes at reload, up to the value tallyd started with"
                    : "applies, up to the start value";
    case TD_RELOAD_REREAD:
        return conf ? "Read again on every reload" : "re-read on every reload";
    case TD_RELOAD_RESTART:
        return conf ? "Restart to change" : "restart";
    case TD_RELOAD_NONE:
        break;
    }
    return "";
}

static void reload_text(const td_setting_t *s, bool conf, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s%s%s%s", reload_words(s->reload, conf), s->reload_note ? " (" : "",
             s->reload_note ? s->reload_note : "", s->reload_note ? ")" : "");
}

/* ---- docs/service.md's table -------------------------------------------------------------- */

static bool documented(const td_setting_t *s)
{
    return s->section && !s->hidden;
}

/* Calls row for each setting of the documents, section for each new section first. */
static void for_each_documented(FILE *out, void (*section)(FILE *, const char *),
                                void (*row)(FILE *, const td_setting_t *, bool first))
{
    const char *last = "";
    for (size_t i = 0; i < td_settings_count; i++) {
        const td_setting_t *s = &td_settings[i];
        if (!documented(s))
            continue;
        bool first = strcmp(last, s->section) != 0;
        if (first && section)
            section(out, s->section);
        row(out, s, first);
        last = s->section;
    }
}

static void md_row(FILE *out, const td_setting_t *s, bool first)
{
    char dflt[512], reload[256];
    default_text(s, "`", "`", dflt, sizeof dflt);
    reload_text(s, false, reload, sizeof reload);
    if (first)
        fprintf(out, "| `[%s]` ", s->section);
    else
        fputs("| ", out);
    fprintf(out, "| `%s`%s | `--%s` | %s | %s | %s |\n", s->key,
            s->type == TD_SET_ENDPOINTS ? " (repeatable)" : "", s->option, s->help,
            dflt[0] ? dflt : "none", reload);
}

void td_settings_print_md(FILE *out)
{
    fputs("| section | key | option | what it does | default | on reload |\n"
          "|---|---|---|---|---|---|\n",
          out);
    for_each_documented(out, NULL, md_row);
}

/* ---- systemd/tallyd.conf.example ---------------------------------------------------------- */

/* What a section is for, where its keys do not say it. */
static const struct {
    const char *section;
    const char *doc;
} section_docs[] = {
    {"security", "CURVE authentication and encryption (PROTOCOL.md §12)."},
    {"windows", "Each stream keeps a ring of its recent intervals for window queries (tally query "
                "--last 10s). Only the intervals that counted something take memory, their "
                "counts in the narrowest width: at the defaults a stream with one batch of 1 KiB "
                "of bytes takes about 0.9 KiB in all, one with such a batch every second about "
                "21 KiB (bench/RESULTS.md); max_state_bytes bounds the total."},
};

static void conf_section(FILE *out, const char *section)
{
    fprintf(out, "\n[%s]\n", section);
    for (size_t i = 0; i < sizeof section_docs / sizeof section_docs[0]; i++)
        if (strcmp(section_docs[i].section, section) == 0) {
            fputs("# ", out);
            wrap(out, section_docs[i].doc, 2, "# ", CONF_WIDTH);
        }
}

/* A key's comment and its line, commented out: the default, or an example that the comment says
 * is one (`#workers = 8` read as a default where the default is 0, the number of cores). */
static void conf_row(FILE *out, const td_setting_t *s, bool first)
{
    (void)first;
    char dflt[512], reload[256], comment[2048], value[256];
    default_text(s, "", "", dflt, sizeof dflt);
    reload_text(s, true, reload, sizeof reload);
    snprintf(comment, sizeof comment, "%c%s (--%s).%s%s%s %s.%s",
             toupper((unsigned char)s->help[0]), s->help + 1, s->option,
             s->default_doc ? " Default " : "", s->default_doc ? dflt : "",
             s->default_doc ? "." : "", reload, s->example ? " An example:" : "");
    fputs("# ", out);
    wrap(out, comment, 2, "# ", CONF_WIDTH);
    if (s->example)
        snprintf(value, sizeof value, "%s", s->example);
    else
        default_value(s, value, sizeof value);
    fprintf(out, "#%s = %s\n", s->key, value);
}

static const char conf_header[] =
    "/etc/tallyd/tallyd.conf — tallyd's configuration (INI), generated by `tallyd "
    "--print-example-conf`. Each key stands for the command-line option named beside it (tallyd "
    "--help); options given on the command line win over this file. `systemctl reload tallyd` "
    "(SIGHUP) re-reads it and applies the keys marked \"Changes at reload\"; changes to the others "
    "are logged as ignored until a restart. A wrong key or value stops tallyd at start (exit 2, "
    "\"FILE:LINE: ...\") and is logged and ignored on reload. The values shown are the defaults, "
    "but where a comment ends in \"An example:\" (a default worked out at start, or none).";

void td_settings_print_conf(FILE *out)
{
    fputs("# ", out);
    wrap(out, conf_header, 2, "# ", CONF_WIDTH);
    for_each_documented(out, conf_section, conf_row);
}

/* ---- The man pages: tallyd(8)'s OPTIONS and tallyd.conf(5)'s keys, in scdoc ---------------- */

/* Text for scdoc: '*', '_' and '\' are its markup, escaped to stand for themselves. */
static void scd_text(FILE *out, const char *text)
{
    for (const char *p = text; *p; p++) {
        if (*p == '*' || *p == '_' || *p == '\\')
            fputc('\\', out);
        fputc(*p, out);
    }
}

/* The indented paragraph under an entry: "Help (other name). Default: D." and for the file's
 * keys what a reload does. */
static void scd_paragraph(FILE *out, const td_setting_t *s, bool conf)
{
    char dflt[512], reload[256], other[128];
    default_text(s, "", "", dflt, sizeof dflt);
    reload_text(s, true, reload, sizeof reload);
    if (conf)
        snprintf(other, sizeof other, " (*--%s*)", s->option);
    else if (s->section)
        snprintf(other, sizeof other, " (*%s* in [%s])", s->key, s->section);
    else
        other[0] = '\0';
    fprintf(out, "\t%c", toupper((unsigned char)s->help[0]));
    scd_text(out, s->help + 1);
    /* The other name holds no markup of its own but its '*'s: keys' '_'s are escaped here. */
    for (const char *p = other; *p; p++) {
        if (*p == '_')
            fputc('\\', out);
        fputc(*p, out);
    }
    fputs(".", out);
    if (dflt[0]) {
        fputs(" Default: ", out);
        scd_text(out, dflt);
        fputs(".", out);
    }
    if (conf && reload[0]) {
        fputc(' ', out);
        scd_text(out, reload);
        fputs(".", out);
    }
    fputs("\n\n", out);
}

void td_settings_print_options_scd(FILE *out)
{
    for (size_t i = 0; i < td_settings_count; i++) {
        const td_setting_t *s = &td_settings[i];
        if (s->hidden)
            continue;
        fputc('*', out);
        if (s->short_flag)
            fprintf(out, "-%c, ", s->short_flag);
        fputs("--", out);
        scd_text(out, s->option);
        fputc('*', out);
        if (s->arg) {
            fputs(" _", out);
            scd_text(out, s->arg);
            fputc('_', out);
        }
        fputc('\n', out);
        scd_paragraph(out, s, false);
    }
}

static void scd_section(FILE *out, const char *section)
{
    fprintf(out, "## [%s]\n\n", section);
    for (size_t i = 0; i < sizeof section_docs / sizeof section_docs[0]; i++)
        if (strcmp(section_docs[i].section, section) == 0) {
            scd_text(out, section_docs[i].doc);
            fputs("\n\n", out);
        }
}

static void scd_key(FILE *out, const td_setting_t *s, bool first)
{
    (void)first;
    fputc('*', out);
    scd_text(out, s->key);
    fputs("* = _", out);
    scd_text(out, s->arg ? s->arg : "VALUE");
    fputs(s->type == TD_SET_ENDPOINTS ? "_ (repeatable)\n" : "_\n", out);
    scd_paragraph(out, s, true);
}

void td_settings_print_conf_scd(FILE *out)
{
    for_each_documented(out, scd_section, scd_key);
}
