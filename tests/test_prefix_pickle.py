#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""router/prefix's vLLM serializers against CPython's own.

Random objects of every shape vLLM's block hashes hold -- (parent digest,
tuple(tokens), extra keys) with LoRA names and paths, several multimodal keys
in one block, negative and 64-bit offsets, tokens >= 2**31, strings past 255
bytes and past pickle's 64 KiB frame target, "" / one-character strings
(CPython shares those objects), empty salt vs none, prompt-embeddings
digests -- go through tests/prefix_dump (kvplane's writer, the bytes it
hashes) and through pickle.dumps(protocol=5) / cbor2.dumps(canonical=True)
(cbor2 and xxhash when installed), for every vLLM mode and both extra-key
schemes (before 0.33: untagged; 0.33: tagged).  Then whole requests:
vLLM's generate_block_hash_extra_keys / hash_block_tokens / init_none_hash,
re-stated below from vLLM 0.33.0 (v1/core/kv_cache_utils.py) and the release
before, against kvplane's chain and its block-by-block API.

Checked byte for byte against CPython 3.9 to 3.13.
usage: test_prefix_pickle.py PREFIX_DUMP [SEED]; exit 0 pass, 1 fail, 77
skip (python older than 3.9)."""
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys

try:
    import cbor2
except ImportError:
    cbor2 = None
try:
    import xxhash
except ImportError:
    xxhash = None

COMPAT_PRE, COMPAT_033 = 1, 2
ALGOS = {  # kvplane name -> (vLLM name, serializer, digest)
    'vllm_sha256': ('sha256', 'pickle', 'sha256'),
    'vllm_xxhash': ('xxhash', 'pickle', 'xxh3'),
    'sha256_cbor': ('sha256_cbor', 'cbor', 'sha256'),
    'xxhash_cbor': ('xxhash_cbor', 'cbor', 'xxh3'),
}
DEFAULT_NONE_HASH_SEED = 'vllm-none-hash'
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def serialize(algo, obj):
    if ALGOS[algo][1] == 'pickle':
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return cbor2.dumps(obj, canonical=True)


def digest(algo, data):
    if ALGOS[algo][2] == 'sha256':
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def usable(algo):
    return (ALGOS[algo][1] != 'cbor' or cbor2) and \
        (ALGOS[algo][2] != 'xxh3' or xxhash)


def fresh(s):
    """A str object of its own, as vLLM's request fields are (decoded from
    the request): CPython still returns its shared objects for "" and the
    one-character latin-1 strings, as it does in vLLM."""
    return None if s is None else s.encode('utf-8').decode('utf-8')


# ---- vLLM, restated --------------------------------------------------------
# The tag literals are code constants: one object each, as in vLLM.
def lora_key(compat, name, path):
    return ('lora', name, path) if compat == COMPAT_033 else name


def mm_key(compat, ident, off):
    return ('mm', ident, off) if compat == COMPAT_033 else (ident, off)


def salt_key(compat, salt):
    return ('cache_salt', salt) if compat == COMPAT_033 else salt


def embeds_key(compat, d):
    return ('prompt_embeds', d) if compat == COMPAT_033 else d


def mm_extra_keys(compat, mm, start, end, idx):
    """_gen_mm_extra_hash_keys; 0.33 passes a placeholder that ends where the
    block starts, the release before keyed that block with it."""
    keys = []
    if not mm:
        return keys, idx
    last = mm[-1]
    last_end = last['offset'] + last['length']
    if (last_end <= start) if compat == COMPAT_033 else (last_end < start):
        return keys, idx
    curr = idx
    while curr < len(mm):
        off, ln = mm[curr]['offset'], mm[curr]['length']
        if end > off:
            passed = start >= off + ln if compat == COMPAT_033 \
                else start > off + ln
            if passed:
                curr += 1
                continue
            keys.append(mm_key(compat, mm[curr]['ident'], off - start))
            if end >= off + ln:
                curr += 1
            else:
                break
        else:
            break
    return keys, curr


def block_extra_keys(compat, req, start, end, idx):
    """generate_block_hash_extra_keys: lora + mm + cache_salt + embeds."""
    mmk, idx = mm_extra_keys(compat, req['mm'], start, end, idx)
    lora = [lora_key(compat, req['lora_name'], req['lora_path'])] \
        if req['lora_name'] else []
    salt = [salt_key(compat, req['cache_salt'])] \
        if start == 0 and req['cache_salt'] else []
    emb = [embeds_key(compat, req['embeds'][start // (end - start)])] \
        if req['embeds'] else []
    keys = lora + mmk + salt + emb
    return (tuple(keys) if keys else None), idx


def none_hash_seed(algo, compat, seed):
    """resolve_none_hash_seed; None where vLLM draws random bytes."""
    if seed is not None:
        return seed
    if compat == COMPAT_033 and ALGOS[algo][2] == 'sha256':
        return DEFAULT_NONE_HASH_SEED
    return None


def vllm_chain(algo, compat, seed, req, tokens, bs):
    none_hash = digest(algo, serialize(algo, fresh(seed)))
    parent, idx, out = none_hash, 0, []
    for start in range(0, len(tokens) - bs + 1, bs):
        extra, idx = block_extra_keys(compat, req, start, start + bs, idx)
        h = digest(algo, serialize(algo, (parent, tuple(tokens[start:start +
                                                                bs]), extra)))
        out.append(h)
        parent = h
    return out


# ---- random objects --------------------------------------------------------
ALPHABET = ['a', 'b', 'z', '0', '-', '/', ' ', '\u00e9', '\u00ff', '\u0100',
            '\u4e2d', '\U0001f600', 'mm', 'lora']


def rand_str(rng, allow_long=True):
    r = rng.random()
    if r < 0.15:
        return rng.choice(['', 'a', '\u00e9', '\u00ff', '\u0100', 'mm',
                           'lora', 'cache_salt'])
    if allow_long and r < 0.2:
        return 'x' * rng.choice([255, 256, 300, 65535, 65536, 70000])
    if allow_long and r < 0.23:
        return '\u00e9' * rng.choice([128, 32767, 32768, 40000])
    n = rng.randrange(1, 12)
    return ''.join(rng.choice(ALPHABET) for _ in range(n))


def rand_token(rng):
    return rng.choice([rng.randrange(256), rng.randrange(256, 65536),
                       rng.randrange(65536, 1 << 31),
                       rng.randrange(1 << 31, 1 << 32), 0, 255, 256, 65535,
                       65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1])


def rand_offset(rng):
    return rng.choice([rng.randrange(-300, 300), rng.randrange(-70000, 70000),
                       rng.randrange(-(1 << 31) - 5, -(1 << 31) + 5),
                       rng.randrange((1 << 31) - 5, (1 << 31) + 5),
                       rng.randrange(INT64_MIN, INT64_MAX),
                       -(1 << 39), -(1 << 39) - 1, 1 << 39, -(1 << 47),
                       INT64_MIN, INT64_MAX, -(1 << 63) + 1, -129, -128,
                       -32769, -32768, 0, 255, 256, 65535, 65536])


def maybe(rng, p, f):
    return f() if rng.random() < p else None


def rand_block_extras(rng):
    bx = {}
    bx['lora_name'] = maybe(rng, 0.5, lambda: rand_str(rng))
    bx['lora_path'] = maybe(rng, 0.6, lambda: rand_str(rng))
    bx['cache_salt'] = maybe(rng, 0.5, lambda: rand_str(rng))
    n_mm = rng.choice([0, 0, 1, 2, 2, 3, 4, 5])
    ids = [rand_str(rng, allow_long=False) for _ in range(2)]
    bx['mm'] = [[rng.choice(ids + [rand_str(rng)]), rand_offset(rng)]
                for _ in range(n_mm)]
    bx['embeds'] = maybe(rng, 0.3, lambda: rng.randbytes(32).hex())
    if rng.random() < 0.1:
        return None
    return bx


def py_block_extras(compat, bx):
    """The extra-keys tuple vLLM hashes for these per-block extras."""
    if bx is None:
        return None
    keys = []
    if bx['lora_name']:
        keys.append(lora_key(compat, fresh(bx['lora_name']),
                             fresh(bx['lora_path'] or '')))
    for ident, off in bx['mm']:
        keys.append(mm_key(compat, fresh(ident), off))
    if bx['cache_salt']:
        keys.append(salt_key(compat, fresh(bx['cache_salt'])))
    if bx['embeds']:
        keys.append(embeds_key(compat, bytes.fromhex(bx['embeds'])))
    return tuple(keys) if keys else None


# ---- the helper --------------------------------------------------------------
class Dump:
    def __init__(self, path):
        env = dict(os.environ, KVP_LOG='error')  # refusals are expected
        self.p = subprocess.Popen([path], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True,
                                  encoding='utf-8', env=env)

    def ask(self, req):
        self.p.stdin.write(json.dumps(req) + '\n')
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit('prefix_dump died on %s' % json.dumps(req)[:300])
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        if self.p.wait() != 0:
            raise SystemExit('prefix_dump exited %d' % self.p.returncode)


FAILS = []


def check(cond, what, req, **info):
    if not cond:
        FAILS.append(what)
        print('FAIL %s\n  request: %.400s' % (what, json.dumps(req)),
              file=sys.stderr)
        for k, v in info.items():
            print('  %s: %.400s' % (k, v), file=sys.stderr)


def first_diff(a, b):
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def seed_for(rng):
    return rng.choice([None, '0', '', '1234567', rand_str(rng, False)])


def block_case(d, rng, algo, compat):
    bs = rng.choice([1, 2, 3, 4, 5, 16, 17, 64])
    seed = seed_for(rng)
    resolved = none_hash_seed(algo, compat, seed)
    req = {'op': 'block', 'algo': algo, 'compat': compat, 'block_size': bs,
           'seed': seed, 'tokens': [rand_token(rng) for _ in range(bs)],
           'bx': rand_block_extras(rng)}
    dlen = 32 if ALGOS[algo][2] == 'sha256' else 16
    if rng.random() < 0.7:
        req['parent'] = rng.randbytes(dlen).hex()
    got = d.ask(req)
    if resolved is None:
        check(got.get('error') == 'KVP_EINVAL', 'unseedable hasher refused',
              req, got=got)
        return 0
    if 'parent' in req:
        parent = bytes.fromhex(req['parent'])
    else:
        parent = digest(algo, serialize(algo, fresh(resolved)))
    obj = (parent, tuple(req['tokens']), py_block_extras(compat, req['bx']))
    want = serialize(algo, obj)
    have = bytes.fromhex(got.get('bytes', ''))
    at = first_diff(want, have)
    check(have == want, '%s compat %d block bytes' % (algo, compat), req,
          at=at, want=want[max(0, at - 20):at + 40].hex(),
          got=have[max(0, at - 20):at + 40].hex(), object=repr(obj))
    dg = digest(algo, want)
    check(got.get('digest') == dg.hex(), '%s block digest' % algo, req)
    check(got.get('lo') == int.from_bytes(dg, 'big') & ((1 << 64) - 1),
          '%s key.lo is the event hash' % algo, req)
    return 1


def frame_edges(d, rng):
    """Strings that bring the frame to just below, at and past CPython's 64
    KiB target when the next save() starts, and payloads around it."""
    n = 0
    for compat in (COMPAT_PRE, COMPAT_033):
        for size in list(range(65536 - 120, 65536 + 4)):
            bx = {'lora_name': 'x' * size, 'lora_path': 'p', 'mm': [['m', 1]],
                  'cache_salt': None, 'embeds': None}
            req = {'op': 'block', 'algo': 'vllm_sha256', 'compat': compat,
                   'block_size': 1, 'seed': '0', 'tokens': [7],
                   'parent': rng.randbytes(32).hex(), 'bx': bx}
            got = d.ask(req)
            obj = (bytes.fromhex(req['parent']), (7,),
                   py_block_extras(compat, bx))
            want = serialize('vllm_sha256', obj)
            check(got.get('bytes') == want.hex(),
                  'frame edge: lora_name of %d bytes' % size, {},
                  at=first_diff(want, bytes.fromhex(got.get('bytes', ''))))
            n += 1
    return n


def seed_case(d, rng, algo, compat):
    text = rng.choice([rand_str(rng), '', 'vllm-none-hash', '0',
                       'x' * 65536, 'x' * 65534])
    req = {'op': 'seed', 'algo': algo, 'compat': compat, 'block_size': 16,
           'seed': '0', 'text': text}
    got = d.ask(req)
    check(got.get('bytes') == serialize(algo, fresh(text)).hex(),
          '%s seed bytes' % algo, req)
    root = d.ask({'op': 'root', 'algo': algo, 'compat': compat,
                  'block_size': 16, 'seed': text})
    check(root.get('root') == digest(algo, serialize(algo, text)).hex(),
          '%s NONE_HASH' % algo, req, got=root)


def rand_request(rng, n_tokens, bs):
    req = {'lora_name': maybe(rng, 0.4, lambda: rand_str(rng, False)),
           'lora_path': maybe(rng, 0.5, lambda: rand_str(rng, False)),
           'cache_salt': maybe(rng, 0.4, lambda: rand_str(rng, False)),
           'mm': [], 'embeds': None}
    off = 0
    for i in range(rng.choice([0, 0, 1, 2, 3, 5])):
        off += rng.randrange(0, max(2, n_tokens // 2))
        # lengths that end on a block boundary, where the releases differ
        ln = rng.choice([0, 1, bs, 2 * bs, rng.randrange(40),
                         (-off) % bs or bs])
        req['mm'].append({'ident': fresh(rng.choice(['img', 'a', rand_str(
            rng, False) or 'q'])), 'offset': off, 'length': ln})
    if rng.random() < 0.25:
        req['embeds'] = [rng.randbytes(32) for _ in range(n_tokens // bs)]
    return req


def chain_case(d, rng, algo, compat):
    bs = rng.choice([1, 2, 3, 4, 16])
    n = rng.randrange(0, 8 * bs + 3)
    tokens = [rand_token(rng) for _ in range(n)]
    r = rand_request(rng, n, bs)
    seed = rng.choice(['0', '42', 'vllm'])
    ex = {'lora_name': r['lora_name'], 'lora_path': r['lora_path'],
          'cache_salt': r['cache_salt'],
          'mm': [[m['ident'], m['offset'], m['length']] for m in r['mm']],
          'embeds': [e.hex() for e in r['embeds']] if r['embeds'] else []}
    req = {'op': 'chain', 'algo': algo, 'compat': compat, 'block_size': bs,
           'seed': seed, 'tokens': tokens, 'extras': ex}
    got = d.ask(req)
    # vLLM's request fields are the same objects on every block
    r['lora_name'] = fresh(r['lora_name'])
    r['lora_path'] = fresh(r['lora_path'] or '')
    r['cache_salt'] = fresh(r['cache_salt'])
    want = [h.hex() for h in vllm_chain(algo, compat, seed, r, tokens, bs)]
    check(got.get('digests') == want, '%s compat %d chain' % (algo, compat),
          req, got=got, want=want)
    check(got.get('block') == want,
          '%s compat %d block by block (kvp_hasher_block_extras + '
          'kvp_hasher_block)' % (algo, compat), req, got=got, want=want)
    return len(want)


def golden():
    """A few pickles pinned to CPython's exact bytes (python3.11 -c "import
    pickle; print(pickle.dumps(OBJ, protocol=5).hex())"), so that this test
    fails loudly if the local CPython ever disagreed with the one these were
    taken from."""
    pins = {
        "pickle.dumps('vllm-none-hash', 5)":
        (pickle.dumps('vllm-none-hash', protocol=5).hex(),
         '8005951200000000000000' '8c0e' + b'vllm-none-hash'.hex() + '942e'),
        "pickle.dumps('', 5)":
        (pickle.dumps('', protocol=5).hex(), '80059504000000000000008c00942e'),
        "pickle.dumps(2**31, 5)":
        (pickle.dumps(1 << 31, protocol=5).hex(),
         '80059508000000000000008a050000008000' + '2e'),
    }
    for what, (have, want) in pins.items():
        check(have == want, 'local CPython pins ' + what, {}, have=have,
              want=want)


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if sys.version_info < (3, 9):  # pickle protocol 5, Random.randbytes
        print('SKIP: python %s is older than 3.9' % sys.version.split()[0])
        return 77
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else \
        int.from_bytes(os.urandom(4), 'little')
    print('test_prefix_pickle: seed %d (python %s, cbor2 %s, xxhash %s)' %
          (seed, sys.version.split()[0], bool(cbor2), bool(xxhash)))
    rng = random.Random(seed)
    d = Dump(sys.argv[1])
    golden()
    blocks, chains = frame_edges(d, rng), 0
    algos = [a for a in ALGOS if usable(a)]
    skipped = [a for a in ALGOS if not usable(a)]
    for algo in algos:
        for compat in (COMPAT_PRE, COMPAT_033):
            for _ in range(150):
                blocks += block_case(d, rng, algo, compat)
            for _ in range(10):
                seed_case(d, rng, algo, compat)
            for _ in range(60):
                chains += chain_case(d, rng, algo, compat)
    d.close()
    print('test_prefix_pickle: %d blocks, %d chained blocks, %d failures%s' %
          (blocks, chains, len(FAILS),
           ' (skipped without cbor2/xxhash: %s)' % ', '.join(skipped)
           if skipped else ''))
    if 'vllm_sha256' not in algos or FAILS:
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
