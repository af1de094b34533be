#!/usr/bin/env bash
# Take docs/images/top.png and report.png again, from a neutral place: the job runs in /home/demo/project with the
# Python of /home/demo/venv (a link to this checkout's .venv), so no machine's own paths show in the pictures.
# An 8-rank job on two "hosts" (localhost and 127.0.0.1) whose rank 5 sleeps 30 ms before each step
# (tests/integration/workers/steady.py); `hvdrun top --once` while it runs, then its --report page. Needs headless
# Chromium (make system-deps). Usage: bash docs/images/take.sh   (about a minute)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
images="$repo/docs/images"
demo=/home/demo
browser=$(command -v chromium || command -v chromium-browser)
mkdir -p "$demo/project"
ln -sfn "$repo/.venv" "$demo/venv"
cp "$repo/tests/integration/workers/steady.py" "$demo/project/train.py"
work=$(mktemp -d)
trap 'touch "$demo/project/release"; rm -rf "$work" "$demo/project/release" "$demo/project/job.html"' EXIT
cd "$demo/project"
rm -f release job.html
export PATH="$demo/venv/bin:$PATH"
python -m hvdrun -np 8 -H localhost:4,127.0.0.1:4 --report job.html train.py 5 release none \
  > "$work/job.out" 2>&1 &
job=$!
for _ in $(seq 120); do [ "$(grep -c ready "$work/job.out" || true)" -ge 8 ] && break; sleep 0.5; done
sleep 14  # the straggler's window fills, the charts get their samples
{ echo '$ hvdrun top --once'; hvdrun top --once; } > "$work/top.txt" 2>&1
touch release
wait "$job"
if ! grep -q "straggler: rank 5 on" job.html; then  # under load the verdict may name the host: the page says rank 5
  echo "this time the job's verdict did not name rank 5 alone; run again" >&2
  exit 1
fi

shoot() {  # shoot PAGE PNG WIDTH HEIGHT
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$work/chromium" \
    --window-size="$3,$4" --screenshot="$2" "$1" >/dev/null 2>&1
}
python - "$work/top.txt" "$work/top.html" <<'EOF'
import html, sys
text = open(sys.argv[1]).read().rstrip("\n")
page = ('<html><body style="margin:0;background:#111;color:#ddd">'
        '<pre style="font:14px/1.1 DejaVu Sans Mono,monospace;margin:12px">' + html.escape(text) + "</pre></body></html>")
open(sys.argv[2], "w").write(page)
EOF
lines=$(wc -l < "$work/top.txt")
shoot "file://$work/top.html" "$images/top.png" 1600 $((lines * 15 + 40))
shoot "file://$demo/project/job.html" "$images/report.png" 1000 1900
echo "took $images/top.png and $images/report.png"
