#!/usr/bin/env python3
"""Loads an exported folder with transformers and compares its logits with xmoe's.

Usage: hf_logits.py HF_DIR XMOE_LOGITS.safetensors ARCHITECTURE TOLERANCE
XMOE_LOGITS holds "ids" i32 [1, S] and "logits" f32 [S, V] (tests/hf_reference_logits.cpp).
Checks: config.json names ARCHITECTURE; the fast tokenizer maps the text's bytes to the same
ids as xmoe and decodes them back; AutoModelForCausalLM (torch, f32, eager attention) gives
logits within TOLERANCE (max |diff|) of xmoe's and the same argmax at every position.
Exit status 77: torch or transformers missing (ctest: skipped).
"""
import sys

try:
    import torch
    import transformers
    from safetensors.torch import load_file
except ImportError as e:
    print(f"SKIP: torch and transformers are needed ({e})")
    sys.exit(77)


def main(hf_dir, logits_file, architecture, tolerance):
    ref = load_file(logits_file)
    ids, want = ref["ids"].long(), ref["logits"]
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    assert config.architectures == [architecture], (config.architectures, architecture)

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = bytes(ids[0].tolist()).decode("utf-8")
    enc = tok(text, add_special_tokens=False)["input_ids"]
    assert enc == ids[0].tolist(), f"tokenizer ids differ: {enc[:20]} vs {ids[0].tolist()[:20]}"
    assert tok.decode(enc) == text, "tokenizer decode does not give the text back"
    every_byte = bytes(range(256)).decode("latin-1")
    assert tok(every_byte, add_special_tokens=False)["input_ids"] == list(
        every_byte.encode("utf-8")), "tokenizer: a byte maps to another id"

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ids).logits[0].float()
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = (got - want).abs().max().item()
    same_argmax = bool((got.argmax(-1) == want.argmax(-1)).all())
    print(f"[hf_logits] {architecture} ({type(model).__name__}, transformers "
          f"{transformers.__version__}): {ids.shape[1]} tokens, max |logit diff| = {diff:.3g} "
          f"(tolerance {tolerance:g}, logits up to {want.abs().max().item():.3g}), "
          f"argmax equal: {same_argmax}")
    assert diff <= tolerance, f"logits differ by {diff} > {tolerance}"
    assert same_argmax, "the most likely next byte differs"


if __name__ == "__main__":
    if len(sys.argv) != 5:
        print(__doc__)
        sys.exit(2)
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
