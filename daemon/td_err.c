/*
 * td_err.c — see td_err.h.
 */
#include "td_err.h"

const char *td_err_name(td_err_t err)
{
    switch (err) {
    case TD_OK:
        return "ok";
    case TD_ERR_CONFIG:
        return "config";
    case TD_ERR_IO:
        return "io";
    case TD_ERR_BIND:
        return "bind";
    case TD_ERR_BACKEND:
        return "backend";
    case TD_ERR_NOMEM:
        return "nomem";
    case TD_ERR_CORRUPT:
        return "corrupt";
    case TD_ERR_LIBRARY:
        return "library";
    }
    return "unknown";
}

tally_status_t td_err_to_wire(td_err_t err)
{
    if (err == TD_OK)
        return TALLY_OK;
    return err == TD_ERR_BACKEND ? TALLY_E_BACKEND : TALLY_E_INTERNAL;
}

int td_err_exit_code(td_err_t err)
{
    if (err == TD_OK)
        return 0;
    return err == TD_ERR_CONFIG ? 2 : 1;
}
