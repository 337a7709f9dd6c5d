#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what tallyd needs to build and test on Debian 12 (the single list of packages).
# Skips apt entirely when everything is already there. Uses sudo when not run as root.
set -euo pipefail
packages=(build-essential cmake pkg-config libzmq3-dev libuv1-dev libcmocka-dev
          libinih-dev libmicrohttpd-dev libsystemd-dev zlib1g-dev systemd curl
          nats-server libnats-dev  # the NATS JetStream fleet (issue 22) and its test cluster
          openssl  # test_nats_security: the test cluster's TLS certificates (contrib/nats/make-certs.sh)
          clang libclang-rt-dev  # clang + libFuzzer: the fuzz target in tests/fuzz/
          python3 python3-numpy python3-pip python3-venv  # the Python binding
          python3-pytest python3-mypy  # its tests and type check
          python3-prometheus-client python3-yaml  # test_prometheus, test_grafana_dashboard
          scdoc man-db  # the man pages (man/) and their test
          gcovr  # scripts/coverage.sh: coverage by folder against tests/coverage-floors.txt
          python3-jsonschema  # test_web_api: the HTTP API against web/schema/
          chromium chromium-driver python3-selenium  # test_web_browser: the page in a browser
          debhelper dh-python python3-all python3-setuptools pybuild-plugin-pyproject
          lintian)  # the Debian packages: scripts/package.sh, scripts/package-test.sh
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
echo "installing: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
