#!/usr/bin/env python3
"""Dev tool: run a Hugging Face causal LM directory through `transformers` and get its logits.

Checks that a directory our Rust code writes (config.json + model*.safetensors, sharded or not)
loads in transformers and gives the same logits as our model. Not used by the build or CI.
Requires torch, transformers (5.x), safetensors (PyPI). Runs on CPU, fp32, eager attention.

    python scripts/hf_logits.py HF_DIR IDS.safetensors OUT.safetensors
        Loads HF_DIR with AutoModelForCausalLM.from_pretrained(HF_DIR, attn_implementation="eager")
        in fp32 eval mode, reads `input_ids` (and `attention_mask`, if present) from
        IDS.safetensors, and writes `logits` (fp32, [batch, seq, vocab]) to OUT.safetensors.

    python scripts/hf_logits.py HF_DIR IDS.safetensors --compare EXPECTED.safetensors
        Instead of writing, prints the max abs difference between transformers' logits and the
        `logits` tensor of EXPECTED.safetensors; exits 1 if it exceeds 1e-4 (or the shapes
        differ), 0 otherwise.

Position ids are not passed, so transformers uses arange(seq) for every row (right padding).
"""
import argparse
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

TOLERANCE = 1e-4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", help="directory with config.json and model*.safetensors")
    ap.add_argument("ids", help="safetensors file with input_ids (and optionally attention_mask)")
    ap.add_argument("out", nargs="?", help="where to write `logits` (omit with --compare)")
    ap.add_argument("--compare", metavar="EXPECTED", help="safetensors file with a `logits` tensor")
    args = ap.parse_args()
    if (args.out is None) == (args.compare is None):
        ap.error("give exactly one of OUT.safetensors or --compare EXPECTED.safetensors")

    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(
        args.hf_dir, attn_implementation="eager", dtype=torch.float32
    )
    model.float().eval()

    inputs = load_file(args.ids)
    if "input_ids" not in inputs:
        sys.exit(f"{args.ids}: no `input_ids` tensor (has {sorted(inputs)})")
    input_ids = inputs["input_ids"].long()
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    attention_mask = inputs.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.long().reshape(input_ids.shape)

    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float().contiguous()

    if args.out is not None:
        save_file({"logits": logits}, args.out)
        print(f"wrote logits {list(logits.shape)} to {args.out}")
        return 0

    expected = load_file(args.compare)
    if "logits" not in expected:
        print(f"{args.compare}: no `logits` tensor (has {sorted(expected)})")
        return 1
    want = expected["logits"].float()
    if want.shape != logits.shape:
        print(f"shape mismatch: transformers {list(logits.shape)} vs expected {list(want.shape)}")
        return 1
    diff = (logits - want).abs().max().item()
    ok = diff <= TOLERANCE
    print(f"max abs diff {diff:.3e} ({'ok' if ok else 'FAIL'}, tolerance {TOLERANCE:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
