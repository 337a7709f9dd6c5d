/*
 * td_state.h — persistent stream state: every stream's name and tally_stream_info_t (counters,
 * scan carry, running histogram, last applied seq) in one file, streams.state, in the state
 * directory.
 *
 * File format (all integers little-endian; version 1):
 *   offset 0   8 bytes  magic "TLYDSTAT"
 *          8   u32      format version (TD_STATE_VERSION)
 *         12   u32      number of streams
 *         16   u64      length of the records that follow, in bytes
 *         24   u64      time written (seconds since the epoch; informational)
 *         32   records  per stream: u8 name length (1..64), the name (printable ASCII), then the
 *                       stream's state as tally_stream_info_encode writes it (the `query` reply
 *                       payload, TALLY_QUERY_PAYLOAD_SIZE bytes, layout in PROTOCOL.md), which
 *                       includes last_seq at payload bytes 104..111 (reserved zeros in files
 *                       written before sequence numbers existed, so those load with last_seq 0)
 *   end - 8    u64      FNV-1a 64 of every byte before it
 *
 * Writing is atomic: the bytes go to streams.state.tmp in the same directory, which is
 * fsync'ed, renamed over streams.state, and the directory fsync'ed; a crash at any point
 * leaves either the old file or the new one. Restoring never fails the daemon: a missing file
 * means no streams; a file that is truncated, corrupt (checksum) or of another version is
 * renamed to streams.state.corrupt-<UTC time>, logged at warning, and tallyd starts empty.
 */
#ifndef TD_STATE_H
#define TD_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "td_stream.h"

#define TD_STATE_MAGIC "TLYDSTAT"
#define TD_STATE_VERSION 1u
#define TD_STATE_HEADER_SIZE 32u
#define TD_STATE_TRAILER_SIZE 8u

/* Loop thread: serialises every stream into a malloc'ed file image (*buf, *len). */
tally_status_t td_state_encode(td_streams_t *streams, uint8_t **buf, size_t *len);
/* Checks a whole file image and adds its streams to `streams` (all or none: nothing is added
 * unless the image is valid). TALLY_E_PARAM with a reason in msg when it is not valid. */
tally_status_t td_state_decode(const uint8_t *buf, size_t len, td_streams_t *streams, char *msg,
                               size_t msg_cap);
/* The checksum used in the trailer. */
uint64_t td_state_checksum(const uint8_t *buf, size_t len);

/* Any thread: writes the image to DIR/streams.state atomically. TALLY_E_IO with msg on error. */
tally_status_t td_state_write(const char *dir, const uint8_t *buf, size_t len, char *msg,
                              size_t msg_cap);
/* Loop thread, at start: restores DIR/streams.state into `streams`. Always leaves tallyd able
 * to run: a bad file is set aside and logged. Returns the number of streams restored. */
unsigned td_state_restore(const char *dir, td_streams_t *streams);

#endif
