use super::*;
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bm-megatron-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn numpy_random_state_shuffles_as_numpy() {
    // np.random.RandomState(1234).shuffle(np.arange(20, dtype=np.int32))
    let mut a: Vec<i32> = (0..20).collect();
    NumpyRandomState::new(1234).shuffle(&mut a);
    assert_eq!(
        a,
        [
            3, 13, 2, 16, 14, 5, 4, 0, 8, 18, 17, 11, 10, 9, 7, 1, 19, 12, 6, 15
        ]
    );
    // np.random.RandomState(7).shuffle(np.arange(100000, dtype=np.uint32))
    let mut a: Vec<u32> = (0..100_000).collect();
    NumpyRandomState::new(7).shuffle(&mut a);
    assert_eq!(
        a[..8],
        [33909, 92307, 89107, 9538, 31008, 71305, 71012, 62938]
    );
    assert_eq!(a[a.len() - 4..], [10742, 49689, 58564, 61615]);
}

#[test]
fn numpy_sum_and_split_matrix() {
    let m = split_matrix("969,30,1").unwrap();
    assert_eq!(m[0], Some((0.0, 0.969)));
    assert_eq!(m[1].unwrap().0, 0.969);
    assert_eq!(split_matrix("1").unwrap(), [Some((0.0, 1.0)), None, None]);
    assert!(split_matrix("1,2,3,4").is_err());
    assert!(split_matrix("0,0").is_err());
    // Pairwise above 8 terms: not the left fold.
    let v: Vec<f64> = (1..=20).map(|i| 1.0 / i as f64).collect();
    let fold = v.iter().fold(0.0, |a, b| a + b);
    let pairwise = numpy_sum(&v);
    assert!((pairwise - fold).abs() < 1e-14);
}

fn write_dataset(prefix: &Path, dtype: TokenDType, docs: &[Vec<Vec<i64>>]) {
    let mut b = IndexedDatasetBuilder::new(prefix, dtype).unwrap();
    for doc in docs {
        for s in doc {
            b.add_item(s).unwrap();
        }
        b.end_document();
    }
    b.finalize().unwrap();
}

#[test]
fn builder_and_reader_round_trip_every_dtype() {
    let dir = scratch("dtypes");
    let docs = vec![vec![vec![1, 2, 3], vec![4]], vec![vec![], vec![5, 6, 100]]];
    for code in 1..=8u8 {
        let dtype = TokenDType::from_code(code).unwrap();
        let prefix = dir.join(dtype.name());
        write_dataset(&prefix, dtype, &docs);
        let d = IndexedDataset::open(&prefix).unwrap();
        assert_eq!((d.dtype(), d.len(), d.num_documents()), (dtype, 4, 2));
        assert_eq!(d.document(1), 2..4);
        assert_eq!(d.get(3, 1, None).unwrap(), [6, 100]);
        assert_eq!(d.get(0, 0, Some(2)).unwrap(), [1, 2]);
        assert!(d.get(0, 2, Some(2)).is_err());
        assert!(d.get(4, 0, None).is_err());
    }
    let mut b = IndexedDatasetBuilder::new(dir.join("small"), TokenDType::U8).unwrap();
    assert!(
        b.add_item(&[256])
            .unwrap_err()
            .to_string()
            .contains("uint8")
    );
}

#[test]
fn bad_files_are_errors_naming_the_file() {
    let dir = scratch("bad");
    let prefix = dir.join("d");
    write_dataset(
        &prefix,
        TokenDType::U16,
        &[vec![vec![1, 2, 3, 4]], vec![vec![5, 6]]],
    );
    let (idx, bin) = dataset_paths(&prefix);
    let good_idx = std::fs::read(&idx).unwrap();
    let good_bin = std::fs::read(&bin).unwrap();
    let err = |idx_bytes: &[u8], bin_bytes: &[u8]| {
        std::fs::write(&idx, idx_bytes).unwrap();
        std::fs::write(&bin, bin_bytes).unwrap();
        IndexedDataset::open(&prefix).unwrap_err().to_string()
    };
    let e = err(&good_idx, &good_bin[..good_bin.len() - 2]);
    assert!(e.contains("d.bin") && e.contains("truncated"), "{e}");
    let e = err(&good_idx[..good_idx.len() - 1], &good_bin);
    assert!(e.contains("d.idx") && e.contains("truncated"), "{e}");
    let mut v = good_idx.clone();
    v[9..17].copy_from_slice(&2u64.to_le_bytes());
    assert!(err(&v, &good_bin).contains("version 2"));
    v[9..17].copy_from_slice(&1u64.to_be_bytes());
    assert!(err(&v, &good_bin).contains("byte order"));
    let mut v = good_idx.clone();
    v[17] = 9;
    assert!(err(&v, &good_bin).contains("dtype code 9"));
    let mut v = good_idx.clone();
    v[0] = b'X';
    assert!(err(&v, &good_bin).contains("magic"));
    // The last document bound points past the sequences.
    let mut v = good_idx.clone();
    let last = v.len() - 8;
    v[last..].copy_from_slice(&3i64.to_le_bytes());
    let e = err(&v, &good_bin);
    assert!(
        e.contains("d.idx") && e.contains("document bound 2 is 3"),
        "{e}"
    );
    // A pointer past the end of .bin.
    let mut v = good_idx.clone();
    v[34 + 8 + 8..34 + 8 + 16].copy_from_slice(&1000i64.to_le_bytes());
    assert!(err(&v, &good_bin).contains("d.bin"));
    std::fs::write(&idx, &good_idx).unwrap();
    std::fs::write(&bin, &good_bin).unwrap();
    assert!(IndexedDataset::open(&prefix).is_ok());
}

