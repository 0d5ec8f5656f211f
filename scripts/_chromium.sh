# Sourced by scripts/test and .ci/run: the dashboard's browser tests (tests/browser) drive
# Debian's chromium through Playwright, and are never skipped, so the browser must be
# there. As root (CI, containers) a missing one is installed with apt-get; anyone else is
# told how to install it. TETHER_CHROMIUM names another Chromium or Chrome binary.
chromium=${TETHER_CHROMIUM:-/usr/bin/chromium}
if ! command -v "$chromium" >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing chromium (apt-get) for the dashboard's browser tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "error: the dashboard's browser tests need chromium at $chromium." >&2
        echo "Install it with 'sudo apt-get install chromium' (Debian, Ubuntu), or set TETHER_CHROMIUM" >&2
        echo "to a Chromium or Chrome binary. Browser tests are never skipped." >&2
        exit 1
    fi
fi
"$chromium" --version >/dev/null 2>&1 || { echo "error: $chromium --version failed" >&2; exit 1; }
