/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_counters.c — see td_counters.h.
 */
#include <stddef.h>

#include "td_counters.h"

const double td_latency_bounds_us[TD_LATENCY_BUCKETS] = {
    25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 1000000,
};

void td_metrics_observe(td_metrics_t *m, unsigned opcode, tally_status_t status, size_t bytes_in,
                        size_t bytes_out, uint64_t latency_ns)
{
    unsigned op = opcode < TALLY_OP_COUNT ? opcode : 0;
    unsigned st = (unsigned)status < TALLY_STATUS_WIRE_COUNT ? (unsigned)status : TALLY_E_INTERNAL;
    m->requests[op][st]++;
    m->bytes_in += bytes_in;
    m->bytes_out += bytes_out;
    double us = (double)latency_ns / 1e3;
    unsigned b = 0;
    while (b < TD_LATENCY_BUCKETS && us > td_latency_bounds_us[b])
        b++;
    m->latency_buckets[op][b]++;
    m->latency_sum_s[op] += (double)latency_ns / 1e9;
}

uint64_t td_metrics_answered(const td_metrics_t *m)
{
    uint64_t answered = 0;
    for (unsigned op = 0; op < TALLY_OP_COUNT; op++)
        for (unsigned st = 0; st < TALLY_STATUS_WIRE_COUNT; st++)
            answered += m->requests[op][st];
    return answered;
}

void td_metrics_set_gpus(td_metrics_t *m, unsigned devices)
{
    m->gpu_devices = devices < TD_METRICS_GPUS_MAX ? devices : TD_METRICS_GPUS_MAX;
}

void td_metrics_count_gpu_request(td_metrics_t *m, int ordinal)
{
    if (ordinal >= 0 && ordinal < TD_METRICS_GPUS_MAX)
        m->gpu_requests[ordinal]++;
}

void td_metrics_count_region_request(td_metrics_t *m, int ordinal, bool peer)
{
    if (ordinal >= 0 && ordinal < TD_METRICS_GPUS_MAX)
        m->gpu_region_requests[ordinal][peer]++;
}

void td_metrics_gpu_stages(td_metrics_t *m, const uint64_t stamp[TD_GPU_STAGES], uint64_t start,
                           unsigned first, unsigned last)
{
    for (unsigned i = first; i <= last; i++)
        if (!stamp[i])
            return;
    for (unsigned i = first; i <= last; i++) {
        uint64_t from = i ? stamp[i - 1] : start;
        m->gpu_stage_ns[i] += stamp[i] > from ? stamp[i] - from : 0; /* clocks of two threads */
        m->gpu_stage_count[i]++;
    }
}

void td_metrics_add(td_metrics_t *dst, const td_metrics_t *src)
{
    for (unsigned op = 0; op < TALLY_OP_COUNT; op++) {
        for (unsigned st = 0; st < TALLY_STATUS_WIRE_COUNT; st++)
            dst->requests[op][st] += src->requests[op][st];
        for (unsigned b = 0; b <= TD_LATENCY_BUCKETS; b++)
            dst->latency_buckets[op][b] += src->latency_buckets[op][b];
        dst->latency_sum_s[op] += src->latency_sum_s[op];
    }
    struct {
        uint64_t *to;
        const uint64_t *from;
    } sums[] = {
        {&dst->bytes_in, &src->bytes_in},
        {&dst->bytes_out, &src->bytes_out},
        {&dst->replies_dropped_gone, &src->replies_dropped_gone},
        {&dst->replies_dropped_slow, &src->replies_dropped_slow},
        {&dst->backend_fallbacks, &src->backend_fallbacks},
        {&dst->read_pauses, &src->read_pauses},
        {&dst->state_write_failures, &src->state_write_failures},
        {&dst->state_bytes_written, &src->state_bytes_written},
        {&dst->notify_failures, &src->notify_failures},
        {&dst->shm_requests, &src->shm_requests},
    };
    for (size_t i = 0; i < sizeof sums / sizeof sums[0]; i++)
        *sums[i].to += *sums[i].from;
    for (unsigned g = 0; g < TD_METRICS_GPUS_MAX; g++) {
        dst->gpu_requests[g] += src->gpu_requests[g];
        dst->gpu_region_requests[g][0] += src->gpu_region_requests[g][0];
        dst->gpu_region_requests[g][1] += src->gpu_region_requests[g][1];
    }
    for (unsigned i = 0; i < TD_GPU_STAGES; i++) {
        dst->gpu_stage_ns[i] += src->gpu_stage_ns[i];
        dst->gpu_stage_count[i] += src->gpu_stage_count[i];
    }
    for (unsigned l = 0; l < TD_LIMIT_COUNT; l++)
        dst->limited[l] += src->limited[l];
    if (src->gpu_devices > dst->gpu_devices)
        dst->gpu_devices = src->gpu_devices;
}
