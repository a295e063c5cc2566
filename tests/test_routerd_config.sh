#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvplane-routerd --check-config: the example config passes; broken configs
# fail with exit 2 and "file:line: section.key: ..." naming what is wrong.
#   tests/test_routerd_config.sh KVPLANE_ROUTERD EXAMPLE_YAML WORK_DIR
set -u
RD=$1 EX=$2 W=$3
mkdir -p "$W"
fail=0
# its receipts go to /var/log/kvplane (the unit's LogsDirectory): here, to W
# (--check-config opens the path as the daemon will)
sed "s|/var/log/kvplane/|$W/|" "$EX" > "$W/example.yaml"
out=$("$RD" --config "$W/example.yaml" --check-config 2>&1)
if [ $? -eq 0 ]; then echo "ok   example config: $out"; else echo "FAIL example config: $out"; fail=1; fi

# bad NAME YAML EXPECTED: --check-config must exit 2 and print EXPECTED
bad() {
  printf '%b' "$2" > "$W/$1.yaml"
  out=$("$RD" --config "$W/$1.yaml" --check-config 2>&1); rc=$?
  if [ $rc -eq 2 ] && grep -qF -- "$3" <<< "$out"; then echo "ok   $1: $out"
  else echo "FAIL $1 (rc $rc, want '$3'): $out"; fail=1; fi
}
bad unknown_key    'routerd:\n  listen: 127.0.0.1:1\n  lisen: x\n' "$W/unknown_key.yaml:3: unknown key 'lisen' in section 'routerd'"
bad bad_policy     'routerd:\n  policy: fastest\n' "bad_policy.yaml:2: routerd.policy: unknown policy"
bad bad_listen     'routerd:\n  listen: nowhere\n' "bad_listen.yaml:2: routerd.listen: expected host:port"
bad events_count   'workers:\n  urls: [http://a:1, http://b:2]\n  kv_events: [tcp://a:5]\n' "events_count.yaml:3: workers.kv_events: one entry per url"
bad bad_retries    'routerd:\n  retries: 99\n' "bad_retries.yaml:2: routerd.retries"
bad bad_duration   'routerd:\n  client_timeout: soon\n' "bad_duration.yaml:2: routerd.client_timeout"
bad bad_section    'routerz:\n  listen: 127.0.0.1:1\n' "unknown section 'routerz'"
bad bad_hash       'namespace:\n  hash: md5\n' "bad_hash.yaml:2: namespace.hash: expected xxh3_128 or sha256"
bad bad_block      'model:\n  block_size: 0\n' "bad_block.yaml:2: model.block_size"
bad too_many       'routerd:\n  max_workers: 1\nworkers:\n  urls: [http://a:1, http://b:2]\n' "workers.urls: more workers than routerd.max_workers"
bad not_yaml       'routerd: [\n' "not_yaml.yaml:"
bad bad_threads    'routerd:\n  threads: 0\n' "bad_threads.yaml:2: routerd.threads: expected an integer in [1, 64] or auto"
bad bad_threads2   'routerd:\n  threads: many\n' "bad_threads2.yaml:2: routerd.threads: expected an integer"
# threads with replicas: accepted (every loop publishes its own decisions)
printf 'routerd:\n  threads: 2\nworkers:\n  urls: [http://127.0.0.1:1]\nreplicas:\n  nats_url: nats://127.0.0.1:4222\n  replica_id: 3\n' > "$W/threads_nats.yaml"
out=$("$RD" --config "$W/threads_nats.yaml" --check-config 2>&1)
if [ $? -eq 0 ]; then echo "ok   threads_nats: $out"; else echo "FAIL threads_nats: $out"; fail=1; fi
# in range for the binding, refused by the router (it would not start)
bad bad_tie        'routing:\n  tie_rel: 5\n' "bad_tie.yaml: routing: the router refuses these options"
printf 'routerd:\n  threads: auto\n' > "$W/threads_auto.yaml"
out=$("$RD" --config "$W/threads_auto.yaml" --check-config 2>&1)
if [ $? -eq 0 ]; then echo "ok   threads: auto: $out"; else echo "FAIL threads: auto: $out"; fail=1; fi
printf 'routerd:\n  listen: 127.0.0.1:0\nworkers:\n  urls: [ftp://a:1]\n' > "$W/bad_url.yaml"
out=$("$RD" --config "$W/bad_url.yaml" 2>&1); rc=$?
if [ $rc -eq 1 ] && grep -qF "expected http://host[:port]" <<< "$out"; then echo "ok   bad worker url at start: $out"
else echo "FAIL bad worker url (rc $rc): $out"; fail=1; fi
out=$("$RD" --config "$W/missing.yaml" --check-config 2>&1); rc=$?
if [ $rc -eq 2 ] && grep -q "missing.yaml" <<< "$out"; then echo "ok   missing file: $out"
else echo "FAIL missing file (rc $rc): $out"; fail=1; fi

# every key rd_config.c binds has its row in docs/config.md: | `key` |
root=$(cd "$(dirname "$0")/.." && pwd)
missing=""
for k in $(grep -o 'KVP_CFG_[A-Z0-9]*("[a-z_]*"' "$root/connectors/routerd/rd_config.c" |
           sed 's/.*("//; s/"$//'); do
  grep -qF -- "| \`$k\` |" "$root/docs/config.md" || missing="$missing $k"
done
if [ -z "$missing" ]; then echo "ok   every routerd key documented in docs/config.md"
else echo "FAIL keys without a row in docs/config.md:$missing"; fail=1; fi
exit $fail
