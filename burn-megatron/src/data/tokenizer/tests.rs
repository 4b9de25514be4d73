use super::*;
use crate::data::{synthetic_corpus, synthetic_vocabulary};

#[test]
fn trained_vocab_round_trips_and_reloads_from_json_and_vocab_txt() {
    let docs = synthetic_corpus(300, 1);
    let tok = BertTokenizer::train(&docs, 400).unwrap();
    assert!(tok.vocab_size() <= 400 && tok.vocab_size() > 50);
    assert_eq!((tok.pad, tok.cls, tok.sep, tok.mask), (0, 2, 3, 4));
    let ids = tok.encode("First the Quiet dog runs slowly.").unwrap();
    assert!(!ids.is_empty() && ids.iter().all(|i| !tok.is_special(*i)));
    assert_eq!(
        tok.decode(&ids).unwrap(),
        "first the quiet dog runs slowly."
    );

    let dir = std::env::temp_dir().join(format!("bm-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("tokenizer.json");
    tok.save(&json).unwrap();
    let again = BertTokenizer::from_file(&json).unwrap();
    assert_eq!(
        again.encode("then they walk to the farm.").unwrap(),
        tok.encode("then they walk to the farm.").unwrap()
    );

    // A vocab.txt with one token per line, ids by line number.
    let vocab = dir.join("vocab.txt");
    let lines = [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "dog", "##s", ".",
    ];
    std::fs::write(&vocab, lines.join("\n")).unwrap();
    let v = BertTokenizer::from_file(&vocab).unwrap();
    assert_eq!(v.encode("The dogs cat.").unwrap(), vec![5, 6, 7, 1, 8]);
    // The generator's own vocabulary: whole words, the same ids in every process.
    let syn = BertTokenizer::from_vocab(synthetic_vocabulary()).unwrap();
    let again = BertTokenizer::from_vocab(synthetic_vocabulary()).unwrap();
    let text = "Then the gentle cats wait near the bread in the bakery.";
    let ids = syn.encode(text).unwrap();
    assert_eq!(ids, again.encode(text).unwrap());
    assert_eq!(ids.len(), 12, "one token per word and the full stop");
    assert_eq!(syn.decode(&ids).unwrap(), text.to_lowercase());
    let missing = BertTokenizer::from_file(&dir.join("none.txt")).unwrap_err();
    assert!(missing.to_string().contains("none.txt"));
    std::fs::remove_dir_all(&dir).unwrap();
}
