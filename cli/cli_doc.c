/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli_doc.c — `tally --complete` and `tally --print-commands-scd` (cli_doc.h).
 *
 * Both walk the same tables cli_parse builds getopt_long's options and --help from (the
 * commands' groups, less those their operation's row rules out, and cli_common_options), so an
 * option added to a table is completed and in the man page without another edit. scdoc's markup
 * characters ('*', '_', '\') are escaped in every text taken from the tables.
 */
#include "cli_doc.h"

#include <string.h>

/* ---- Completion --------------------------------------------------------------------------- */

static void complete_options(const cli_option_t *options, FILE *f)
{
    for (const cli_option_t *o = options; o->name; o++) {
        /* One '=' per argument: "LO HI" takes two words. */
        int args = 0;
        for (const char *a = o->arg_name; a && *a; a++)
            args += a == o->arg_name || (a[-1] == ' ' && *a != ' ');
        if (o->id < CLI_OPT_FIRST)
            fprintf(f, " -%c%.*s", o->id, args, "==");
        fprintf(f, " --%s%.*s", o->name, args, "==");
    }
}

void cli_doc_complete(const cli_command_t *const *commands, size_t count,
                      const cli_option_t *top_options, FILE *f)
{
    fputs("commands", f);
    for (size_t i = 0; i < count; i++)
        fprintf(f, " %s", commands[i]->name);
    fputs(" help\n-", f);
    complete_options(cli_common_options, f);
    complete_options(top_options, f);
    fputc('\n', f);
    for (size_t i = 0; i < count; i++) {
        fputs(commands[i]->name, f);
        for (const cli_group_t *g = commands[i]->groups; g && g->title; g++)
            if (cli_group_applies(commands[i], g))
                complete_options(g->options, f);
        complete_options(cli_common_options, f);
        fputc('\n', f);
    }
}

/* ---- tally(1) ----------------------------------------------------------------------------- */

/* Text for scdoc: markup ('*', '_', '\\', '`') escaped; a line break is a space (a help text's
 * '\n' only wraps --help), a blank line stays a paragraph break, and lines start without the
 * indentation scdoc would take for markup of its own. */
static void scd_text(const char *text, FILE *f)
{
    bool line_start = true; /* scdoc reads '-' or '.' there as a list item */
    for (const char *p = text; *p; p++) {
        if (*p == '\n') {
            line_start = p[1] == '\n';
            fputs(line_start ? "\n\n" : " ", f);
            p += strspn(p + 1, "\n ");
            continue;
        }
        if (strchr("*_\\`", *p) || (line_start && strchr("-.", *p)))
            fputc('\\', f);
        fputc(*p, f);
        line_start = false;
    }
}

static void scd_options(const cli_option_t *options, FILE *f)
{
    for (const cli_option_t *o = options; o->name; o++) {
        fputc('*', f);
        if (o->id < CLI_OPT_FIRST)
            fprintf(f, "-%c, ", o->id);
        fputs("--", f);
        scd_text(o->name, f);
        fputc('*', f);
        if (o->arg_name) {
            fputs(" _", f);
            scd_text(o->arg_name, f);
            fputc('_', f);
        }
        fputs("\n\t", f);
        scd_text(o->help, f);
        fputs("\n\n", f);
    }
}

static void scd_command(const cli_command_t *cmd, FILE *f)
{
    fprintf(f, "## %s\n\n*tally* ", cmd->name);
    scd_text(cmd->usage, f);
    fputs("\n\n", f);
    scd_text(cmd->about, f);
    fputs("\n\n", f);
    for (const cli_group_t *g = cmd->groups; g && g->title; g++) {
        if (!cli_group_applies(cmd, g))
            continue;
        fputc('*', f);
        scd_text(g->title, f);
        fputs(":*\n\n", f);
        scd_options(g->options, f);
    }
}

void cli_doc_scd(const cli_command_t *const *commands, size_t count,
                 const cli_option_t *top_options, FILE *f)
{
    fputs("# OPTIONS\n\nThese go before the command name, and (but for *--version*) after it "
          "too.\n\n",
          f);
    scd_options(cli_common_options, f);
    scd_options(top_options, f);
    fputs("# COMMANDS\n\n*tally* _COMMAND_ *--help* prints the same for one command.\n\n", f);
    for (size_t i = 0; i < count; i++)
        scd_command(commands[i], f);
}
