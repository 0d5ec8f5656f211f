# Sourced by scripts/demo and scripts/test: make (or reuse) the venv of $PYTHON and set VENV.
# PYTHON=python3.13 picks the interpreter; its venv is .venv (default python3) or .venv-<version>.
PYTHON=${PYTHON:-python3}
version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ -z "${VENV:-}" ]; then
    VENV=.venv
    if [ "$PYTHON" != python3 ]; then VENV=.venv-$version; fi
fi
# A venv made by another interpreter version would run the wrong Python: make it anew.
if [ -x "$VENV/bin/python" ] \
    && [ "$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$version" ]; then
    echo "== $VENV was made by another Python; recreating it for $version"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
