/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_part_int.h — what a partition's two files share, included by them alone: td_fleet_part.c
 * (its life: taken, checkpointed, given up or lost) and td_fleet_window.c (its messages applied
 * through the request path, and its step). The rest of the fleet calls them through
 * td_fleet_int.h.
 */
#ifndef TD_PART_INT_H
#define TD_PART_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "td_fleet_int.h"

/* td_fleet_window.c: a window entry's message goes (the path may still hold it). */
void td_win_entry_release(td_win_entry_t *e);
/* Empties the window: what is in the request path is forgotten (its reply, when it comes, finds
 * no slot; the path lets its messages go when it is done with them). */
void td_part_forget_window(td_fleet_t *f, td_part_t *p);
/* Messages applied after one that was refused and waits in the window: a checkpoint now would
 * hold their effect at a watermark below them (applied twice by the next owner). */
bool td_part_applied_above_refused(const td_fleet_t *f, const td_part_t *p);

/* td_fleet_part.c: a take under way (p->taking; its lease valid), finished once its reader made
 * the consumer, given up when it could not; true when the partition may go on with its step
 * (*acted: it did something). */
bool td_part_take_step(td_fleet_t *f, td_part_t *p, bool *acted);
/* A message past high_seq + 1: true when it is to be applied (the ones between were removed
 * from the stream), false when the consumer reads again from high_seq + 1. */
bool td_part_accept_gap(td_fleet_t *f, td_part_t *p, uint64_t seq);

#endif