#[test]
fn gpt_samples_cover_the_split_in_order_and_cache() {
    let dir = scratch("gpt");
    let prefix = dir.join("text_document");
    let docs: Vec<Vec<Vec<i64>>> = (0..30)
        .map(|d| vec![(0..(d % 7 + 3)).map(|t| d * 100 + t).collect()])
        .collect();
    write_dataset(&prefix, TokenDType::U16, &docs);
    let blend = Blend::parse(&[prefix.display().to_string()]).unwrap();
    let config = GPTDatasetConfig::new(8)
        .with_split("80,20,0".into())
        .with_path_to_cache(Some(dir.join("cache").display().to_string()));
    let [train, valid, test] =
        build_gpt_datasets(&blend, &config, [Some(40), Some(3), None]).unwrap();
    assert!(test.is_none());
    let (train, valid) = (train.unwrap(), valid.unwrap());
    assert!(train.len() >= 40 && valid.len() >= 3);
    // Valid holds documents 24..30 only; every sample is 9 tokens drawn from them.
    for i in 0..valid.len() {
        let s = valid.sample(i).unwrap();
        assert_eq!(s.len(), 9);
        assert!(s.iter().all(|t| (2400..3000).contains(t)), "{s:?}");
    }
    // A second build reads the cache and gives the same samples.
    let cached = std::fs::read_dir(dir.join("cache")).unwrap().count();
    assert_eq!(cached, 8, "3 arrays + description for each of two splits");
    let again = build_gpt_datasets(&blend, &config, [Some(40), Some(3), None]).unwrap();
    let again = again[0].as_ref().unwrap();
    for i in 0..train.len() {
        assert_eq!(train.sample(i).unwrap(), again.sample(i).unwrap());
    }
}

#[test]
fn blend_words_are_checked() {
    let w = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    let b = Blend::parse(&w("0.3 a 0.7 b")).unwrap();
    assert_eq!(b.weights, Some(vec![0.3, 0.7]));
    assert!(Blend::parse(&w("0.3 a 0.7")).is_err());
    assert!(Blend::parse(&w("x a 0.7 b")).is_err());
    assert!(Blend::parse(&w("0 a 0.7 b")).is_err());
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/megatron_data")
}

