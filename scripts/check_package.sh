#!/usr/bin/env bash
# What a user gets from `pip install diloco`, checked from outside the source tree.
#
# Proves that:
# 1. the public API type-checks: mypy with pyproject.toml's [tool.mypy] (diloco, diloco.core,
#    diloco.worker, diloco.integrations) reports no error;
# 2. the wheel builds (pip wheel --no-deps) and installs into a fresh virtual env (torch first,
#    the CPU build), and `import diloco` there resolves to that env's site-packages, not to
#    this checkout;
# 3. the installed package works: `diloco --help`, `diloco plan --sweep` and a short
#    deterministic `diloco sim` (exit 0, no violations) run; diloco/py.typed (PEP 561) is
#    installed; `diloco server --http 127.0.0.1:0` serves the dashboard page (dashboard.html,
#    package data) at its printed address.
#
# Usage (from anywhere; the python on PATH needs mypy, as `pip install -e '.[test]'` gives):
#   bash scripts/check_package.sh
# Ends with one line:  RESULT package ok wheel=NAME ... total=Ns. Exits non-zero on any failure.
set -euo pipefail

TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
SIM_SEED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python}
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

TMP=$(mktemp -d)
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT

START=$SECONDS
STEP_START=$SECONDS
TIMES=""
say() { printf '\n==> [%3ds] %s\n' "$((SECONDS - START))" "$*"; STEP_START=$SECONDS; }
took() { TIMES="$TIMES $1=$((SECONDS - STEP_START))s"; }
fail() { printf 'FAILED: %s\n' "$*" >&2; echo "RESULT package FAILED: $*"; exit 1; }

say "type-checking the public API: mypy (pyproject.toml [tool.mypy])"
"$PYTHON" -m mypy || fail "mypy reported errors"
took mypy

say "building the wheel"
"$PYTHON" -m pip wheel --no-deps -q -w "$TMP/dist" "$ROOT"
WHEEL=$(ls "$TMP"/dist/diloco-*.whl)
echo "built $(basename "$WHEEL")"
took wheel

say "installing it into a fresh virtual env: torch==$TORCH_VERSION (CPU) first, then the wheel"
"$PYTHON" -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
if ! "$VPY" -m pip install -q "torch==$TORCH_VERSION"; then
    echo "plain install failed; retrying from the PyTorch CPU index $TORCH_CPU_INDEX"
    "$VPY" -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
fi
"$VPY" -m pip install -q "$WHEEL"
took install

mkdir "$TMP/work"
cd "$TMP/work"  # the checkout is not on sys.path from here
export PATH="$TMP/venv/bin:$PATH"
hash -r

say "the installed package is the one imported"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
WHERE=$("$VPY" -c 'import diloco, sys; print(diloco.__file__)')
echo "diloco imported from $WHERE"
case "$WHERE" in
    "$SITE"/diloco/__init__.py) ;;
    *) fail "diloco resolves to $WHERE, not into $SITE" ;;
esac
PKG=$(dirname "$WHERE")
[ -f "$PKG/py.typed" ] || fail "py.typed is not in the installed package ($PKG)"
echo "py.typed installed: $PKG/py.typed"
took import

say "diloco --help, diloco plan --sweep, diloco sim --seed $SIM_SEED (short)"
diloco --help >"$TMP/help.txt" || fail "diloco --help exited $?"
grep -q "usage: diloco" "$TMP/help.txt" || fail "diloco --help printed no usage"
diloco plan --sweep >"$TMP/plan.txt" || fail "diloco plan --sweep exited $?"
grep -q "DiLoCo" "$TMP/plan.txt" || fail "diloco plan --sweep printed no DiLoCo row"
diloco sim --seed "$SIM_SEED" --workers 3 --rounds 5 --faults light >"$TMP/sim.txt" 2>&1 \
    || { tail -n 20 "$TMP/sim.txt"; fail "diloco sim --seed $SIM_SEED exited non-zero"; }
SIM_RESULT=$(grep '^RESULT sim ' "$TMP/sim.txt" || true)
echo "$SIM_RESULT"
case "$SIM_RESULT" in
    *" violations=0") ;;
    *) fail "diloco sim --seed $SIM_SEED: no RESULT line with violations=0" ;;
esac
took cli

say "the dashboard page from the installed package: diloco server --http 127.0.0.1:0"
diloco server --bind tcp://127.0.0.1:0 --http 127.0.0.1:0 >"$TMP/server.txt" 2>&1 &
SERVER_PID=$!
URL=""
for _ in $(seq 1 100); do  # up to 20 s
    URL=$(sed -n 's|^  dashboard \(http://127\.0\.0\.1:[0-9]*/\).*|\1|p' "$TMP/server.txt")
    [ -n "$URL" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$TMP/server.txt"; fail "diloco server exited before serving"; }
    sleep 0.2
done
[ -n "$URL" ] || { cat "$TMP/server.txt"; fail "diloco server printed no dashboard address within 20 s"; }
echo "GET $URL"
"$VPY" - "$URL" <<'EOF' || fail "the dashboard at $URL is not the HTML page"
import sys
import urllib.request

with urllib.request.urlopen(sys.argv[1], timeout=10) as resp:
    ctype = resp.headers.get("Content-Type", "")
    page = resp.read().decode("utf-8")
ok = resp.status == 200 and "text/html" in ctype and "<html" in page.lower() and "<title>" in page.lower()
title = page.split("<title>", 1)[-1].split("</title>", 1)[0] if "<title>" in page else "?"
print(f"HTTP {resp.status} {ctype}, {len(page)} chars, title {title!r}")
sys.exit(0 if ok else 1)
EOF
kill "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
SERVER_PID=""
took dashboard

echo
echo "RESULT package ok wheel=$(basename "$WHEEL") mypy=clean sim_seed=$SIM_SEED dashboard=ok total=$((SECONDS - START))s ($TIMES )"
