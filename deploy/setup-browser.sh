#!/usr/bin/env bash
# Installs what the dashboard's browser test (tests/integration/test_dashboard_browser.py)
# drives: Debian's chromium and chromium-driver (Selenium talks to /usr/bin/chromedriver; no
# browser is downloaded at test time). Idempotent; run as root, from anywhere.
set -euo pipefail

if ! command -v chromium > /dev/null || ! command -v chromedriver > /dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium chromium-driver > /dev/null
fi
echo "setup-browser: $(chromium --version 2>/dev/null), $(chromedriver --version | cut -d' ' -f1-2)"
