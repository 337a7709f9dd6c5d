#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs tests/test_web_MODE.py (api: the HTTP JSON API against web/schema/; browser: the page in
# headless Chromium; fleet: a fleet worker's API and page, against a NATS cluster) with the first
# of $PYTHON, python3 and /usr/bin/python3 that has what the mode needs: jsonschema
# (python3-jsonschema); for browser and fleet also selenium (python3-selenium), with chromium and chromedriver (Debian's chromium, chromium-driver). Skipped (77) only when
# one of those is absent; scripts/install-deps.sh installs them all.
# usage: test_web.sh api|browser|fleet TALLYD TALLY SOURCE_DIR [BUILD_DIR]
set -eu
mode=$1
shift
need="import jsonschema"
if [ "$mode" = browser ] || [ "$mode" = fleet ]; then
    need="import jsonschema, selenium"
    for bin in chromium chromedriver; do
        if ! command -v "$bin" >/dev/null 2>&1; then
            echo "no $bin (apt-get install chromium chromium-driver): skipping"
            exit 77
        fi
    done
fi
for cand in "${PYTHON:-}" python3 /usr/bin/python3; do
    [ -n "$cand" ] || continue
    if "$cand" -c "$need" >/dev/null 2>&1; then
        exec "$cand" "$3/tests/test_web_$mode.py" "$@"
    fi
done
echo "no python3 that can '$need' (apt-get install python3-jsonschema python3-selenium): skipping"
exit 77
