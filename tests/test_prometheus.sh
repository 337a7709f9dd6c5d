#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs tests/test_prometheus.py MODE with the first of $PYTHON, python3 and /usr/bin/python3
# that has prometheus_client and yaml (Debian's python3-prometheus-client and python3-yaml, from
# install-deps.sh); skipped (77) when none has.
# usage: test_prometheus.sh MODE TALLYD TALLY SOURCE_DIR
set -eu
for cand in "${PYTHON:-}" python3 /usr/bin/python3; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import prometheus_client.parser, yaml' >/dev/null 2>&1; then
        exec "$cand" "$4/tests/test_prometheus.py" "$@"
    fi
done
echo "no python3 with prometheus_client and yaml (apt-get install python3-prometheus-client python3-yaml): skipping"
exit 77
