#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# bench_routerd with a relative --out hands nginx paths that resolve: nginx
# takes -c relative to its -p prefix, so a relative out dir gave it
# OUT/nginx/OUT/nginx/nginx.conf (issue 38).  A stand-in nginx records its
# arguments and resolves -c as nginx does.
#   test_bench_routerd_out.sh BENCH_ROUTERD WORK_DIR
set -u
BENCH=$1
W=$2
rm -rf "$W"
mkdir -p "$W/run"
cat > "$W/nginx" <<'EON'
#!/bin/sh
prefix= conf=
while [ $# -gt 0 ]; do
  case $1 in
    -p) prefix=$2; shift ;;
    -c) conf=$2; shift ;;
  esac
  shift
done
case $conf in
  /*) path=$conf ;;
  *) path=$prefix$conf ;;
esac
echo "$path" > "$NGINX_SEEN"
exit 1
EON
chmod +x "$W/nginx"
cd "$W/run" || exit 1
NGINX_SEEN="$W/seen" "$BENCH" --quick --duration 0.1 --warmup 0 --rates 10 \
  --prompts small --only nginx --nginx "$W/nginx" --out bench-out \
  > "$W/bench.log" 2>&1
if [ ! -s "$W/seen" ]; then
  echo "FAIL: the stand-in nginx never ran"; cat "$W/bench.log"; exit 1
fi
conf=$(cat "$W/seen")
if [ ! -f "$conf" ]; then
  echo "FAIL: nginx would read $conf, which does not exist"; exit 1
fi
echo "test_bench_routerd_out: ok (nginx -c resolves to $conf)"
