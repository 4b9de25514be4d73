use super::*;
use std::collections::BTreeSet;

fn dataset(seq: usize, short: f64, seed: u64) -> (BertDataset, BertTokenizer) {
    let docs = synthetic_corpus(400, 5);
    let tok = BertTokenizer::from_vocab(synthetic_vocabulary()).unwrap();
    let config = BertDatasetConfig::new(seq)
        .with_short_seq_prob(short)
        .with_seed(seed);
    (BertDataset::new(&docs, &tok, config).unwrap(), tok)
}

/// The ids before masking.
fn original(s: &BertSample) -> Vec<u32> {
    (0..s.ids.len())
        .filter(|&i| !s.padding[i])
        .map(|i| {
            (if s.loss_mask[i] > 0.0 {
                s.labels[i]
            } else {
                s.ids[i]
            }) as u32
        })
        .collect()
}

#[test]
fn samples_are_deterministic_well_formed_pairs() {
    let (data, tok) = dataset(64, 0.1, 9);
    let (again, _) = dataset(64, 0.1, 9);
    let (other, _) = dataset(64, 0.1, 10);
    assert_eq!(data.sample(17), again.sample(17));
    assert_ne!(data.sample(17), other.sample(17));
    // Later epochs reshuffle and remask: sample i and i + len differ.
    assert_ne!(data.sample(3), data.sample(3 + data.len()));
    for i in 0..200 {
        let s = data.sample(i);
        assert_eq!(s.ids.len(), 64);
        let used = s.padding.iter().filter(|p| !**p).count();
        assert!(s.padding[..used].iter().all(|p| !p) && s.padding[used..].iter().all(|p| *p));
        let ids = original(&s);
        assert_eq!(ids[0], tok.cls);
        let seps: Vec<usize> = (0..used).filter(|&j| ids[j] == tok.sep).collect();
        assert_eq!(seps.len(), 2, "{ids:?}");
        assert_eq!(seps[1], used - 1);
        for j in 0..used {
            assert_eq!(s.types[j], i64::from(j > seps[0]), "types of sample {i}");
        }
        let predicted = s.loss_mask.iter().filter(|m| **m > 0.0).count();
        assert_eq!(predicted, ((used as f64 * 0.15).round() as usize).max(1));
        for j in 0..64 {
            if s.loss_mask[j] > 0.0 {
                assert!(!tok.is_special(s.labels[j] as u32));
            } else {
                assert_eq!(s.labels[j], 0);
            }
        }
    }
}

#[test]
fn masking_is_80_10_10_and_sentence_order_labels_are_true() {
    let (data, tok) = dataset(128, 0.0, 2);
    let (mut masked, mut kept, mut random, mut swapped) = (0, 0, 0, 0);
    let n = 2000;
    for i in 0..n {
        let s = data.sample(i);
        for j in 0..128 {
            if s.loss_mask[j] > 0.0 {
                match s.ids[j] {
                    id if id == i64::from(tok.mask) => masked += 1,
                    id if id == s.labels[j] => kept += 1,
                    _ => random += 1,
                }
            }
        }
        // Documents fit whole at this length, so the story's first sentence opens span A
        // unless the spans were swapped.
        let ids = original(&s);
        let sep = ids.iter().position(|t| *t == tok.sep).unwrap();
        let first_of_a = tok.decode(&ids[1..sep]).unwrap();
        let first_of_b = tok.decode(&ids[sep + 1..]).unwrap();
        if s.is_random == 1 {
            swapped += 1;
            assert!(first_of_b.starts_with("first"), "{first_of_b}");
        } else {
            assert!(first_of_a.starts_with("first"), "{first_of_a}");
        }
    }
    let total = f64::from(masked + kept + random);
    let (m, k, r) = (
        f64::from(masked) / total,
        f64::from(kept) / total,
        f64::from(random) / total,
    );
    assert!(
        (m - 0.8).abs() < 0.02 && (k - 0.1).abs() < 0.015,
        "{m} {k} {r}"
    );
    assert!((r - 0.1).abs() < 0.015, "{m} {k} {r}");
    let swap_rate = f64::from(swapped) / n as f64;
    assert!((swap_rate - 0.5).abs() < 0.04, "{swap_rate}");
}

#[test]
fn dp_ranks_read_disjoint_shards_covering_the_same_global_batch() {
    for dp in [1, 2, 4] {
        let layout = BatchLayout::new(16, 2, dp).unwrap();
        assert_eq!(layout.num_micro_batches(), 16 / (2 * dp));
        for iteration in 0..3 {
            let mut seen = BTreeSet::new();
            for rank in 0..dp {
                for micro in 0..layout.num_micro_batches() {
                    for i in layout.micro_batch(iteration, rank, micro) {
                        assert!(seen.insert(i), "sample {i} read twice");
                    }
                }
            }
            let expected: BTreeSet<usize> = (iteration * 16..(iteration + 1) * 16).collect();
            assert_eq!(seen, expected);
        }
    }
    let err = BatchLayout::new(10, 2, 2).unwrap_err().to_string();
    assert!(
        err.contains("global batch size (10)") && err.contains("(2)"),
        "{err}"
    );
}

#[test]
fn batches_stack_samples_into_tensors_and_bad_sizes_are_rejected() {
    let (data, tok) = dataset(32, 0.1, 1);
    let samples: Vec<BertSample> = (0..3).map(|i| data.sample(i)).collect();
    let device = burn::tensor::Device::flex();
    let batch = BertBatch::new(&samples, &device);
    assert_eq!(batch.ids.dims(), [3, 32]);
    assert_eq!(batch.is_random.dims(), [3]);
    let ids: Vec<i64> = batch.ids.into_data().iter::<i64>().collect();
    assert_eq!(&ids[32..64], samples[1].ids.as_slice());
    let docs = synthetic_corpus(10, 1);
    let err = BertDataset::new(&docs, &tok, BertDatasetConfig::new(4)).unwrap_err();
    assert!(err.to_string().contains("seq_length 4"));
}

/// A tokenizer whose whole vocabulary is [PAD] [CLS] [SEP] [MASK] (a word-level model without
/// an unknown token): refused with a message, where masking would draw a replacement forever.
#[test]
fn a_vocabulary_of_only_special_tokens_is_refused() {
    use tokenizers::models::wordlevel::WordLevel;
    let vocab = ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder().vocab(vocab).build().unwrap();
    let path = std::env::temp_dir().join(format!("bm-special-only-{}.json", std::process::id()));
    tokenizers::Tokenizer::new(model)
        .save(&path, false)
        .unwrap();
    let tok = BertTokenizer::from_file(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let docs = vec![vec!["[CLS]".to_string(), "[MASK]".to_string()]];
    let e = BertDataset::new(&docs, &tok, BertDatasetConfig::new(16)).unwrap_err();
    assert!(e.to_string().contains("4 tokens are all special"), "{e}");
}
