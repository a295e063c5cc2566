#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvplane-bench's HTML report as a person sees it: rendered by a real
# headless browser (Debian's chromium), the DOM it builds has every plot with
# enough points, and the screenshot is not blank: the focus policy's red and
# its peer's blue are on screen.  Skips (77) only when chromium is missing or
# cannot render here.  Usage: test_bench_report_browser.sh BENCH SHARED
set -euo pipefail
bench=$1 shared=$2
agent=$shared/traces/cc_agentic
[ -d "$agent" ] || { echo "SKIP: traces not in $shared"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 missing"; exit 77; }
chrome=
for c in chromium chromium-browser google-chrome; do
  command -v "$c" >/dev/null && { chrome=$c; break; }
done
[ -n "$chrome" ] || { echo "SKIP: chromium is not installed (.ci/deps installs it)"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# chromium wants a writable home and profile; no GPU, no sandbox (CI runs as root)
export HOME=$tmp
run_chrome() {
  timeout 120 "$chrome" --headless --disable-gpu --no-sandbox --no-first-run \
    --user-data-dir="$tmp/profile" --hide-scrollbars "$@" 2>"$tmp/chrome.err"
}

"$bench" run --no-progress --quiet --limit 1200 --out "$tmp/r" "$agent" >/dev/null
html=$tmp/r/report.html
[ -s "$html" ] || fail "no report"
if ! run_chrome --dump-dom "file://$html" > "$tmp/dom.html" || [ ! -s "$tmp/dom.html" ]; then
  echo "SKIP: chromium cannot render here: $(tail -3 "$tmp/chrome.err")"; exit 77
fi
run_chrome --screenshot="$tmp/shot.png" --window-size=1100,2600 "file://$html" >/dev/null ||
  fail "screenshot failed: $(tail -3 "$tmp/chrome.err")"
[ -s "$tmp/shot.png" ] || fail "no screenshot"

python3 - "$tmp/dom.html" "$tmp/shot.png" <<'PY'
import re, struct, sys, zlib
dom, png = open(sys.argv[1]).read(), open(sys.argv[2], "rb").read()

# 1. the DOM the browser built: four plots, each with real data
svgs = re.findall(r"<svg class=\"plot[^\"]*\".*?</svg>", dom, re.S)
assert len(svgs) == 4, len(svgs)
titles = [re.search(r"<title>(.*?)</title>", s).group(1) for s in svgs]
assert titles[0].startswith("Where the prompt tokens went"), titles
assert re.search(r"class=\"bar\"", svgs[0]), "no bars"
assert len(re.findall(r"class=\"bar\"", svgs[0])) >= 9
for s, t in zip(svgs[1:], titles[1:]):
    paths = re.findall(r"<path class=\"series\" data-name=\"([^\"]*)\"[^>]* d=\"([^\"]*)\"", s)
    assert len(paths) >= 3, (t, len(paths))
    pts = {n: len(re.findall(r"[ML][0-9.]+,[0-9.]+", d)) for n, d in paths}
    assert max(pts.values()) >= 20, (t, pts)      # a curve, not a dot
    if not t.startswith("Tier occupancy"):
        assert pts["kvplane_cost"] >= 20, (t, pts)
for w in ("Best peer by TTFT p95", "What the columns mean", "Cluster", "GPU"):
    assert w in dom, w

# 2. the screenshot: decode the PNG (8-bit RGB/RGBA, filters 0-4)
w, h, depth, ctype = struct.unpack(">IIBB", png[16:26])
assert depth == 8 and ctype in (2, 6), (depth, ctype)
idat, i = b"", 8
while i < len(png):
    n, kind = struct.unpack(">I4s", png[i:i + 8])
    if kind == b"IDAT":
        idat += png[i + 8:i + 8 + n]
    i += 12 + n
raw, bpp = zlib.decompress(idat), 3 if ctype == 2 else 4
stride, prev, rows, o = w * bpp, bytearray(w * bpp), [], 0
for y in range(h):
    f, line = raw[o], bytearray(raw[o + 1:o + 1 + stride])
    o += 1 + stride
    for x in range(stride):
        a = line[x - bpp] if x >= bpp else 0
        b, c = prev[x], prev[x - bpp] if x >= bpp else 0
        if f == 1: line[x] = (line[x] + a) & 255
        elif f == 2: line[x] = (line[x] + b) & 255
        elif f == 3: line[x] = (line[x] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append(line)
    prev = line
def near(px, rgb, tol=40):
    return all(abs(px[k] - rgb[k]) <= tol for k in range(3))
n = white = red = blue = 0
lum = []
for line in rows[::2]:
    for x in range(0, stride, bpp * 2):
        px = line[x:x + 3]
        n += 1
        white += px[0] > 245 and px[1] > 245 and px[2] > 245
        red += near(px, (214, 39, 40))
        blue += near(px, (31, 119, 180))
        lum.append(sum(px) / 3)
mean = sum(lum) / len(lum)
var = sum((v - mean) ** 2 for v in lum) / len(lum)
print(f"screenshot {w}x{h}: {100 * (n - white) / n:.1f}% non-white, "
      f"luminance variance {var:.0f}, red {red}, blue {blue} (sampled)")
assert white < n * 0.97, "blank screenshot"
assert var > 100, "flat screenshot"
assert red > 50, "the focus policy (red) is not on screen"
assert blue > 20, "the best peer (blue) is not on screen"
print("browser render ok")
PY
