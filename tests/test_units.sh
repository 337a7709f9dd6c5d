#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# systemd-analyze verify on tallyd.service and tallyd.socket (the build-tree copies, whose
# ExecStart names the tallyd built here: verify checks that it exists and is executable).
# Any diagnostic about our units fails the test, not only an exit status: verify reports
# unknown keys and bad values as warnings. Skipped (77) where systemd-analyze is absent.
# USER: the build's TALLY_SERVICE_USER (empty: the service runs as a dynamic user; a name: as
# that system user, User= and Group=, which the package creates).
# usage: test_units.sh UNIT_DIR [USER]
set -u
unit_dir=$1
user=${2:-}
# The socket unit is opt-in: enabling the service must not enable it too (it would hold
# 127.0.0.1:5555 after a reboot, against a `bind` of it in tallyd.conf).
if grep -q '^Also=.*tallyd\.socket' "$unit_dir/tallyd.service"; then
  echo "FAIL: enabling tallyd.service enables tallyd.socket (Also=)"
  exit 1
fi
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "systemd-analyze not found: skipping"
  exit 77
fi
out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify "$unit_dir/tallyd.service" \
  "$unit_dir/tallyd.socket" 2>&1)
rc=$?
echo "$out"
if [ $rc -ne 0 ]; then
  echo "FAIL: systemd-analyze verify exited $rc"
  exit 1
fi
if printf '%s\n' "$out" | grep -q 'tallyd'; then
  echo "FAIL: systemd-analyze verify complained about the tallyd units"
  exit 1
fi
# What the issue asks of the service unit, spelled out.
if [ -n "$user" ]; then
  runs_as="User=$user"
  grep -qx "Group=$user" "$unit_dir/tallyd.service" ||
    { echo "FAIL: tallyd.service lacks Group=$user"; exit 1; }
  if grep -q '^DynamicUser=' "$unit_dir/tallyd.service"; then
    echo "FAIL: tallyd.service has DynamicUser= beside User=$user"
    exit 1
  fi
else
  runs_as='DynamicUser=yes'
fi
for key in 'Type=notify' 'Restart=on-failure' "$runs_as" 'StateDirectory=tallyd' \
  'RuntimeDirectory=tallyd' 'ProtectSystem=strict' 'NoNewPrivileges=yes' \
  'DevicePolicy=closed' 'DeviceAllow=char-nvidia-frontend rw' 'WatchdogSec=' \
  'ExecReload=/bin/kill -HUP $MAINPID' 'UMask=0077' 'SystemCallFilter=@system-service' \
  'RestrictAddressFamilies=' 'ProtectProc=invisible'; do
  grep -qF "$key" "$unit_dir/tallyd.service" || { echo "FAIL: tallyd.service lacks $key"; exit 1; }
done
# Reload: systemd 253+ sends SIGHUP itself (Type=notify-reload); before, ExecReload does.
if ! grep -q '^Type=notify-reload$' "$unit_dir/tallyd.service" &&
  ! grep -qF 'ExecReload=/bin/kill -HUP $MAINPID' "$unit_dir/tallyd.service"; then
  echo "FAIL: tallyd.service has neither Type=notify-reload nor ExecReload"
  exit 1
fi
if grep -q '^PrivateDevices=yes' "$unit_dir/tallyd.service"; then
  echo "FAIL: PrivateDevices=yes would hide the GPU"
  exit 1
fi
if grep -q '^MemoryDenyWriteExecute=yes' "$unit_dir/tallyd.service"; then
  echo "FAIL: MemoryDenyWriteExecute=yes would stop the CUDA driver's JIT"
  exit 1
fi
grep -q '^SocketMode=0660' "$unit_dir/tallyd.socket" || { echo "FAIL: socket not 0660"; exit 1; }
# The exposure score (issue 11: at most 2.0), where this systemd can rate a unit file offline.
if sec=$(systemd-analyze security --offline=true "$unit_dir/tallyd.service" 2>/dev/null); then
  score=$(printf '%s\n' "$sec" | sed -n 's/.*Overall exposure level for tallyd.service: \([0-9.]*\).*/\1/p')
  echo "systemd-analyze security: $score"
  if [ -z "$score" ] || awk -v s="$score" 'BEGIN { exit !(s > 2.0) }'; then
    echo "FAIL: exposure level '$score' is above 2.0"
    exit 1
  fi
fi
grep -q '^ListenStream=127.0.0.1:5555' "$unit_dir/tallyd.socket" || exit 1
grep -q '^ListenStream=/run/tallyd/tallyd.sock' "$unit_dir/tallyd.socket" || exit 1
echo "units verified"
