use super::*;
use crate::data::synthetic_corpus;
use std::path::Path;

#[test]
fn bpe_training_is_deterministic_and_round_trips() {
    let docs = synthetic_corpus(200, 3);
    let a = GptTokenizer::train(&docs, 600).unwrap();
    let b = GptTokenizer::train(&docs, 600).unwrap();
    assert_eq!(
        a.inner.get_vocab(true),
        b.inner.get_vocab(true),
        "the same vocabulary"
    );
    assert!(a.vocab_size() <= 600 && a.vocab_size() > 300);
    let text = "Then the gentle cats wait near the bread.";
    let ids = a.encode(text).unwrap();
    assert!(ids.len() < text.len(), "merges shorten the text");
    assert_eq!(a.decode(&ids).unwrap(), text);
    let dir = std::env::temp_dir().join(format!("bm-gpt-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    a.save(&dir.join("tokenizer.json")).unwrap();
    let again = GptTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(again.encode(text).unwrap(), ids);
    assert_eq!(again.eod, a.eod);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn samples_are_shifted_windows_of_the_stream() {
    let data =
        GptCorpusDataset::from_tokens((0..23).collect(), GptCorpusDatasetConfig::new(4)).unwrap();
    assert_eq!(data.len(), 5);
    let mut starts: Vec<i64> = (0..5).map(|i| data.sample(i).ids[0]).collect();
    for i in 0..5 {
        let s = data.sample(i);
        assert_eq!(s.labels[..3], s.ids[1..]);
        assert_eq!(s.labels[3], s.ids[3] + 1);
    }
    starts.sort();
    assert_eq!(starts, vec![0, 4, 8, 12, 16]);
    assert_eq!(
        data.sample(5),
        data.sample(0),
        "the next epoch repeats the order"
    );
    assert!(GptCorpusDataset::from_tokens(vec![1, 2], GptCorpusDatasetConfig::new(4)).is_err());
}

/// Meta's Llama 3 `tokenizer.model` (a tiktoken BPE file) gives tiktoken's ids: the fixture's
/// cases, encoded by `tiktoken.Encoding` with Meta's pattern and special tokens
/// (tests/fixtures/make_meta_llama.py), special tokens in the text included. The ids decode
/// to the text, and the `tokenizer.json` it saves as reads back to the same ids.
#[test]
fn a_llama_3_tokenizer_model_encodes_as_tiktoken() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/meta_llama_tiny");
    let t = GptTokenizer::from_file(&dir.join("tokenizer.model")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer_expected.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(t.vocab_size() as u64, expected["vocab_size"]);
    assert_eq!(
        t.token_id("<|begin_of_text|>").map(u64::from),
        expected["begin_of_text"].as_u64()
    );
    assert_eq!(u64::from(t.eod), expected["end_of_text"]);
    let saved = std::env::temp_dir().join(format!("bm-tiktoken-{}.json", std::process::id()));
    t.save(&saved).unwrap();
    let again = GptTokenizer::from_file(&saved).unwrap();
    std::fs::remove_file(&saved).unwrap();
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() > 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let ids = t.encode(text).unwrap();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(again.encode(text).unwrap(), want, "saved, {text:?}");
        if !text.contains("<|") {
            assert_eq!(t.decode(&ids).unwrap(), text);
        }
    }
}

/// What is neither a `tokenizer.json` nor a tiktoken file (Llama 2's SentencePiece model, say)
/// is refused naming both, and the file.
#[test]
fn a_tokenizer_file_of_neither_kind_is_refused_naming_what_is_read() {
    let path = std::env::temp_dir().join(format!("bm-spm-{}.model", std::process::id()));
    std::fs::write(
        &path,
        [0x0a, 0x0e, 0x0a, 0x05, b'<', b'u', b'n', b'k', b'>'],
    )
    .unwrap();
    let e = GptTokenizer::from_file(&path).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(
        e.contains("bm-spm") && e.contains("tiktoken") && e.contains("SentencePiece"),
        "{e}"
    );
}

/// Llama 2's `tokenizer.model` (a SentencePiece BPE model, trained as Llama 2's was: byte
/// fallback, digits split, a dummy prefix, spaces kept) gives SentencePiece's ids for the
/// fixture's texts, and decodes them to SentencePiece's text; a model with NFKC
/// normalisation (its precompiled map) too (tests/fixtures/make_sentencepiece.py). The saved
/// `tokenizer.json` reads back to the same ids.
#[test]
fn a_llama_2_tokenizer_model_encodes_as_sentencepiece() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/spm_llama2_tiny");
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer_expected.json")).unwrap(),
    )
    .unwrap();
    let t = GptTokenizer::from_file(&dir.join("tokenizer.model")).unwrap();
    assert_eq!(t.vocab_size() as u64, expected["vocab_size"]);
    assert_eq!(t.token_id("<s>").map(u64::from), expected["bos"].as_u64());
    assert_eq!(u64::from(t.eod), expected["eos"]);
    let saved = std::env::temp_dir().join(format!("bm-spm-{}.json", std::process::id()));
    t.save(&saved).unwrap();
    let again = GptTokenizer::from_file(&saved).unwrap();
    std::fs::remove_file(&saved).unwrap();
    let nfkc = GptTokenizer::from_file(&dir.join("nfkc.model")).unwrap();
    for (tokenizer, key, at_least) in [(&t, "cases", 15), (&nfkc, "nfkc_cases", 4)] {
        let cases = expected[key].as_array().unwrap();
        assert!(cases.len() >= at_least, "{key}");
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let ids = tokenizer.encode(text).unwrap();
            assert_eq!(ids, want, "{key}: {text:?}");
            assert_eq!(
                tokenizer.decode(&ids).unwrap(),
                case["decoded"],
                "{key}: {text:?}"
            );
            if key == "cases" {
                assert_eq!(again.encode(text).unwrap(), want, "saved: {text:?}");
            }
        }
    }
}
