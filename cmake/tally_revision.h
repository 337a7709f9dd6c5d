/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_revision.h — the git revision tallyd and tally were built from: `git describe --always
 * --dirty` of the source tree ("0.1.0-12-g1a2b3c4-dirty", or a short hash), or "unknown" when
 * the tree was not a git checkout. Written at every build by cmake/revision.cmake (a new commit
 * needs no re-configure). Shown by `tallyd --version`, `tally --version` and the metric
 * tallyd_build_info{revision="..."}.
 */
#ifndef TALLY_REVISION_H
#define TALLY_REVISION_H

extern const char tally_build_revision[];

#endif
