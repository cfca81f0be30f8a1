#!/usr/bin/env bash
# Installs the programs some tests drive, from Debian's packages (nothing is downloaded at
# test time): chromium and chromium-driver for the dashboard's browser test
# (tests/integration/test_dashboard_browser.py, through Selenium and /usr/bin/chromedriver),
# prometheus for `promtool check metrics` (tests/integration/test_training_metrics.py), and
# iptables for the NAT router of tests/multinode/test_nat.py (deploy/netns.py --nated).
# Idempotent; run as root, from anywhere.
set -euo pipefail

if ! command -v chromium > /dev/null || ! command -v chromedriver > /dev/null \
        || ! command -v promtool > /dev/null || ! command -v iptables > /dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium chromium-driver prometheus \
        iptables > /dev/null
fi
echo "setup-test-tools: $(chromium --version 2>/dev/null), $(chromedriver --version | cut -d' ' -f1-2)," \
    "$(promtool --version 2>&1 | head -1)", "$(iptables --version)"
