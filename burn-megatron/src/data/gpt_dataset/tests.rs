use super::*;
use crate::data::synthetic_corpus;

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
