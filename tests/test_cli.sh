#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The `kvplane` tool end to end: `hash --check` on the shared vLLM vectors of
# both schemes (before 0.33, and 0.33's tagged keys over pickle; passing, with
# one digest altered, with the scheme or an event key altered, on every bad
# file of tests/data), and `hash` on stdin against the same vectors, every
# case, every extra.
# usage: test_cli.sh KVPLANE_BINARY SHARED_DIR TESTS_DATA_DIR
# exit 0 pass, 1 fail, 77 skip (no shared vectors).
set -eu

bin=${1:?usage: test_cli.sh KVPLANE_BINARY SHARED_DIR TESTS_DATA_DIR}
shared=${2:?shared dir}
data=${3:?tests/data dir}
vectors=$shared/vectors/vllm_block_hashes.json
vectors033=$shared/vectors/vllm033_block_hashes.json
py=/usr/bin/python3

for f in "$vectors" "$vectors033"; do
  if [ ! -r "$f" ]; then
    echo "SKIP: $f is missing (CI has it at ../shared)" >&2
    exit 77
  fi
done
[ -x "$bin" ] || { echo "FAIL: $bin is not an executable" >&2; exit 1; }
[ -x "$py" ] || { echo "SKIP: $py is missing (used to read the vectors)" >&2; exit 77; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvp_test_cli.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM

checks=0
fail() {
  echo "FAIL: $*" >&2
  echo "--- stdout:" >&2; cat "$tmp/out" >&2 2>/dev/null || true
  echo "--- stderr:" >&2; cat "$tmp/err" >&2 2>/dev/null || true
  exit 1
}
# run [<FILE] CMD...: status in $rc, output in $tmp/out and $tmp/err
run() {
  rc=0
  "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
  checks=$((checks + 1))
}
run_in() {
  input=$1
  shift
  rc=0
  "$@" <"$input" >"$tmp/out" 2>"$tmp/err" || rc=$?
  checks=$((checks + 1))
}
want_rc() { [ "$rc" = "$1" ] || fail "$2: exit status $rc, want $1"; }
want_out() { grep -qF -- "$1" "$tmp/out" || fail "$2: stdout lacks '$1'"; }
want_err() { grep -qF -- "$1" "$tmp/err" || fail "$2: stderr lacks '$1'"; }
want_no_out() { [ ! -s "$tmp/out" ] || fail "$1: stdout not empty"; }

# ---- version, help, usage errors -------------------------------------------
run "$bin" --version
want_rc 0 "--version"
grep -Eq '^kvplane [0-9]+\.[0-9]+\.[0-9]+$' "$tmp/out" || fail "--version text"
for h in help --help; do
  run "$bin" "$h"
  want_rc 0 "$h"
  want_out "usage: kvplane" "$h"
  want_out "--check FILE" "$h"
done
run "$bin"
want_rc 2 "no command"
want_err "usage: kvplane" "no command"
run "$bin" frobnicate
want_rc 2 "unknown command"
want_err "unknown command 'frobnicate'" "unknown command"
want_err "usage: kvplane" "unknown command"
want_no_out "unknown command"
run "$bin" hash --frobnicate
want_rc 2 "unknown option"
want_err "unknown option '--frobnicate'" "unknown option"
want_err "usage: kvplane" "unknown option"
run "$bin" hash --block-size 0
want_rc 2 "--block-size 0"
want_err "--block-size: bad value '0'" "--block-size 0"
run "$bin" hash --algo md5
want_rc 2 "--algo md5"
want_err "--algo: bad value 'md5'" "--algo md5"
run "$bin" hash --algo vllm_sha256 --vllm-version latest
want_rc 2 "--vllm-version latest"
want_err "--vllm-version: bad value 'latest' (expected a vLLM release like 0.33.0)" "--vllm-version latest"
run "$bin" hash --check "$vectors" --algo sha256
want_rc 2 "--check with another option"
run "$bin" hash --check
want_rc 2 "--check without a file"
want_err "needs a value" "--check without a file"

# ---- hash --check ----------------------------------------------------------
for f in "$vectors" "$vectors033"; do
  run "$bin" hash --check "$f"
  want_rc 0 "check $f"
  [ "$(tail -n 1 "$tmp/out")" = "48 passed, 0 failed" ] ||
    fail "check $f: last line is not '48 passed, 0 failed'"
  [ "$(wc -l <"$tmp/out")" -eq 1 ] || fail "check $f: extra output"
done

# the 0.33 file read as an older release (cases with a seed): the scheme
# mismatch is named by the extra keys, not only by a digest; an event key
# altered on its own is caught too
"$py" - "$vectors033" "$tmp" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
d["cases"] = [c for c in d["cases"] if c["pythonhashseed"] is not None]
for c in d["cases"]:
    c["vllm_version"] = "0.32.1"
json.dump(d, open(sys.argv[2] + "/as032.json", "w"))
d = json.load(open(sys.argv[1]))
c = next(c for c in d["cases"] if c["lora_name"] and c["blocks"])
c["blocks"][0]["event_extra_keys"][0] = c["lora_name"] + "x"
d["cases"] = [c]
json.dump(d, open(sys.argv[2] + "/event.json", "w"))
EOF
run "$bin" hash --check "$tmp/as032.json"
want_rc 1 "0.33 vectors as 0.32"
want_out 'block 0: extra keys ["adapter-' "0.33 vectors as 0.32"
grep -q '^FAIL case [0-9]*: block [0-9]*: extra keys .* from kvplane, expected \[\["' "$tmp/out" ||
  fail "0.33 vectors as 0.32: no failure names the tagged keys kvplane did not make"
if grep '^FAIL' "$tmp/out" | grep -qv 'extra keys'; then
  fail "0.33 vectors as 0.32: a failure does not name the extra keys"
fi
run "$bin" hash --check "$tmp/event.json"
want_rc 1 "altered event key"
want_out "block 0: event extra keys [" "altered event key"
[ "$(tail -n 1 "$tmp/out")" = "0 passed, 1 failed" ] || fail "altered event key: not 1 failed"

# one hex digit of case 5, block 1 flipped: exactly that case fails
"$py" - "$vectors" "$tmp/altered.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
b = d["cases"][5]["blocks"][1]
h = b["hash_hex"]
b["hash_hex"] = h[:7] + ("0" if h[7] != "0" else "1") + h[8:]
json.dump(d, open(sys.argv[2], "w"))
EOF
run "$bin" hash --check "$tmp/altered.json"
want_rc 1 "check altered vectors"
[ "$(tail -n 1 "$tmp/out")" = "47 passed, 1 failed" ] ||
  fail "check altered vectors: last line is not '47 passed, 1 failed'"
head -n 1 "$tmp/out" | grep -q '^FAIL case 5: block 1: digest .*(1 of [0-9]* blocks differ)$' ||
  fail "check altered vectors: the reason does not come first or lacks case 5, block 1"

# every bad file: exit 2, the path and (where it applies) case and field named
n_bad=0
for f in "$data"/vectors_bad_*.json; do
  [ -e "$f" ] || fail "no $data/vectors_bad_*.json"
  run "$bin" hash --check "$f"
  want_rc 2 "$f"
  want_err "kvplane: $f: " "$f"
  want_no_out "$f"
  n_bad=$((n_bad + 1))
done
[ "$n_bad" -ge 10 ] || fail "only $n_bad bad files in $data"
while IFS='|' read -r file needle; do
  run "$bin" hash --check "$data/$file"
  want_rc 2 "$file"
  want_err "$needle" "$file"
done <<'EOF'
vectors_bad_hex_length.json|case 1: blocks[2].hash_hex: expected 64 hex digits
vectors_bad_u64_overflow.json|case 1: blocks[1].external_u64: 18446744073709551616 is out of range
vectors_bad_missing_seed.json|case 1: pythonhashseed: missing
vectors_bad_block_size_type.json|case 1: block_size: expected an integer, got a string
vectors_bad_token_range.json|case 1: token_ids[7]: 4294967296 is out of range
vectors_bad_truncated.json|not valid JSON
vectors_bad_garbage.json|not valid JSON
EOF
run "$bin" hash --check "$tmp/does-not-exist.json"
want_rc 2 "missing file"
want_err "does-not-exist.json: No such file or directory" "missing file"

# ---- hash: every shared case through stdin, every extra through options ----
# Per case of both files: tokens, the command line (odd cases take the seed
# from the environment; 0.33 cases without PYTHONHASHSEED take none, as the
# engine did) and the expected output in the default hex format.  The old
# file's cases run as vLLM 0.32, the 0.33 file's by its vllm_version or the
# default.
"$py" - "$vectors" "$vectors033" "$tmp" <<'EOF'
import json, shlex, sys
cases = json.load(open(sys.argv[1]))["cases"] + \
    json.load(open(sys.argv[2]))["cases"]
out = sys.argv[3]
algo = {"sha256": "vllm_sha256", "xxhash": "vllm_xxhash",
        "sha256_cbor": "sha256_cbor", "xxhash_cbor": "xxhash_cbor"}
for i, c in enumerate(cases):
    with open(f"{out}/tokens.{i}", "w") as f:
        f.write(" ".join(map(str, c["token_ids"])) + "\n")
    args = ["--algo", algo[c["algo"]], "--block-size", str(c["block_size"])]
    version = c.get("vllm_version", "0.32.0")
    if i % 3 != 2 or version != "0.33.0":  # else the default: the newest
        args += ["--vllm-version", version]
    env = ""
    if c["pythonhashseed"] is None:
        pass
    elif i % 2:
        env = "PYTHONHASHSEED=" + c["pythonhashseed"]  # one argument of env
    else:
        args += ["--seed", c["pythonhashseed"]]
    if c["lora_name"] is not None:
        args += ["--lora", c["lora_name"]]
    if c.get("lora_path") is not None:
        args += ["--lora-path", c["lora_path"]]
    if c["cache_salt"] is not None:
        args += ["--salt", c["cache_salt"]]
    for m in c["mm_placeholders"]:
        args += ["--mm", "%s:%d:%d" % (m["identifier"], m["offset"], m["length"])]
    with open(f"{out}/args.{i}", "w") as f:
        f.write(env + "\n" + " ".join(shlex.quote(a) for a in args) + "\n")
    with open(f"{out}/want.{i}", "w") as f:
        for k, b in enumerate(c["blocks"]):
            f.write("%d %s %d\n" % (k, b["hash_hex"][-32:], b["external_u64"]))
        f.write("tail %d\n" % (len(c["token_ids"]) % c["block_size"]))
print(len(cases), file=open(f"{out}/n_cases", "w"))
EOF
n_cases=$(cat "$tmp/n_cases")
[ "$n_cases" -eq 96 ] || fail "shared files have $n_cases cases, want 96"
i=0
while [ "$i" -lt "$n_cases" ]; do
  env_line=$(sed -n 1p "$tmp/args.$i")
  eval "set -- $(sed -n 2p "$tmp/args.$i")"
  if [ -n "$env_line" ]; then
    run_in "$tmp/tokens.$i" env -u PYTHONHASHSEED "$env_line" "$bin" hash "$@"
  else
    run_in "$tmp/tokens.$i" env -u PYTHONHASHSEED "$bin" hash "$@"
  fi
  want_rc 0 "stdin case $i"
  cmp -s "$tmp/out" "$tmp/want.$i" || {
    diff "$tmp/want.$i" "$tmp/out" >&2 || true
    fail "stdin case $i: keys differ from the shared vectors"
  }
  i=$((i + 1))
done

# u64 and json formats agree with the vectors (case 0 is sha256_cbor: the
# json line carries the full 32-byte digest)
eval "set -- $(sed -n 2p "$tmp/args.0")"
run_in "$tmp/tokens.0" "$bin" hash "$@" --format u64
want_rc 0 "format u64"
awk '$1 != "tail" {print $1, $3} $1 == "tail"' "$tmp/want.0" >"$tmp/want_u64"
cmp -s "$tmp/out" "$tmp/want_u64" || fail "format u64 differs from the vectors"
run_in "$tmp/tokens.0" "$bin" hash "$@" --format json
want_rc 0 "format json"
"$py" - "$vectors" "$tmp/out" <<'EOF' || fail "format json differs from the vectors"
import json, sys
c = json.load(open(sys.argv[1]))["cases"][0]
lines = [json.loads(l) for l in open(sys.argv[2])]
assert c["algo"] == "sha256_cbor"
for k, b in enumerate(c["blocks"]):
    got = lines[k]
    assert got["index"] == k, got
    assert got["digest"] == b["hash_hex"], (got, b)
    assert got["key"] == b["hash_hex"][-32:], (got, b)
    assert got["external_u64"] == b["external_u64"], (got, b)
tail = lines[len(c["blocks"])]
assert tail == {"tail": len(c["token_ids"]) % c["block_size"],
                "tokens": len(c["token_ids"]), "blocks": len(c["blocks"])}, tail
assert len(lines) == len(c["blocks"]) + 1
EOF

# the same tokens as commas, as a JSON array, across lines: the same keys
cp "$tmp/out" "$tmp/json_ref"
tr ' ' ',' <"$tmp/tokens.0" >"$tmp/commas"
run_in "$tmp/commas" "$bin" hash "$@" --format json
cmp -s "$tmp/out" "$tmp/json_ref" || fail "comma-separated input gives other keys"
{ printf '[\n'; sed 's/ /, /g' "$tmp/tokens.0"; printf ']\n'; } >"$tmp/array"
run_in "$tmp/array" "$bin" hash "$@" --format json
cmp -s "$tmp/out" "$tmp/json_ref" || fail "JSON-array input gives other keys"
tr ' ' '\n' <"$tmp/tokens.0" >"$tmp/lines"
run_in "$tmp/lines" "$bin" hash "$@" --format json
cmp -s "$tmp/out" "$tmp/json_ref" || fail "one-token-a-line input gives other keys"

# vLLM modes need a seed, flag or environment, where vLLM draws a random one:
# xxhash*, and every algorithm before 0.33; 0.33's sha256* has a default
printf '1 2 3\n' >"$tmp/three"
for a in "xxhash_cbor" "vllm_xxhash" "sha256_cbor --vllm-version 0.32.0" \
         "vllm_sha256 --vllm-version 0.11.1"; do
  # shellcheck disable=SC2086
  run_in "$tmp/three" env -u PYTHONHASHSEED "$bin" hash --algo $a
  want_rc 2 "$a without a seed"
  want_err "PYTHONHASHSEED" "$a without a seed"
  want_no_out "$a without a seed"
done
for a in sha256_cbor vllm_sha256; do
  run_in "$tmp/three" env -u PYTHONHASHSEED "$bin" hash --algo "$a" --block-size 1
  want_rc 0 "$a without a seed (0.33)"
  cp "$tmp/out" "$tmp/default_seed"
  run_in "$tmp/three" "$bin" hash --algo "$a" --block-size 1 --seed vllm-none-hash
  cmp -s "$tmp/out" "$tmp/default_seed" || fail "$a: no seed is not \"vllm-none-hash\""
done

# ---- hash: native algorithms ---------------------------------------------------
seq 0 99 >"$tmp/hundred"
run_in "$tmp/hundred" "$bin" hash
want_rc 2 "native without --model"
want_err "--model" "native without --model"
for algo in xxh3_128 sha256; do
  ns="--model m --tokenizer t --layout l --tenant a"
  # shellcheck disable=SC2086
  run_in "$tmp/hundred" "$bin" hash --algo "$algo" $ns --chunks 32,64
  want_rc 0 "$algo"
  cp "$tmp/out" "$tmp/native"
  [ "$(grep -Ec '^[0-9]+ [0-9a-f]{32} [0-9]+$' "$tmp/native")" -eq 6 ] ||
    fail "$algo: want 6 block lines of INDEX KEY U64"
  [ "$(grep -c '^chunk 32 ' "$tmp/native")" -eq 3 ] || fail "$algo: want 3 chunk-32 keys"
  [ "$(grep -c '^chunk 64 ' "$tmp/native")" -eq 1 ] || fail "$algo: want 1 chunk-64 key"
  [ "$(tail -n 1 "$tmp/native")" = "tail 4" ] || fail "$algo: want 'tail 4'"
  # the external u64 is the key's low 64 bits
  "$py" - "$tmp/native" <<'PYEOF' || fail "$algo: a u64 is not its key's low half"
import sys
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "chunk":
        f = f[2:]
    if len(f) == 3:
        assert int(f[1][16:], 16) == int(f[2]), line
PYEOF
  # a prefix keeps its keys: the first 64 tokens give the first 4 lines
  head -n 64 "$tmp/hundred" >"$tmp/prefix"
  # shellcheck disable=SC2086
  run_in "$tmp/prefix" "$bin" hash --algo "$algo" $ns
  want_rc 0 "$algo prefix"
  head -n 4 "$tmp/native" >"$tmp/want_prefix"
  head -n 4 "$tmp/out" | cmp -s - "$tmp/want_prefix" || fail "$algo: prefix keys changed"
  # every namespace field and extra separates key spaces
  head -n 1 "$tmp/native" >"$tmp/first"
  for other in "--model M" "--tokenizer T" "--layout L" "--tenant b" "--salt s" "--lora x"; do
    # shellcheck disable=SC2086
    run_in "$tmp/hundred" "$bin" hash --algo "$algo" $ns $other
    want_rc 0 "$algo $other"
    if head -n 1 "$tmp/out" | cmp -s - "$tmp/first"; then
      fail "$algo: '$other' left block 0's key unchanged"
    fi
  done
done

# ---- bad token text: exit 2, the token and its position named ------------------
while IFS='|' read -r text needle; do
  printf '%s\n' "$text" >"$tmp/bad"
  run_in "$tmp/bad" "$bin" hash --model m
  want_rc 2 "stdin '$text'"
  want_err "$needle" "stdin '$text'"
  want_no_out "stdin '$text'"
done <<'EOF'
1 2 x|stdin:1:5: token 3 "x" is not a token id
1 -5|stdin:1:3: token 2 "-5" is not a token id
1 4294967296|token 2 "4294967296" is not a token id
3.5|token 1 "3.5" is not a token id
1,,2|',' without a token id before it
1,2,|a token id must follow the last ','
[1, 2|lacks its closing ']'
[1, 2] 3|unexpected text after ']'
1 +2|token 2 "+2" is not a token id
1 2 3 00000000000000000000000000000000000000001|token 4 "000000000000000000000000..." is not a token id
EOF
printf '0 4294967295\n' >"$tmp/edge"
run_in "$tmp/edge" "$bin" hash --model m --block-size 2 --format u64
want_rc 0 "token ids 0 and 4294967295"
grep -q '^0 [0-9]*$' "$tmp/out" || fail "token ids 0 and 4294967295: no block"
printf '' >"$tmp/empty"
run_in "$tmp/empty" "$bin" hash --model m
want_rc 0 "empty stdin"
[ "$(cat "$tmp/out")" = "tail 0" ] || fail "empty stdin: want only 'tail 0'"

echo "test_cli: $checks runs, all passed"