fn ints(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn windows(v: &serde_json::Value) -> Vec<Vec<i64>> {
    v.as_array().unwrap().iter().map(ints).collect()
}

fn check_gpt_split(
    case: &str,
    split: &str,
    ours: &GPTDataset,
    golden: &serde_json::Value,
    with_samples: bool,
) {
    let at = format!("{case}/{split}");
    assert_eq!(
        ours.len() as u64,
        golden["len"].as_u64().unwrap(),
        "{at}: len"
    );
    assert_eq!(
        ours.num_epochs() as u64,
        golden["num_epochs"].as_u64().unwrap(),
        "{at}: epochs"
    );
    let (d, s, sh) = ours.indices();
    let d: Vec<i64> = d.iter().map(|&x| i64::from(x)).collect();
    assert_eq!(d, ints(&golden["document_index"]), "{at}: document index");
    let golden_s: Vec<i64> = windows(&golden["sample_index"]).concat();
    assert_eq!(s, golden_s, "{at}: sample index");
    assert_eq!(sh, ints(&golden["shuffle_index"]), "{at}: shuffle index");
    if with_samples {
        for (i, w) in windows(&golden["samples"]).iter().enumerate() {
            assert_eq!(&ours.sample(i).unwrap(), w, "{at}: sample {i}");
        }
    }
}

/// Every case megatron-core 0.16.1 built (`make_megatron_data.py`): the split ranges, the
/// three indices, the epochs and every recorded sample window, for single datasets
/// (several epochs with the last one shuffled apart, padded validation, no extra token)
/// and a 0.3/0.7 blend.
#[test]
fn samples_equal_megatron_cores() {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("gpt_samples.json")).unwrap(),
    )
    .unwrap();
    let cache = scratch("golden-cache");
    for (case, g) in golden.as_object().unwrap() {
        let c = &g["config"];
        let (prefixes, weights) = (&c["blend"][0], &c["blend"][1]);
        let blend = Blend {
            prefixes: prefixes
                .as_array()
                .unwrap()
                .iter()
                .map(|p| fixtures().join(p.as_str().unwrap()))
                .collect(),
            weights: weights
                .as_array()
                .map(|w| w.iter().map(|x| x.as_f64().unwrap()).collect()),
        };
        let config = GPTDatasetConfig::new(c["sequence_length"].as_u64().unwrap() as usize)
            .with_random_seed(c["random_seed"].as_u64().unwrap())
            .with_split(c["split"].as_str().unwrap().into())
            .with_add_extra_token_to_sequence(c["add_extra_token_to_sequence"].as_bool().unwrap())
            .with_drop_last_partial_validation_sequence(
                c["drop_last_partial_validation_sequence"]
                    .as_bool()
                    .unwrap(),
            )
            .with_path_to_cache(Some(cache.join(case).display().to_string()));
        let sizes: Vec<usize> = ints(&c["sizes"]).iter().map(|&s| s as usize).collect();
        let built = build_gpt_datasets(
            &blend,
            &config,
            [Some(sizes[0]), Some(sizes[1]), Some(sizes[2])],
        )
        .unwrap();
        for (split, ours) in Split::ALL.iter().zip(&built) {
            let g = &g[split.name()];
            match ours.as_ref().unwrap() {
                MegatronSplit::Single(d) => {
                    check_gpt_split(case, split.name(), d, g, true);
                    let first = &ints(&g["documents"]);
                    assert_eq!(d.documents(), first[0] as usize..first[1] as usize);
                }
                MegatronSplit::Blended(b) => {
                    let at = format!("{case}/{}", split.name());
                    assert_eq!(b.len() as u64, g["len"].as_u64().unwrap(), "{at}");
                    let di = ints(&g["dataset_index"]);
                    let dsi = ints(&g["dataset_sample_index"]);
                    for i in 0..b.len() {
                        assert_eq!(
                            b.source(i),
                            Some((di[i] as usize, dsi[i] as usize)),
                            "{at}: {i}"
                        );
                    }
                    for (k, comp) in g["components"].as_array().unwrap().iter().enumerate() {
                        check_gpt_split(case, split.name(), &b.datasets()[k], comp, false);
                    }
                    for (i, w) in windows(&g["samples"]).iter().enumerate() {
                        assert_eq!(&b.sample(i).unwrap(), w, "{at}: sample {i}");
                    }
                }
            }
        }
    }
}

/// Files megatron-core's `IndexedDatasetBuilder` wrote: every dtype code, a sentence
/// dataset, empty documents and sequences; and our builder writes the same bytes.
#[test]
fn megatron_written_files_read_and_rewrite_byte_for_byte() {
    let dir = scratch("rewrite");
    // The float files hold fractions, which read as Megatron reads them (truncated to
    // int64), so they cannot be written back; every integer code round-trips.
    for float in ["float32", "float64"] {
        let d = IndexedDataset::open(fixtures().join(format!("dtype_{float}"))).unwrap();
        assert_eq!(d.get(0, 0, None).unwrap().len(), d.sequence_length(0));
    }
    let mut names: Vec<String> = [1, 2, 3, 4, 5, 8u8]
        .map(|c| format!("dtype_{}", TokenDType::from_code(c).unwrap().name()))
        .into();
    names.extend(
        [
            "c_sentences",
            "edge_cases",
            "a_text_document",
            "b_text_document",
        ]
        .map(String::from),
    );
    for name in names {
        let theirs = IndexedDataset::open(fixtures().join(&name)).unwrap();
        let mut b = IndexedDatasetBuilder::new(dir.join(&name), theirs.dtype()).unwrap();
        for d in 0..theirs.num_documents() {
            for s in theirs.document(d) {
                b.add_item(&theirs.get(s, 0, None).unwrap()).unwrap();
            }
            b.end_document();
        }
        b.finalize().unwrap();
        for ext in [".idx", ".bin"] {
            let read = |p: PathBuf| std::fs::read(format!("{}{ext}", p.display())).unwrap();
            assert_eq!(
                read(fixtures().join(&name)),
                read(dir.join(&name)),
                "{name}{ext}"
            );
        }
    }
    let edge = IndexedDataset::open(fixtures().join("edge_cases")).unwrap();
    let docs: Vec<_> = (0..edge.num_documents())
        .map(|d| edge.document(d))
        .collect();
    assert_eq!(docs, [0..2, 2..2, 2..3, 3..6]);
    assert_eq!(edge.get(5, 0, None).unwrap(), [7, 8]);
    let c = IndexedDataset::open(fixtures().join("c_sentences")).unwrap();
    assert_eq!((c.num_documents(), c.len()), (40, 115));
}
