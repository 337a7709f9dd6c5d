/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_err.c — see td_err.h.
 */
#include "td_err.h"

const char *td_err_name(td_err_t err)
{
    static const char *const names[] = {
        [TD_OK] = "ok",
        [TD_ERR_CONFIG] = "config",
        [TD_ERR_IO] = "io",
        [TD_ERR_BIND] = "bind",
        [TD_ERR_BACKEND] = "backend",
        [TD_ERR_NOMEM] = "nomem",
        [TD_ERR_CORRUPT] = "corrupt",
        [TD_ERR_VERSION] = "version",
        [TD_ERR_LIBRARY] = "library",
        [TD_ERR_BUSY] = "busy",
    };
    if ((unsigned)err < sizeof names / sizeof names[0] && names[err])
        return names[err];
    return "unknown";
}

int td_err_exit_code(td_err_t err)
{
    if (err == TD_OK)
        return 0;
    return err == TD_ERR_CONFIG ? 2 : 1;
}
