#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build the tiny random Llama that the real-vLLM cluster serves.

No model hub is reachable here, so the model is made locally, from a fixed
seed, in a few seconds: a Llama (hidden 256, 2 layers, 4 heads, 16K
positions, bf16, safetensors) with random weights, and a byte-level
tokenizer whose first 256 ids ARE the bytes (token id = byte value, no
merges) -- the same tokenizer as kvplane-bench's emulated workers, so a text
prompt of N ASCII bytes is N tokens on both, and the trace's blocks land on
the same token positions.  Ids 256 .. VOCAB-2 are filler tokens (two byte
symbols each, never produced by encoding, decodable), id VOCAB-1 is the
end-of-text token.  The chat template is the emulator's: per message
`<|ROLE|>\\n` CONTENT `\\n`, then `<|assistant|>\\n`.

The weights are random: generated text is noise.  What the cluster
measures is prefill, prefix caching and routing, which the model's size and
the engine's code decide, not its weights.

usage: tiny_model.py OUT_DIR     (idempotent: an up-to-date OUT_DIR is kept)
Run with the real-vLLM venv's python (bench/live/vllm/setup.sh makes it).
"""
import json
import os
import sys

VOCAB = 32768          # token ids 0..VOCAB-1; prompts use ids below VOCAB-1
EOS = VOCAB - 1
SPEC = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 16384, "vocab_size": VOCAB, "seed": 20261128,
        "format": 1}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n"
                 "{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
                 "{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def byte_symbols():
    """GPT-2's byte -> printable unicode symbol map (what ByteLevel uses)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    sym = byte_symbols()
    vocab = {sym[b]: b for b in range(256)}
    k = 256
    for a in range(256):           # filler: two-symbol strings, in a fixed order
        for b in range(256):
            if k >= EOS:
                break
            vocab[sym[a] + sym[b]] = k
            k += 1
    assert k == EOS and len(vocab) == EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    assert tok.token_to_id("<|endoftext|>") == EOS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = SPEC["max_position_embeddings"]
    fast.save_pretrained(out)
    # token id = byte value, the emulator's tokenizer
    ids = fast("Hi @/\\ \xe9", add_special_tokens=False)["input_ids"]
    assert ids == list("Hi @/\\ \xe9".encode()), ids


def build_model(out):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(SPEC["seed"])
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=SPEC["hidden_size"],
                      intermediate_size=SPEC["intermediate_size"],
                      num_hidden_layers=SPEC["num_hidden_layers"],
                      num_attention_heads=SPEC["num_attention_heads"],
                      num_key_value_heads=SPEC["num_key_value_heads"],
                      max_position_embeddings=SPEC["max_position_embeddings"],
                      bos_token_id=None, eos_token_id=EOS, pad_token_id=EOS,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[-2])
    out = sys.argv[1]
    stamp = os.path.join(out, "kvplane-tiny.json")
    try:
        with open(stamp) as f:
            if json.load(f) == SPEC:
                print("tiny_model: %s is up to date" % out)
                return 0
    except (OSError, ValueError):
        pass
    tmp = out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    build_tokenizer(tmp)
    build_model(tmp)
    with open(os.path.join(tmp, "kvplane-tiny.json"), "w") as f:
        json.dump(SPEC, f)
    if os.path.isdir(out):
        import shutil
        shutil.rmtree(out)
    os.rename(tmp, out)
    print("tiny_model: built %s (vocab %d, eos %d)" % (out, VOCAB, EOS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
