/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cmd_watch.c — `tally watch STREAM...`: a live terminal view of streams' histograms.
 *
 * One loop, one thread. Every interval it queries every stream (the queries pipelined, so a
 * round costs one round trip and a daemon that is down costs one timeout, not one per stream),
 * or with --sub takes the records tallyd publishes on its PUB socket (with --nats or --fleet:
 * those the fleet's workers publish on tally.watch.<k>, unless they publish nothing), and
 * redraws the screen:
 * per stream (per channel for rgb8/rgba8) a header line (count, rate, mean, quantiles), the 256
 * bins folded to the terminal's width as bars, and an axis line. Between rounds it sleeps in
 * poll() on the keyboard, a self-pipe written by the signal handlers (SIGWINCH redraws at the
 * new size at once; SIGINT, SIGTERM, SIGHUP and SIGQUIT quit) and, with --sub, the
 * subscription's fd.
 *
 * It never gives up on the daemon: a round that gets no answer drops the connection, says
 * "unreachable" and why (what a connection attempt says: refused, no socket file) on the status
 * line and tries again each interval with a new one; the first
 * answer after that says "reconnected". Counts that go down (a reset, or a daemon restarted
 * without its state) restart the rate instead of showing a negative one.
 *
 * The terminal is put in non-canonical mode without echo (so 'q' needs no Enter; Ctrl-C still
 * raises SIGINT), switched to the alternate screen with the cursor hidden, and restored on
 * every way out. --once prints a single frame (two rounds an interval apart, for the rate)
 * without any terminal control, for scripts and for a terminal-less look.
 */
#include "cli.h"
#include "hist_view.h"
#include "tally_proto.h"
#include "tally_args.h"
#include "tally_fleet.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

/* A reconnection stays on the status line this long. */
#define RECONNECTED_SHOWN_S 10.0

typedef struct {
    const char *name;
    bool known;        /* view holds the stream's last record */
    char problem[128]; /* why there is no record (unknown stream, ...); "" when known */
    /* The daemon's refusal of the last query (--once reports it): its status, or TALLY_OK, and
     * its words. */
    tally_status_t refused;
    char refusal[TALLY_ERROR_MESSAGE_MAX + 1];
    hv_stream_t view;
    /* The rate: values per second between the last two records. */
    uint64_t prev_total;
    double prev_time_s;
    bool have_prev;
    double rate;
    bool have_rate;
    double updated_s; /* --sub: when its last record came (wall clock) */
} watch_stream_t;

typedef struct {
    cli_t *cli;
    double interval_s;
    bool log, ascii, once;
    const char *sub_endpoint;
    const char *size; /* --size COLSxROWS, or NULL: the terminal's */
    unsigned size_cols, size_rows;
    tally_curve_keys_t keys; /* loaded once, at start (CURVE off when server_public is "") */
    watch_stream_t *streams;
    size_t count;
    tally_client_t *client;
    tally_sub_t *sub;
    tally_nats_t *nats;      /* --nats: the connection of the subscription below */
    tally_nats_sub_t *nsub;  /* --nats: the fleet's publications, or NULL: queried */
    uint64_t last_pub_seq;   /* the last publication's number: not above it = a new run */
    bool down;               /* the last round got no answer */
    double down_since_s;     /* wall clock, for the status line */
    double reconnected_at_s; /* monotonic; 0 = never */
    char status[320];
    char down_why[160]; /* why the last round got no answer */
    unsigned rows, cols;
    bool utf8;
    tally_buf_t frame;
} watch_t;

/* ---- Signals and the terminal ------------------------------------------------------------ */

static int wake_pipe[2] = {-1, -1};
static volatile sig_atomic_t got_winch, got_quit;
static struct termios saved_termios;
static bool termios_saved, screen_taken;

static void on_signal(int sig)
{
    int saved = errno;
    if (sig == SIGWINCH)
        got_winch = 1;
    else
        got_quit = 1;
    char c = 0;
    if (write(wake_pipe[1], &c, 1) < 0) { /* full: a wake-up is pending anyway */
    }
    errno = saved;
}

static int install_signals(void)
{
    if (pipe2(wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
        return -1;
    struct sigaction sa = {.sa_handler = on_signal}; /* no SA_RESTART: poll() returns EINTR */
    sigemptyset(&sa.sa_mask);
    const int sigs[] = {SIGWINCH, SIGINT, SIGTERM, SIGHUP, SIGQUIT};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        if (sigaction(sigs[i], &sa, NULL) != 0)
            return -1;
    return 0;
}

static void write_all(const void *data, size_t len)
{
    const char *p = data;
    while (len) {
        ssize_t n = write(STDOUT_FILENO, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        p += n;
        len -= (size_t)n;
    }
}

static void terminal_take(void)
{
    if (isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &saved_termios) == 0) {
        struct termios raw = saved_termios;
        raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO); /* keys at once, unechoed; ISIG stays */
        raw.c_cc[VMIN] = 1;
        raw.c_cc[VTIME] = 0;
        termios_saved = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    static const char enter[] = "\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J"; /* alternate screen */
    write_all(enter, sizeof enter - 1);
    screen_taken = true;
}

static void terminal_restore(void)
{
    if (screen_taken) {
        static const char leave[] = "\x1b[?25h\x1b[?1049l"; /* cursor back, main screen back */
        write_all(leave, sizeof leave - 1);
        screen_taken = false;
    }
    if (termios_saved) {
        tcsetattr(STDIN_FILENO, TCSANOW, &saved_termios);
        termios_saved = false;
    }
}

static void terminal_size(watch_t *w)
{
    struct winsize ws;
    unsigned rows = 0, cols = 0;
    if (w->size) {
        rows = w->size_rows;
        cols = w->size_cols;
    } else if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row && ws.ws_col) {
        rows = ws.ws_row;
        cols = ws.ws_col;
    } else { /* not a terminal (--once into a pipe): $LINES and $COLUMNS, else 24 x 80 */
        const char *l = getenv("LINES"), *c = getenv("COLUMNS");
        rows = l ? (unsigned)atoi(l) : 0;
        cols = c ? (unsigned)atoi(c) : 0;
    }
    w->rows = rows >= 4 ? rows : 24;
    w->cols = cols >= 16 ? cols : 80;
}

/* ---- Time --------------------------------------------------------------------------------- */

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void clock_text(double t, char *buf, size_t cap)
{
    time_t s = (time_t)t;
    struct tm tm;
    localtime_r(&s, &tm);
    strftime(buf, cap, "%H:%M:%S", &tm);
}

/* ---- Records in ------------------------------------------------------------------------- */

/* A new record of stream s, taken at time t (seconds, any fixed origin). */
static void stream_update(watch_stream_t *s, const tally_stream_info_t *info, double t)
{
    if (hv_stream_init(&s->view, s->name, info) != TALLY_OK) {
        s->known = false;
        snprintf(s->problem, sizeof s->problem, "histogram type %u is not known to this tally",
                 info->hist_dtype);
        return;
    }
    s->known = true;
    s->problem[0] = '\0';
    s->refused = TALLY_OK;
    uint64_t total = info->hist_total;
    if (s->have_prev && total >= s->prev_total && t > s->prev_time_s) {
        s->rate = (double)(total - s->prev_total) / (t - s->prev_time_s);
        s->have_rate = true;
    } else {
        s->have_rate = false; /* first record, or the counts went down (reset, restart) */
    }
    s->prev_total = total;
    s->prev_time_s = t;
    s->have_prev = true;
}

static void stream_problem(watch_stream_t *s, tally_status_t status, const char *error)
{
    s->known = false;
    s->have_prev = false;
    s->have_rate = false;
    s->refused = status;
    snprintf(s->refusal, sizeof s->refusal, "%s", error);
    if (status == TALLY_E_UNKNOWN_STREAM)
        snprintf(s->problem, sizeof s->problem, "no such stream (yet)");
    else
        snprintf(s->problem, sizeof s->problem, "%s: %.100s", tally_status_name(status), error);
}

/* Whether the streams are a fleet's (--nats, or --fleet: direct mode), not one tallyd's. */
static bool fleet(const cli_t *cli)
{
    return cli->nats || cli->fleet;
}

/* Why tallyd did not answer, in words: what a connection attempt says (refused, no socket
 * file), else the library's status. */
static void down_reason(const watch_t *w, tally_status_t status, const char *error, char *buf,
                        size_t cap)
{
    int err = 0;
    if ((status == TALLY_E_TIMEOUT || status == TALLY_E_TRANSPORT) && !fleet(w->cli))
        err = tally_endpoint_probe(w->cli->endpoint,
                                   w->cli->timeout_ms < 1000 ? w->cli->timeout_ms : 1000);
    if (err && err != ETIMEDOUT)
        snprintf(buf, cap, "cannot connect: %s", strerror(err));
    else
        snprintf(buf, cap, "%s: %.80s", tally_status_name(status), error);
}

/* `error` may be the client's own message: it is used before the client goes. */
static void mark_down(watch_t *w, tally_status_t status, const char *error)
{
    if (!w->down) {
        w->down = true;
        w->down_since_s = wall_s();
    }
    char since[16];
    clock_text(w->down_since_s, since, sizeof since);
    down_reason(w, status, error, w->down_why, sizeof w->down_why);
    /* The reason first: a narrow screen cuts the line (the endpoint is on the title line). */
    snprintf(w->status, sizeof w->status, "tallyd unreachable since %s (%.120s); retrying", since,
             w->down_why);
    tally_client_destroy(&w->client); /* the next round starts on a fresh connection */
}

static void mark_up(watch_t *w)
{
    if (w->down) {
        w->down = false;
        w->reconnected_at_s = mono_s();
        char now[16];
        clock_text(wall_s(), now, sizeof now);
        snprintf(w->status, sizeof w->status, "reconnected to tallyd at %.80s at %s",
                 w->cli->endpoint, now);
    } else if (w->reconnected_at_s && mono_s() - w->reconnected_at_s > RECONNECTED_SHOWN_S) {
        w->status[0] = '\0';
        w->reconnected_at_s = 0;
    }
}

/* Whether the records come from publications (--sub, or a fleet's). */
static bool subscribed(const watch_t *w)
{
    return w->sub || w->nsub;
}

/* Sends every stream's query, then takes the replies as they come. */
static void poll_round(watch_t *w)
{
    if (!w->client) {
        /* Each wait is bounded by about one interval, so 'q' never waits long; --once, which no
         * key stops, waits as any command does (--timeout): a reply later than an interval is
         * not "cannot reach tallyd". */
        int timeout = (int)(w->interval_s * 1000);
        timeout = timeout < 250 ? 250 : timeout > w->cli->timeout_ms ? w->cli->timeout_ms : timeout;
        if (w->once)
            timeout = w->cli->timeout_ms;
        if (fleet(w->cli)) { /* the queries go to each stream's owner (NATS, or direct) */
            if (cli_nats_client(w->cli, timeout, &w->client) != 0)
                mark_down(w, TALLY_E_TRANSPORT, "cannot reach NATS");
            if (!w->client)
                return;
        }
        tally_status_t st =
            w->client ? TALLY_OK
                      : tally_client_new_curve(w->cli->endpoint, timeout, &w->keys, &w->client);
        if (st != TALLY_OK) {
            mark_down(w, st, "cannot create a client");
            return;
        }
    }
    uint64_t ids[w->count];
    for (size_t i = 0; i < w->count; i++) {
        tally_req_t req = {.opcode = TALLY_OP_QUERY};
        tally_req_set_stream(&req, w->streams[i].name); /* names were checked at start */
        tally_status_t st = tally_send(w->client, &req, NULL, 0, &ids[i]);
        if (st != TALLY_OK) {
            mark_down(w, st, tally_client_error(w->client));
            return;
        }
    }
    /* With --sub the records also come with the daemon's wall-clock times: one time base. */
    double t = subscribed(w) ? wall_s() : mono_s();
    tally_reply_t reply;
    tally_reply_init(&reply);
    for (size_t got = 0; got < w->count;) {
        tally_status_t st = tally_recv(w->client, &reply);
        if (st == TALLY_E_TIMEOUT || st == TALLY_E_TRANSPORT || st == TALLY_E_REPLY ||
            st == TALLY_E_SHUTDOWN) { /* the streams keep showing what they last had */
            mark_down(w, st, reply.error);
            break;
        }
        for (size_t i = 0; i < w->count; i++) {
            if (reply.rep.request_id != ids[i])
                continue; /* else a late reply to an older round: dropped */
            tally_stream_info_t info;
            if (st == TALLY_OK && tally_reply_stream_info(&reply, &info) != TALLY_OK)
                stream_problem(&w->streams[i], TALLY_E_REPLY, "the record does not decode");
            else if (st == TALLY_OK)
                stream_update(&w->streams[i], &info, t);
            else
                stream_problem(&w->streams[i], st, reply.error);
            got++;
        }
    }
    tally_reply_clear(&reply);
    if (w->client)
        mark_up(w);
}

/* ---- Subscription (--sub) ---------------------------------------------------------------- */

static watch_stream_t *find_stream(watch_t *w, const char *name)
{
    for (size_t i = 0; i < w->count; i++)
        if (!strcmp(w->streams[i].name, name))
            return &w->streams[i];
    return NULL; /* a longer name that shares a subscribed prefix */
}

/* Publication numbers run 1, 2, 3, ... over all of a daemon run's messages, so one that does
 * not grow means a new run. (Gaps say nothing here: the numbers of other streams' messages,
 * which this subscription filters out, fall in them.) */
static void note_pub_seq(watch_t *w, uint64_t seq)
{
    if (w->last_pub_seq && seq <= w->last_pub_seq) {
        char now[16];
        clock_text(wall_s(), now, sizeof now);
        snprintf(w->status, sizeof w->status, "tallyd restarted (publications began again) at %s",
                 now);
    }
    w->last_pub_seq = seq;
}

/* Takes every publication that has arrived; true when one of ours changed. */
static bool sub_drain(watch_t *w)
{
    bool changed = false;
    tally_pub_msg_t *msg = malloc(sizeof *msg);
    if (!msg)
        return false;
    for (;;) {
        tally_status_t st =
            w->sub ? tally_sub_recv(w->sub, 0, msg) : tally_nats_sub_recv(w->nsub, 0, msg);
        if (st == TALLY_E_REPLY)
            continue; /* not a publication this tally understands: skipped */
        if (st != TALLY_OK)
            break;
        if (w->sub) /* a fleet's workers number theirs each on its own */
            note_pub_seq(w, msg->pub.pub_seq);
        watch_stream_t *s = find_stream(w, msg->stream);
        if (!s)
            continue;
        if (msg->pub.kind == TALLY_PUB_DELETED) {
            stream_problem(s, TALLY_E_UNKNOWN_STREAM, "");
            snprintf(s->problem, sizeof s->problem, "deleted");
        } else {
            stream_update(s, &msg->info, (double)msg->pub.time_ms / 1000.0);
        }
        s->updated_s = wall_s();
        changed = true;
    }
    free(msg);
    return changed;
}

/* --sub's tick: a ping says whether tallyd is there (its publications stop either way when
 * nothing changes); after it was away, one query round brings every stream up to date. A
 * stream without a publication for two intervals did not change: its rate is 0. */
static void sub_tick(watch_t *w)
{
    bool was_down = w->down || !w->client;
    if (!w->client) {
        poll_round(w);
        return;
    }
    tally_status_t st = tally_ping(w->client, NULL);
    if (st != TALLY_OK) {
        mark_down(w, st, tally_client_error(w->client));
        return;
    }
    if (was_down)
        poll_round(w);
    mark_up(w);
    for (size_t i = 0; i < w->count; i++) {
        watch_stream_t *s = &w->streams[i];
        if (s->known && s->updated_s && wall_s() - s->updated_s > 2 * w->interval_s) {
            s->rate = 0;
            s->have_rate = true;
        }
    }
}

/* ---- Drawing ------------------------------------------------------------------------------ */

/* Appends one line cut to the screen's width (every text line here is ASCII). */
static void line(watch_t *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(watch_t *w, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (strlen(text) > w->cols)
        text[w->cols] = '\0';
    tally_buf_printf(&w->frame, "%s%s\n", text, w->once ? "" : "\x1b[K");
}

static void quantile_text(const tally_hist_t *h, const tally_quantile_t *q, char *buf, size_t cap)
{
    if (q->side)
        snprintf(buf, cap, "%s%" PRId64, q->side < 0 ? "<" : ">=", q->side < 0 ? h->lo : h->hi);
    else
        snprintf(buf, cap, "%" PRId64, q->value);
}

/* A block's header: who and how much (`what`), then the shape (`shape`); on one line when both
 * fit the width, else on two. */
typedef struct {
    char what[320];
    char shape[320];
} header_t;

static void block_header(const watch_stream_t *s, unsigned c, header_t *hd)
{
    if (!s->known || !s->view.channels) {
        snprintf(hd->what, sizeof hd->what, "%s  %s", s->name,
                 s->known ? "no hist on this stream yet" : s->problem);
        hd->shape[0] = '\0';
        return;
    }
    const tally_hist_t *h = &s->view.hist[c];
    tally_hist_summary_t sum;
    tally_hist_summarize(h, &sum);
    const char *channel = hv_channel_name(&s->view, c);
    char count[32], rate[32] = "-", p[3][32] = {"-", "-", "-"}, mean[32] = "-", range[64] = "";
    hv_short_count((double)sum.count, count, sizeof count);
    if (s->have_rate) {
        hv_short_count(s->rate, rate, sizeof rate);
        strcat(rate, "/s");
    }
    if (sum.count) {
        quantile_text(h, &sum.p50, p[0], sizeof p[0]);
        quantile_text(h, &sum.p90, p[1], sizeof p[1]);
        quantile_text(h, &sum.p99, p[2], sizeof p[2]);
    }
    if (sum.in_range)
        snprintf(mean, sizeof mean, "%.1f", sum.mean);
    if (h->dtype != TALLY_DTYPE_U8)
        snprintf(range, sizeof range, "  under %" PRIu64 "  over %" PRIu64, sum.underflow,
                 sum.overflow);
    snprintf(hd->what, sizeof hd->what, "%s%s%s%s  %s  count %s  rate %s", s->name,
             channel ? " [" : "", channel ? channel : "", channel ? "]" : "",
             tally_dtype_name((tally_dtype_t)s->view.info.hist_dtype), count, rate);
    snprintf(hd->shape, sizeof hd->shape, "mean %s  p50 %s  p90 %s  p99 %s%s", mean, p[0], p[1],
             p[2], range);
}

static unsigned header_lines(const watch_t *w, const header_t *hd)
{
    return !hd->shape[0] || strlen(hd->what) + 2 + strlen(hd->shape) <= w->cols ? 1 : 2;
}

static void header_draw(watch_t *w, const header_t *hd)
{
    if (!hd->shape[0])
        line(w, "%s", hd->what);
    else if (header_lines(w, hd) == 1)
        line(w, "%s  %s", hd->what, hd->shape);
    else {
        line(w, "%s", hd->what);
        line(w, "  %s", hd->shape);
    }
}

/* The bars of one histogram and its axis: the first and last integer of the range. */
static void block_bars(watch_t *w, const tally_hist_t *h, unsigned bar_rows)
{
    unsigned cols = w->cols < TALLY_HIST_BINS ? w->cols : TALLY_HIST_BINS;
    double folded[TALLY_HIST_BINS];
    hv_fold(h, cols, folded);
    hv_bars(folded, cols, bar_rows, w->log, w->utf8, &w->frame);
    char left[24], right[24];
    int n = snprintf(left, sizeof left, "%" PRId64, tally_hist_edge(h, 0));
    snprintf(right, sizeof right, "%" PRId64, tally_hist_edge(h, TALLY_HIST_BINS) - 1);
    int gap = (int)cols - n - (int)strlen(right);
    line(w, "%s%*s%s", left, gap > 1 ? gap : 1, "", right);
}

/* Cuts the frame to the screen's height, without a newline after the last line (which would
 * scroll the screen), then clears whatever an older frame left below it. */
static void fit_screen(watch_t *w)
{
    unsigned lines = 0;
    for (size_t i = 0; i < w->frame.len; i++) {
        if (w->frame.data[i] == '\n' && ++lines == w->rows) {
            w->frame.len = i;
            break;
        }
    }
    if (w->frame.len && w->frame.data[w->frame.len - 1] == '\n')
        w->frame.len--;
    tally_buf_printf(&w->frame, "\x1b[J");
}

static unsigned blocks_of(const watch_stream_t *s)
{
    return s->known && s->view.channels ? s->view.channels : 1;
}

/* How many streams fit the screen, their blocks at one bar row each, with a line left for
 * "+N more" when not all do; and the lines those take besides their bars (*fixed, the title
 * and status lines included). --once prints every stream: its frame is not cut. */
static size_t streams_shown(const watch_t *w, const header_t *headers, unsigned *fixed,
                            unsigned *blocks)
{
    unsigned used = 2, k = 0;
    *blocks = 0;
    size_t shown = 0;
    for (size_t i = 0; i < w->count; i++) {
        unsigned need = 0, n = blocks_of(&w->streams[i]);
        for (unsigned c = 0; c < n; c++)
            need += header_lines(w, &headers[k + c]) + 2; /* a bar row and the axis */
        unsigned more = i + 1 < w->count ? 1 : 0;
        if (!w->once && used + need + more > w->rows)
            break;
        used += need;
        k += n;
        *blocks += n;
        shown++;
    }
    *fixed = used - *blocks; /* every block's one bar row is the bars' */
    return shown;
}

static void draw_block(watch_t *w, const watch_stream_t *s, unsigned c, const header_t *hd,
                       unsigned bar_rows)
{
    header_draw(w, hd);
    if (s->known && s->view.channels) {
        block_bars(w, &s->view.hist[c], bar_rows);
        return;
    }
    if (w->once) /* nothing to keep room for */
        return;
    for (unsigned r = 0; r <= bar_rows; r++) /* room kept for when it shows up */
        line(w, "%s", "");
}

static void draw(watch_t *w, bool resized)
{
    w->frame.len = 0;
    if (!w->once)
        tally_buf_printf(&w->frame, resized ? "\x1b[H\x1b[2J" : "\x1b[H");
    char now[16];
    clock_text(wall_s(), now, sizeof now);
    char where[256];
    line(w, "tally watch  %s%s%s  every %gs  %s  %s%s",
         fleet(w->cli) ? tally_fleet_redact(cli_nats_opts(w->cli, 0).servers, where, sizeof where)
                       : w->cli->endpoint,
         w->sub_endpoint || w->nsub ? "  sub " : "",
         w->sub_endpoint ? w->sub_endpoint
         : w->nsub       ? TALLY_NATS_SUBJ_WATCH "<k>"
                         : "",
         w->interval_s, w->log ? "log" : "linear", now, w->once ? "" : "  (q quits)");
    line(w, "%s", w->status);
    header_t *headers = calloc(w->count * HV_CHANNELS_MAX, sizeof *headers);
    if (!headers)
        return;
    unsigned k = 0;
    for (size_t i = 0; i < w->count; i++)
        for (unsigned c = 0; c < blocks_of(&w->streams[i]); c++)
            block_header(&w->streams[i], c, &headers[k++]);
    /* Each block: its header, its bars, an axis; the bars share what is left equally. */
    unsigned fixed, blocks;
    size_t shown = streams_shown(w, headers, &fixed, &blocks);
    int spare = (int)w->rows - (int)fixed - (shown < w->count ? 1 : 0);
    unsigned bar_rows = blocks && spare >= (int)blocks ? (unsigned)spare / blocks : 1;
    k = 0;
    for (size_t i = 0; i < shown; i++)
        for (unsigned c = 0; c < blocks_of(&w->streams[i]); c++, k++)
            draw_block(w, &w->streams[i], c, &headers[k], bar_rows);
    if (shown < w->count) { /* never silently: say what the screen has no room for */
        char names[512] = "";
        for (size_t i = shown; i < w->count && strlen(names) + 70 < sizeof names; i++)
            snprintf(names + strlen(names), sizeof names - strlen(names), " %s",
                     w->streams[i].name);
        line(w, "+%zu more (make the terminal taller):%s", w->count - shown, names);
    }
    free(headers);
    if (!w->once)
        fit_screen(w);
    write_all(w->frame.data, w->frame.len);
}

/* ---- The loop ----------------------------------------------------------------------------- */

/* Reads the keys typed; true when one of them quits. */
static bool keys_quit(bool *keyboard)
{
    char keys[64];
    ssize_t n = read(STDIN_FILENO, keys, sizeof keys);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        *keyboard = false; /* end of input (stdin is not a terminal): stop listening to it */
        return false;
    }
    for (ssize_t i = 0; i < n; i++)
        if (keys[i] == 'q' || keys[i] == 'Q')
            return true;
    return false;
}

static void drain_wake_pipe(void)
{
    char buf[64];
    while (read(wake_pipe[0], buf, sizeof buf) > 0) {
    }
}

/* Until a quit: a round and a frame every interval (with --sub: a liveness ping, and a frame
 * whenever publications arrive), a frame at once after a resize. */
static void watch_loop(watch_t *w)
{
    bool keyboard = isatty(STDIN_FILENO), first = true;
    double next = mono_s();
    bool resized = true;
    while (!got_quit) {
        if (mono_s() >= next) {
            if (subscribed(w) && !first)
                sub_tick(w);
            else
                poll_round(w);
            first = false;
            next += w->interval_s;
            if (next < mono_s()) /* a slow round: keep the rhythm from now on */
                next = mono_s() + w->interval_s;
            draw(w, resized);
            resized = false;
        }
        struct pollfd fds[3] = {{.fd = wake_pipe[0], .events = POLLIN},
                                {.fd = keyboard ? STDIN_FILENO : -1, .events = POLLIN},
                                {.fd = w->sub    ? tally_sub_fd(w->sub)
                                       : w->nsub ? tally_nats_sub_fd(w->nsub)
                                                 : -1,
                                 .events = POLLIN}};
        double wait_s = next - mono_s();
        int timeout = wait_s > 0 ? (int)ceil(wait_s * 1000) : 0;
        /* The subscription's fd is edge-triggered: drain before sleeping on it. */
        if (subscribed(w) && sub_drain(w))
            draw(w, false);
        if (poll(fds, 3, timeout) < 0 && errno != EINTR)
            break;
        if (fds[0].revents & POLLIN)
            drain_wake_pipe();
        if ((fds[1].revents & (POLLIN | POLLHUP)) && keys_quit(&keyboard))
            break;
        if (got_winch) {
            got_winch = 0;
            terminal_size(w);
            draw(w, true);
        }
    }
}

/* --once: two rounds an interval apart (the second has rates), one frame, no terminal codes.
 * Exit status as for any command: 3 when tallyd did not answer, 1 when it refused a stream
 * (each refusal said on stderr, in its words), else 0. */
static int watch_once(watch_t *w)
{
    poll_round(w);
    if (!w->down) {
        struct timespec ts = {(time_t)w->interval_s,
                              (long)((w->interval_s - floor(w->interval_s)) * 1e9)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR && !got_quit) {
        }
        poll_round(w);
    }
    if (w->down) {
        cli_error("watch: cannot reach tallyd at %s (%s)", w->cli->endpoint, w->down_why);
        return EXIT_TRANSPORT;
    }
    for (size_t i = 0; i < w->count; i++) { /* the daemon's words, not "(yet)": it is over */
        watch_stream_t *s = &w->streams[i];
        if (!s->known && s->refused != TALLY_OK)
            snprintf(s->problem, sizeof s->problem, "%s: %.100s", tally_status_name(s->refused),
                     s->refusal);
    }
    draw(w, false);
    int rc = cli_finish_stdout();
    for (size_t i = 0; i < w->count; i++) {
        const watch_stream_t *s = &w->streams[i];
        if (s->known || s->refused == TALLY_OK)
            continue;
        char what[16 + TALLY_STREAM_NAME_MAX];
        snprintf(what, sizeof what, "watch: %s", s->name);
        int src = cli_report(s->refused, what, s->refusal);
        rc = rc ? rc : src;
    }
    return rc;
}

/* ---- The command -------------------------------------------------------------------------- */

enum { OPT_INTERVAL = CLI_OPT_FIRST, OPT_LOG, OPT_ASCII, OPT_ONCE, OPT_SUB, OPT_SIZE };

static const cli_option_t watch_options[] = {
    {"interval", OPT_INTERVAL, "DURATION",
     "refresh every DURATION (1s, 500ms; 100ms to 1h;\ndefault 1s)"},
    {"log", OPT_LOG, NULL, "bar heights on a log scale (default linear)"},
    {"ascii", OPT_ASCII, NULL,
     "draw bars with '#' and '.' (default: block\n"
     "characters when the locale is UTF-8)"},
    {"once", OPT_ONCE, NULL,
     "print one frame (sampled twice, an interval apart, for\nthe rate) and exit; no terminal "
     "needed"},
    {"sub", OPT_SUB, "ENDPOINT",
     "take the histograms tallyd publishes on ENDPOINT\n(tallyd --pub) instead of querying "
     "each interval"},
    {"size", OPT_SIZE, "COLSxROWS",
     "draw for a screen of this size (80x24) instead of the\nterminal's (default: the "
     "terminal's, else $COLUMNS x\n$LINES, else 80x24)"},
    {0},
};

static const cli_group_t watch_groups[] = {{"Options", watch_options, 0}, {0}};

static const cli_setter_t watch_setters[] = {
    CLI_SET_TRUE(OPT_LOG, watch_t, log),
    CLI_SET_TRUE(OPT_ASCII, watch_t, ascii),
    CLI_SET_TRUE(OPT_ONCE, watch_t, once),
    CLI_SET_ARG(OPT_SUB, watch_t, sub_endpoint),
    {0},
};

/* --size COLSxROWS: from 16x4 (a status line, a block) to 1000x1000. */
static int size_option(watch_t *w, const char *arg)
{
    unsigned cols, rows;
    char end;
    if (sscanf(arg, "%ux%u%c", &cols, &rows, &end) != 2 || cols < 16 || rows < 4 || cols > 1000 ||
        rows > 1000)
        return cli_usage_error("watch",
                               "invalid size '%s' for --size: COLSxROWS, from 16x4 to "
                               "1000x1000",
                               arg);
    w->size = arg;
    w->size_cols = cols;
    w->size_rows = rows;
    return 0;
}

static int watch_option(void *ctx, int id, const char *arg, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    watch_t *w = ctx;
    if (id == OPT_SIZE)
        return size_option(w, arg);
    if (id != OPT_INTERVAL) /* the others are watch_setters' */
        return cli_usage_error("watch", "unknown option");
    uint64_t ms;
    int rc = cli_option_duration_ms("watch", "--interval", arg, 100, 3600000, &ms);
    w->interval_s = (double)ms / 1000.0;
    return rc;
}

static bool locale_is_utf8(void)
{
    const char *vars[] = {"LC_ALL", "LC_CTYPE", "LANG"};
    for (size_t i = 0; i < 3; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v)
            return strcasestr(v, "utf-8") || strcasestr(v, "utf8");
    }
    return false;
}

static int endpoint_arg(const char *option, const char *endpoint)
{
    char why[320];
    if (tally_endpoint_check(endpoint, TALLY_ENDPOINT_CONNECT, why, sizeof why) == TALLY_OK)
        return 0;
    return cli_usage_error("watch", "invalid endpoint '%s' for %s: %s", endpoint, option, why);
}

/* --sub: a subscription to each stream's name (publications of longer names that share it
 * are dropped on arrival). */
static int subscribe(watch_t *w)
{
    tally_status_t st = tally_sub_new_curve(w->sub_endpoint, &w->keys, &w->sub);
    if (st == TALLY_E_ARG)
        return cli_usage_error("watch", "--sub: invalid endpoint '%s'", w->sub_endpoint);
    for (size_t i = 0; st == TALLY_OK && i < w->count; i++)
        st = tally_sub_subscribe(w->sub, w->streams[i].name);
    return st == TALLY_OK ? 0 : cli_report(st, "watch: --sub", "cannot subscribe");
}

/* --nats: the publications on tally.watch.<k> of the streams' partitions, on a connection of
 * their own; where the workers publish nothing (pub_interval_ms 0 in their `info`) or the
 * subscription fails, the streams are queried each interval, as the status line says. */
static void nats_subscribe(watch_t *w)
{
    tally_nats_opts_t o = cli_nats_opts(w->cli, w->cli->timeout_ms);
    char why[256] = "", *text = NULL;
    tally_req_t req = {.opcode = TALLY_OP_INFO};
    tally_reply_t info;
    tally_reply_init(&info);
    tally_status_t st = tally_nats_new(&o, &w->nats, why, sizeof why);
    if (st == TALLY_OK && (st = tally_nats_call(w->nats, &req, NULL, 0, &info)) == TALLY_OK &&
        !(text = strndup(info.payload ? (const char *)info.payload : "", info.len)))
        st = TALLY_E_NOMEM;
    const char *at = text ? strstr(text, "pub_interval_ms=") : NULL;
    if (st == TALLY_OK && at && (at == text || at[-1] == '\n') && atoll(at + 16) == 0)
        snprintf(w->status, sizeof w->status,
                 "the fleet publishes nothing (pub_interval_ms 0): querying every interval");
    else if (st == TALLY_OK && (st = tally_nats_sub_new(w->nats, &w->nsub)) == TALLY_OK)
        for (size_t i = 0; st == TALLY_OK && i < w->count; i++)
            st = tally_nats_sub_stream(w->nsub, w->streams[i].name);
    if (st != TALLY_OK)
        snprintf(w->status, sizeof w->status, "not subscribed (%.160s): querying every interval",
                 why[0]    ? why
                 : w->nats ? tally_nats_error(w->nats)
                           : tally_status_name(st));
    if (!w->nsub || st != TALLY_OK) {
        tally_nats_sub_destroy(&w->nsub);
        tally_nats_destroy(&w->nats);
    }
    free(text);
    tally_reply_clear(&info);
}

static int run_watch(cli_t *cli, const cli_command_t *cmd, int argc, char **argv)
{
    watch_t w = {.cli = cli, .interval_s = 1.0};
    int rc = cli_parse(cli, cmd, &w, argc, argv);
    if (rc)
        return rc;
    w.count = (size_t)(argc - optind);
    w.streams = calloc(w.count, sizeof *w.streams);
    if (!w.streams) {
        cli_error("out of memory");
        return EXIT_USAGE;
    }
    for (size_t i = 0; i < w.count; i++) {
        w.streams[i].name = argv[optind + (int)i];
        if (!tally_stream_name_valid(w.streams[i].name, strlen(w.streams[i].name))) {
            rc = cli_usage_error("watch", "invalid stream name '%s'", w.streams[i].name);
            goto done;
        }
    }
    /* Checked once: later, an endpoint where nothing listens is only "unreachable" for now. */
    if (fleet(cli) && w.sub_endpoint) {
        rc = cli_usage_error("watch", "--sub takes tallyd's PUB socket; with --nats or --fleet "
                                      "watch subscribes to the fleet's publications itself");
        goto done;
    }
    if ((rc = endpoint_arg("-e", cli->endpoint)) != 0 ||
        (w.sub_endpoint && (rc = endpoint_arg("--sub", w.sub_endpoint)) != 0))
        goto done;
    w.utf8 = !w.ascii && locale_is_utf8();
    char kwhy[512];
    if (tally_curve_keys_load(cli->server_key, cli->client_key, &w.keys, kwhy, sizeof kwhy) !=
        TALLY_OK) {
        cli_error("CURVE keys: %s", kwhy);
        rc = EXIT_USAGE;
        goto done;
    }
    if (install_signals() != 0) {
        cli_error("watch: cannot set up signals: %s", strerror(errno));
        rc = EXIT_USAGE;
        goto done;
    }
    terminal_size(&w);
    if (w.once) {
        rc = watch_once(&w);
        goto done;
    }
    if (!isatty(STDOUT_FILENO)) {
        rc = cli_usage_error("watch", "stdout is not a terminal (use --once for one frame)");
        goto done;
    }
    if (w.sub_endpoint && (rc = subscribe(&w)) != 0)
        goto done;
    if (fleet(cli))
        nats_subscribe(&w);
    terminal_take();
    watch_loop(&w);
    terminal_restore();
    rc = 0; /* q and Ctrl-C are the ways to stop watching: both succeed */
done:
    explicit_bzero(&w.keys, sizeof w.keys);
    tally_client_destroy(&w.client);
    tally_sub_destroy(&w.sub);
    tally_nats_sub_destroy(&w.nsub);
    tally_nats_destroy(&w.nats);
    tally_buf_free(&w.frame);
    free(w.streams);
    return rc;
}

CLI_COMMAND(watch, .usage = "watch [OPTIONS] STREAM...",
            .summary = "live view of streams' histograms in the terminal",
            .about =
                "Show streams' running histograms, refreshed every interval: per stream (per\n"
                "channel for rgb8/rgba8) a line with the count, the rate (values/s since the last\n"
                "refresh), the mean and p50/p90/p99, then the 256 bins folded to the terminal's\n"
                "width as bars, and the first and last value of the range. Streams are shown one\n"
                "under another and share the terminal's height. A resize redraws at once. When\n"
                "tallyd does not answer, the status line says so and watch keeps retrying; it\n"
                "says when it has reconnected. With --sub the histograms come from tallyd's\n"
                "publications (PROTOCOL.md §11): a frame as soon as they arrive, a ping each\n"
                "interval to tell whether tallyd is there; with --nats or --fleet from the\n"
                "fleet's publications on tally.watch.<k> (PROTOCOL.md §13), queried each interval\n"
                "from each stream's owner where they cannot be had. Streams that do not fit the\n"
                "screen are "
                "named on a last line, \"+N more\". Quit with q or Ctrl-C (exit status 0).\n"
                "\n"
                "--once prints one frame and exits: 0, or 1 when tallyd refused a stream (an\n"
                "unknown stream: its message on stderr), 3 when tallyd cannot be reached.\n",
            .groups = watch_groups, .setters = watch_setters, .nargs = CLI_ARGS_ONE_OR_MORE,
            .option = watch_option, .run = run_watch);
