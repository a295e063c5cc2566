#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Golden vectors for kvplane's block hashing, from an implementation that
shares no code with router/prefix_hash.c: hashlib (SHA-256), python3-xxhash
(XXH3-128), cbor2 and CPython's pickle (the vLLM modes), following the rules
written in include/kvplane/prefix.h and router/prefix_internal.h.

Covers: namespace seeds; native xxh3_128 / sha256 chains with and without
extras (LoRA, cache salt, multimodal placeholders, including edge placements
and extras long enough to overflow the hasher's scratch, prompt-embeddings
digests); chunk keys; and vLLM-mode cases the shared vLLM vector files do not
reach (4096-token blocks with 5-byte CBOR token ids, extras that stream; vLLM
0.33's pickle with tagged keys, embeddings and a LoRA path past pickle's
64 KiB frame target).

Writes tests/data/native_chain_vectors.json and tests/data/native_chain_vectors.h.
Deterministic.  Regenerate from the repository root with Debian's python:
    /usr/bin/python3 tests/data/gen_native_vectors.py
"""
import hashlib
import json
import os
import pickle
import random
import struct

import cbor2
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the rules, re-implemented -------------------------------------------
def u32(n):
    return struct.pack('<I', n)


def lp(s):
    b = s.encode('utf-8')
    return u32(len(b)) + b


def namespace_seed(model_id, tokenizer_id, kv_layout, block_size, tenant_salt):
    # NULL and "" are the same for every string, tenant_salt included.
    salt = tenant_salt or ''
    enc = (b'kvplane-ns-v1' + lp(model_id) + lp(tokenizer_id or '') +
           lp(kv_layout or '') + u32(block_size) + bytes([1 if salt else 0]) +
           lp(salt))
    return hashlib.sha256(enc).digest()[:16]


COMPAT_PRE, COMPAT_033 = 1, 2  # kvp_vllm_compat


def passed(end_of_mm, start, compat):
    """vLLM 0.33: a block starting where a placeholder ends has passed it;
    before 0.33 (and native algorithms) it had not."""
    return start >= end_of_mm if compat == COMPAT_033 else start > end_of_mm


def mm_extra_keys(mm, start, end, idx, compat=COMPAT_PRE):
    """vLLM v1 _gen_mm_extra_hash_keys, verbatim in structure."""
    keys = []
    if not mm:
        return keys, idx
    last = mm[-1]
    if passed(last['offset'] + last['length'], start, compat):
        return keys, idx
    curr = idx
    while curr < len(mm):
        off, ln = mm[curr]['offset'], mm[curr]['length']
        if end > off:
            if passed(off + ln, start, compat):
                curr += 1
                continue
            keys.append((mm[curr]['id'], off - start))
            if end >= off + ln:
                curr += 1
            else:
                break
        else:
            break
    return keys, curr


def block_extras(ex, start, end, idx, compat=COMPAT_PRE):
    """(lora or None, [(id, rel)], salt or None, embeds digest or None), next
    mm index."""
    mmk, idx = mm_extra_keys(ex['mm'], start, end, idx, compat)
    lora = ex['lora_name'] or None
    salt = ex['cache_salt'] if (start == 0 and ex['cache_salt']) else None
    emb = ex['embeds'][start // (end - start)] if ex['embeds'] else None
    return (lora, mmk, salt, emb), idx


def native_extras(lora, mmk, salt, emb):
    if not (lora or mmk or salt or emb):
        return b''
    tag = 0xE0 | (1 if lora else 0) | (2 if mmk else 0) | (4 if salt else 0) \
        | (8 if emb else 0)
    out = bytes([tag])
    if lora:
        out += lp(lora)
    if mmk:
        out += u32(len(mmk))
        for ident, rel in mmk:
            out += lp(ident) + struct.pack('<q', rel)
    if salt:
        out += lp(salt)
    if emb:
        out += emb
    return out


def native_chain(algo, seed16, bs, tokens, ex):
    parent, idx, digests = seed16, 0, []
    for b in range(len(tokens) // bs):
        start = b * bs
        (lora, mmk, salt, emb), idx = block_extras(ex, start, start + bs, idx)
        buf = (parent + struct.pack('<%dI' % bs, *tokens[start:start + bs]) +
               native_extras(lora, mmk, salt, emb))
        if algo == 'xxh3_128':
            d = xxhash.xxh3_128_digest(buf)
        else:
            d = hashlib.sha256(buf).digest()
        digests.append(d)
        parent = d[-16:]
    return digests


def vllm_hash(algo, obj):
    if algo in ('vllm_sha256', 'vllm_xxhash'):  # vLLM's sha256 / xxhash
        enc = pickle.dumps(obj, protocol=5)
    else:
        enc = cbor2.dumps(obj, canonical=True)
    if algo in ('sha256_cbor', 'vllm_sha256'):
        return hashlib.sha256(enc).digest()
    return xxhash.xxh3_128_digest(enc)


def fresh(s):
    """A str object of its own, as vLLM's request strings are: pickle's memo
    goes by identity (CPython still shares "" and one-character latin-1
    strings, as in vLLM)."""
    return None if s is None else s.encode('utf-8').decode('utf-8')


def vllm_keys(compat, ex, lora, mmk, salt, emb):
    """The extra-keys list: untagged before 0.33, tagged in 0.33 (the tag
    literals are one object each, as vLLM's code constants)."""
    if compat == COMPAT_PRE:
        return ([lora] if lora else []) + [tuple(k) for k in mmk] + \
            ([salt] if salt else []) + ([emb] if emb else [])
    return ([('lora', lora, ex['lora_path'] or '')] if lora else []) + \
        [('mm', fresh(i), o) for i, o in mmk] + \
        ([('cache_salt', salt)] if salt else []) + \
        ([('prompt_embeds', emb)] if emb else [])


def vllm_chain(algo, seed_str, bs, tokens, ex, compat):
    parent, idx, digests = vllm_hash(algo, fresh(seed_str)), 0, []
    ex = dict(ex, lora_name=fresh(ex['lora_name']),
              lora_path=fresh(ex['lora_path']),
              cache_salt=fresh(ex['cache_salt']))
    for b in range(len(tokens) // bs):
        start = b * bs
        (lora, mmk, salt, emb), idx = block_extras(ex, start, start + bs, idx,
                                                   compat)
        keys = vllm_keys(compat, ex, lora, mmk, salt, emb)
        d = vllm_hash(algo, (parent, tuple(tokens[start:start + bs]),
                             tuple(keys) if keys else None))
        digests.append(d)
        parent = d
    return digests


def chunk_keys(digests, bs, g):
    per = g // bs
    return [xxhash.xxh3_128_digest(digests[(j + 1) * per - 1][-16:] + u32(g) +
                                   b'chunk')
            for j in range(len(digests) // per)]


# ---- the cases --------------------------------------------------------------
NAMESPACES = [
    dict(model_id='meta-llama/Llama-3.1-8B-Instruct',
         tokenizer_id='meta-llama/Llama-3.1-8B-Instruct@5206a32',
         kv_layout='vllm-nhd:bf16', block_size=16, tenant_salt=None),
    dict(model_id='meta-llama/Llama-3.1-8B-Instruct',
         tokenizer_id='meta-llama/Llama-3.1-8B-Instruct@5206a32',
         kv_layout='vllm-nhd:bf16', block_size=16, tenant_salt='t3nant-\u00e9'),
    dict(model_id='m', tokenizer_id=None, kv_layout=None, block_size=1,
         tenant_salt=None),
    dict(model_id='Qwen/Qwen2.5-7B', tokenizer_id='', kv_layout='fp8',
         block_size=7, tenant_salt='acme'),
    dict(model_id='\u6a21\u578b-\U0001f600', tokenizer_id='tok', kv_layout='hnd:fp16',
         block_size=4096, tenant_salt=None),
    dict(model_id='m', tokenizer_id=None, kv_layout=None, block_size=32,
         tenant_salt=None),
    # field boundaries move but the concatenation stays "ab": must differ
    dict(model_id='a', tokenizer_id='b', kv_layout=None, block_size=16,
         tenant_salt=None),
    dict(model_id='ab', tokenizer_id=None, kv_layout=None, block_size=16,
         tenant_salt=None),
]

rng = random.Random(0x6b76706c)


def rand_tokens(n, hi=152000):
    return [rng.randrange(hi) for _ in range(n)]


def extras(lora=None, salt=None, mm=(), path=None, embeds=None):
    return dict(lora_name=lora, cache_salt=salt,
                mm=[dict(id=i, offset=o, length=l) for i, o, l in mm],
                lora_path=path, embeds=embeds)


NO_EXTRAS = extras()
MIXED = extras('sql-adapter', 'tenant-\u00e9', [
    ('img-0', 5, 40),    # starts mid block 0, spans into block 3
    ('img-1', 45, 3),    # same block as img-0's end
    ('img-2', 64, 16),   # exactly block 4
    ('img-3', 100, 0),   # zero length
    ('img-\u00e9', 130, 30),
])
# sorted by offset but nested: exercises vLLM's skip-and-continue branch
NESTED = extras(None, None, [('big', 10, 90), ('small', 20, 5),
                             ('late', 96, 40)])
# vLLM's strict `start > offset + length`: a placeholder ending exactly where
# a block starts still keys that block while the index has not passed it
# (nested spans, zero-length spans on a boundary); `small` is also the last
# placeholder, so the early exit (last end < start) is tested at equality.
EDGE = extras(None, None, [('big', 10, 90), ('small', 20, 76)])
ZERO = extras(None, None, [('z0', 0, 0), ('z32', 32, 0), ('a', 40, 8)])
LONG_LORA = 'lora-' + 'x' * 2600
LONG = extras(LONG_LORA, 's' * 300,
              [('img-%03d' % i, 16 + i, 1) for i in range(200)])


# its own generator: the draws of `rng` above and below stay as they were
rng_emb = random.Random(0x656d6264)


def rand_digests(n):
    return [rng_emb.randbytes(32) for _ in range(n)]


EMBEDS = extras(embeds=rand_digests(170 // 16))
EMBEDS_MIXED = extras('sql-adapter', 'tenant', MIXED['mm'] and [
    (m['id'], m['offset'], m['length']) for m in MIXED['mm']],
    path='/adapters/sql', embeds=rand_digests(170 // 16))
MIXED033 = extras('sql-adapter', 'tenant-\u00e9', [
    (m['id'], m['offset'], m['length']) for m in MIXED['mm']] +
    [('a', 150, 2), ('a', 151, 1)], path='/models/lora/sql')
# a path past pickle's 64 KiB frame target: written outside the frames
LONG033 = extras('l', 'salt', [('img', 3, 70), ('', 40, 1), ('', 41, 1)],
                 path='/p' * 40000)


def case(name, algo, ns, ex, tokens=None, n=None, mul=0, add=0, chunk=0,
         seed=None, compat=COMPAT_PRE):
    d = dict(name=name, algo=algo, ns=ns, extras=ex, chunk_tokens=chunk,
             python_hash_seed=seed, vllm_compat=compat)
    if tokens is None:
        tokens = [(mul * i + add) & 0xFFFFFFFF for i in range(n)]
        d.update(tok_mul=mul, tok_add=add, n_tokens=n, tokens=None)
    else:
        d.update(tok_mul=0, tok_add=0, n_tokens=len(tokens), tokens=tokens)
    bs = NAMESPACES[ns]['block_size']
    if algo in ('xxh3_128', 'sha256'):
        seed16 = namespace_seed(**NAMESPACES[ns])
        digests = native_chain(algo, seed16, bs, tokens, ex)
    else:
        digests = vllm_chain(algo, seed, bs, tokens, ex, compat)
    d['digests'] = [x.hex() for x in digests]
    d['chunk_keys'] = [x.hex() for x in chunk_keys(digests, bs, chunk)] \
        if chunk else []
    return d


T200 = rand_tokens(200)
T170 = rand_tokens(170)
CASES = [
    case('xxh3_plain', 'xxh3_128', 0, NO_EXTRAS, T200, chunk=64),
    case('sha256_plain', 'sha256', 0, NO_EXTRAS, T200, chunk=64),
    case('xxh3_tenant', 'xxh3_128', 1, NO_EXTRAS, T200),
    case('xxh3_mixed_extras', 'xxh3_128', 1, MIXED, T170, chunk=32),
    case('sha256_mixed_extras', 'sha256', 1, MIXED, T170, chunk=48),
    case('xxh3_nested_mm', 'xxh3_128', 0, NESTED, T170),
    case('xxh3_mm_end_on_boundary', 'xxh3_128', 0, EDGE, T170),
    case('xxh3_mm_zero_length', 'xxh3_128', 0, ZERO, T170),
    case('vllm_xxh_mm_end_on_boundary', 'xxhash_cbor', 0, EDGE, T170,
         seed='7'),
    case('vllm_sha_mm_zero_length', 'sha256_cbor', 0, ZERO, T170, seed='7'),
    case('xxh3_bs1', 'xxh3_128', 2, extras(None, 'salt', [('a', 3, 2)]),
         rand_tokens(10), chunk=3),
    case('xxh3_bs7_salt', 'xxh3_128', 3, extras(None, 'only-block-0'),
         rand_tokens(50), chunk=14),
    case('xxh3_bs4096', 'xxh3_128', 4, NO_EXTRAS, n=2 * 4096 + 5,
         mul=2654435761, add=12345),
    case('sha256_bs4096_lora', 'sha256', 4, extras('l'), n=2 * 4096 + 5,
         mul=2654435761, add=12345),
    case('xxh3_long_extras', 'xxh3_128', 0, LONG, rand_tokens(70)),
    case('sha256_long_extras', 'sha256', 0, LONG, rand_tokens(70)),
    case('vllm_sha_long_extras', 'sha256_cbor', 0, LONG, rand_tokens(70),
         seed='42'),
    case('vllm_xxh_long_extras', 'xxhash_cbor', 0, LONG, rand_tokens(70),
         seed='42'),
    case('vllm_sha_bs4096', 'sha256_cbor', 4,
         extras('adapter', 'tenant', [('img', 4000, 300)]), n=2 * 4096 + 5,
         mul=2654435761, add=12345, seed='0'),
    case('vllm_xxh_bs4096', 'xxhash_cbor', 4, NO_EXTRAS, n=2 * 4096 + 5,
         mul=2654435761, add=12345, seed=''),
    case('vllm_xxh_nested_mm', 'xxhash_cbor', 5, NESTED, T170,
         seed='1234567'),
    # appended: the cases above keep their random draws and digests
    case('xxh3_embeds', 'xxh3_128', 0, EMBEDS, T170),
    case('sha256_embeds_lora_mm', 'sha256', 1, EMBEDS_MIXED, T170),
    case('vllm033_sha_pickle_mixed', 'vllm_sha256', 0, MIXED033, T170,
         seed='0', compat=COMPAT_033),
    case('vllm033_xxh_pickle_edge', 'vllm_xxhash', 0, EDGE, T170, seed='7',
         compat=COMPAT_033),
    case('vllm033_sha_pickle_long', 'vllm_sha256', 0, LONG033,
         rand_tokens(70, 1 << 32), seed='', compat=COMPAT_033),
    case('vllm033_sha_cbor_embeds', 'sha256_cbor', 1, EMBEDS_MIXED, T170,
         seed='42', compat=COMPAT_033),
    case('vllm_pre033_sha_pickle_embeds', 'vllm_sha256', 1, EMBEDS_MIXED,
         T170, seed='42', compat=COMPAT_PRE),
]


# ---- output -----------------------------------------------------------------
LONG_STRINGS = {}  # text -> C name, for strings emitted once


def cstr(s):
    if s is None:
        return 'NULL'
    if s in LONG_STRINGS:
        return LONG_STRINGS[s]
    return cstr_literal(s)


def cstr_literal(s):
    out = '"'
    for b in s.encode('utf-8'):
        c = chr(b)
        if b < 128 and (c.isalnum() or c in ' -_./:@'):
            out += c
        else:
            out += '\\%03o' % b  # octal: never swallows the next character
    return out + '"'


def ckey(hexd):
    d = bytes.fromhex(hexd)[-16:]
    return '{0x%sull, 0x%sull}' % (d[:8].hex(), d[8:].hex())


def wrap(items, per=8, indent='    '):
    rows = [', '.join(items[i:i + per]) for i in range(0, len(items), per)]
    return (',\n' + indent).join(rows)


def emit_header(path):
    o = ['/* SPDX-License-Identifier: Apache-2.0 */',
         '/* GENERATED by tests/data/gen_native_vectors.py from an independent',
         ' * Python implementation (hashlib, xxhash, cbor2, pickle) -- do not',
         ' * edit.',
         ' * Regenerate from the repository root:',
         ' *     /usr/bin/python3 tests/data/gen_native_vectors.py */',
         '#ifndef KVP_NATIVE_CHAIN_VECTORS_H',
         '#define KVP_NATIVE_CHAIN_VECTORS_H',
         '',
         '#include <stddef.h>',
         '#include <stdint.h>',
         '',
         '#include "kvplane/prefix.h"',
         '',
         'typedef struct nv_ns {',
         '  kvp_namespace_desc desc;',
         '  kvp_key seed;',
         '} nv_ns;',
         '',
         'typedef struct nv_case {',
         '  const char *name;',
         '  const char *algo;',
         '  const char *python_hash_seed; /* vLLM modes */',
         '  size_t ns;                    /* index into nv_namespaces */',
         '  const char *lora_name, *cache_salt;',
         '  const kvp_mm_span *mm;',
         '  size_t n_mm;',
         '  const char *lora_path;',
         '  const uint8_t (*embeds)[32]; /* one per block, or NULL */',
         '  size_t n_embeds;',
         '  uint32_t vllm_compat; /* vLLM modes: kvp_vllm_compat */',
         '  /* NULL: tokens[i] = tok_mul * i + tok_add (mod 2^32) */',
         '  const uint32_t *tokens;',
         '  uint32_t tok_mul, tok_add;',
         '  size_t n_tokens;',
         '  const char *const *digest_hex; /* full digest of every block */',
         '  const kvp_key *keys;',
         '  size_t n_blocks;',
         '  uint32_t chunk_tokens; /* 0: none */',
         '  const kvp_key *chunk_keys;',
         '  size_t n_chunks;',
         '} nv_case;',
         '',
         'static const nv_ns nv_namespaces[] = {']
    for ns in NAMESPACES:
        seed = namespace_seed(**ns).hex()
        o.append('    {{%s, %s, %s, %du, %s}, %s},' % (
            cstr(ns['model_id']), cstr(ns['tokenizer_id']),
            cstr(ns['kv_layout']), ns['block_size'], cstr(ns['tenant_salt']),
            ckey(seed)))
    o.append('};')
    o.append('')
    for s in (LONG_LORA, LONG['cache_salt'], LONG033['lora_path']):
        name = 'nv_str_%d' % len(LONG_STRINGS)
        o.append('static const char %s[] = %s;' % (name, cstr_literal(s)))
        LONG_STRINGS[s] = name
    for i, c in enumerate(CASES):
        if c['tokens'] is not None:
            o.append('static const uint32_t nv_tok_%d[] = {\n    %s};' %
                     (i, wrap([str(t) for t in c['tokens']], 10)))
        if c['extras']['mm']:
            o.append('static const kvp_mm_span nv_mm_%d[] = {\n    %s};' % (
                i, wrap(['{%s, %du, %du}' % (cstr(m['id']), m['offset'],
                                             m['length'])
                         for m in c['extras']['mm']], 3)))
        if c['extras']['embeds']:
            o.append('static const uint8_t nv_emb_%d[][32] = {\n    %s};' % (
                i, wrap(['{%s}' % ', '.join('0x%02x' % b for b in e)
                         for e in c['extras']['embeds']], 1)))
        o.append('static const char *const nv_dig_%d[] = {\n    %s};' %
                 (i, wrap(['"%s"' % d for d in c['digests']], 1)))
        o.append('static const kvp_key nv_key_%d[] = {\n    %s};' %
                 (i, wrap([ckey(d) for d in c['digests']], 2)))
        if c['chunk_keys']:
            o.append('static const kvp_key nv_chunk_%d[] = {\n    %s};' %
                     (i, wrap([ckey(d) for d in c['chunk_keys']], 2)))
    o.append('')
    o.append('static const nv_case nv_cases[] = {')
    for i, c in enumerate(CASES):
        ex = c['extras']
        o.append('    {%s, %s, %s, %d, %s, %s, %s, %d, %s, %s, %d, %du, %s, '
                 '%du, %du, %d,\n'
                 '     nv_dig_%d, nv_key_%d, %d, %du, %s, %d},' % (
                     cstr(c['name']), cstr(c['algo']),
                     cstr(c['python_hash_seed']), c['ns'],
                     cstr(ex['lora_name']), cstr(ex['cache_salt']),
                     'nv_mm_%d' % i if ex['mm'] else 'NULL', len(ex['mm']),
                     cstr(ex['lora_path']),
                     'nv_emb_%d' % i if ex['embeds'] else 'NULL',
                     len(ex['embeds'] or []), c['vllm_compat'],
                     'nv_tok_%d' % i if c['tokens'] is not None else 'NULL',
                     c['tok_mul'], c['tok_add'], c['n_tokens'], i, i,
                     len(c['digests']), c['chunk_tokens'],
                     'nv_chunk_%d' % i if c['chunk_keys'] else 'NULL',
                     len(c['chunk_keys'])))
    o.append('};')
    o.append('')
    o.append('#endif /* KVP_NATIVE_CHAIN_VECTORS_H */')
    with open(path, 'w') as f:
        f.write('\n'.join(o) + '\n')


def emit_json(path):
    doc = dict(
        about='kvplane block-hash golden vectors (native xxh3_128/sha256, '
              'chunk keys, namespace seeds, extra vLLM-mode cases); '
              'generated by tests/data/gen_native_vectors.py. Digests are '
              'full; the key is the last 16 bytes (hi, lo big-endian). '
              'tokens null: tokens[i] = (tok_mul*i + tok_add) mod 2^32.',
        namespaces=[dict(ns, seed_hex=namespace_seed(**ns).hex())
                    for ns in NAMESPACES],
        cases=[dict(c, extras=dict(c['extras'], embeds=[
            e.hex() for e in c['extras']['embeds'] or []]))
            for c in CASES])
    with open(path, 'w') as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write('\n')


if __name__ == '__main__':
    emit_header(os.path.join(HERE, 'native_chain_vectors.h'))
    emit_json(os.path.join(HERE, 'native_chain_vectors.json'))
