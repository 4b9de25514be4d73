use super::*;

#[test]
fn generator_is_deterministic_ordered_and_agrees_in_number() {
    let docs = synthetic_corpus(200, 3);
    assert_eq!(docs, synthetic_corpus(200, 3));
    assert_ne!(docs, synthetic_corpus(200, 4));
    for doc in &docs {
        assert!((3..=5).contains(&doc.len()));
        for (i, s) in doc.iter().enumerate() {
            assert!(s.starts_with(OPENERS[i]), "{s}");
            assert!(s.ends_with('.'));
            // "they" always takes the plural verb, "it" the singular.
            let words: Vec<&str> = s.split(' ').collect();
            if let Some(p) = words.iter().position(|w| *w == "they") {
                assert!(VERBS.iter().any(|v| v.1 == words[p + 1]), "{s}");
            }
            if let Some(p) = words.iter().position(|w| *w == "it") {
                assert!(VERBS.iter().any(|v| v.0 == words[p + 1]), "{s}");
            }
        }
    }
}

#[test]
fn text_and_jsonl_files_load_as_documents() {
    let dir = std::env::temp_dir().join(format!("bm-corpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let txt = dir.join("c.txt");
    std::fs::write(&txt, "One. Two! Three?\n\nAlone.\n\nA b. C d.").unwrap();
    let docs = load_corpus(&txt).unwrap();
    assert_eq!(
        docs,
        vec![vec!["One.", "Two!", "Three?"], vec!["A b.", "C d."]]
    );
    let jsonl = dir.join("c.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"x y. z.\"}\n\n{\"text\": \"p. q.\"}\n").unwrap();
    assert_eq!(load_corpus(&jsonl).unwrap().len(), 2);
    std::fs::write(&jsonl, "{\"body\": \"x. y.\"}\n").unwrap();
    let err = load_corpus(&jsonl).unwrap_err().to_string();
    assert!(err.contains("line 1") && err.contains("text"), "{err}");
    let missing = load_corpus(&dir.join("nope.txt")).unwrap_err().to_string();
    assert!(missing.contains("nope.txt"), "{missing}");
    std::fs::remove_dir_all(&dir).unwrap();
}
