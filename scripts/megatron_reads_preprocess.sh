#!/usr/bin/env bash
# Shows that what `preprocess_data` writes is what Megatron-Core reads: a JSONL corpus and a
# byte-level BPE made with HF `tokenizers`, tokenized by our preprocess_data, then opened
# with megatron-core's IndexedDataset, every document compared with `tokenizers`' ids + eod.
# Needs python3 with megatron-core==0.16.1 and tokenizers. Not part of CI (CI has no Python).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
python3 - <<'PY'
import json, random
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
random.seed(0)
words = "the dog cat runs sails near harbor bread cake teacher student lesson book".split()
docs = [" ".join(random.choice(words) for _ in range(random.randint(5, 80))) + "." for _ in range(400)]
with open("corpus.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save("tokenizer.json")
PY
cargo run -q --release --manifest-path "$root/Cargo.toml" -p burn-megatron-examples --example preprocess_data -- \
    --input corpus.jsonl --json-keys text --tokenizer-model tokenizer.json \
    --output-prefix "$work/corpus" --append-eod --workers 2
python3 "$root/tests/fixtures/megatron_data/check_megatron_reads.py" "$work/corpus_text_document" 2>/dev/null
python3 - 2>/dev/null <<'PY'
import json
from tokenizers import Tokenizer
from megatron.core.datasets.indexed_dataset import IndexedDataset
t = Tokenizer.from_file("tokenizer.json")
eod = t.token_to_id("<|endoftext|>")
ds = IndexedDataset("corpus_text_document")
docs = [json.loads(l)["text"] for l in open("corpus.jsonl")]
same = all(list(ds[i]) == t.encode(d).ids + [eod] for i, d in enumerate(docs))
print(f"megatron-core: {len(ds)} sequences, {len(ds.document_indices) - 1} documents; "
      f"every document equals tokenizers' ids + eod: {same}")
assert same
PY
