/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli_doc.h — the command and option tables of `tally` printed for other tools, so that what
 * they say is what the CLI parses: the bash completion's word lists (`tally --complete`, read by
 * cli/tally.bash at each Tab) and the OPTIONS and COMMANDS sections of tally(1)
 * (`tally --print-commands-scd`, put into man/tally.1.scd by the build). Both are hidden options.
 */
#ifndef TALLY_CLI_DOC_H
#define TALLY_CLI_DOC_H

#include <stddef.h>
#include <stdio.h>

#include "cli.h"

/* One line per scope: "commands NAME...", then "- OPTION..." for the options before a command
 * (common and top-level), then "NAME OPTION..." for each command (its own and the common ones).
 * An option is "-x" or "--name", followed by one '=' per argument it takes. */
void cli_doc_complete(const cli_command_t *const *commands, size_t count,
                      const cli_option_t *top_options, FILE *f);

/* tally(1)'s "# OPTIONS" (common and top-level options) and "# COMMANDS" (each command's usage,
 * description and options) sections, in scdoc. */
void cli_doc_scd(const cli_command_t *const *commands, size_t count,
                 const cli_option_t *top_options, FILE *f);

#endif
