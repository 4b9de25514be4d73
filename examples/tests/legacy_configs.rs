//! Model configs that checkpoints saved before the configs were composed (a flat list of every
//! field; `make.sh` beside the fixtures ran the examples of that commit) load as the config
//! the same flags give now, so those checkpoints still convert and resume.

use crate::common::{args, gpt_args, tmp};
use burn::config::config_to_json;
use burn_megatron::models::{BertConfig, GptConfig};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/legacy_configs")
        .join(name)
}

/// The flags `make.sh` saved each GPT fixture with (beside `common::gpt_argv`'s).
const GPT_FLAGS: [(&str, &[&str]); 2] = [
    (
        "gpt_llama",
        &[
            "--sequence-parallel",
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "core_attn",
            "mlp",
            "--hidden-dropout",
            "0.05",
            "--attention-dropout",
            "0.07",
            "--init-method-std",
            "0.01",
            "--seed",
            "77",
            "--norm-epsilon",
            "1e-6",
            "--rotary-base",
            "5000",
            "--kv-channels",
            "16",
        ],
    ),
    (
        "gpt2_moe",
        &[
            "--position-embedding-type",
            "learned_absolute",
            "--normalization",
            "LayerNorm",
            "--openai-gelu",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-layer-freq",
            "2",
            "--gradient-accumulation-fusion",
        ],
    ),
];

/// The flags of the BERT fixture (beside `common::argv`'s).
const BERT_FLAGS: &[&str] = &[
    "--hidden-dropout",
    "0.05",
    "--attention-dropout",
    "0.07",
    "--init-method-std",
    "0.01",
    "--seed",
    "77",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
];

#[test]
fn gpt_configs_saved_flat_load_as_the_composed_config_of_their_flags() {
    let dir = tmp("legacy-gpt");
    for (name, flags) in GPT_FLAGS {
        let old = GptConfig::load_saved(&fixture(&format!("{name}.json"))).unwrap();
        let vocab = old.vocab_size();
        let now = gpt_args(flags, &dir).model_config(vocab).unwrap();
        assert_eq!(config_to_json(&old), config_to_json(&now), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bert_config_saved_flat_loads_as_the_composed_config_of_its_flags() {
    let dir = tmp("legacy-bert");
    let old = BertConfig::load_saved(&fixture("bert.json")).unwrap();
    // The fixture's vocabulary: the built-in corpus's, padded by 128 × TP 2.
    let vocab = old.padded_vocab_size;
    let now = args(BERT_FLAGS, &dir).model_config(vocab);
    assert_eq!(config_to_json(&old), config_to_json(&now));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_composed_config_round_trips_and_a_broken_file_is_an_error() {
    let dir = tmp("legacy-roundtrip");
    let config = gpt_args(GPT_FLAGS[0].1, &dir).model_config(400).unwrap();
    let path = dir.join("gpt_config.json");
    burn::config::Config::save(&config, &path).unwrap();
    let back = GptConfig::load_saved(&path).unwrap();
    assert_eq!(config_to_json(&back), config_to_json(&config));
    std::fs::write(&path, "{\"num_layers\": \"two\"}").unwrap();
    let e = GptConfig::load_saved(&path).unwrap_err().to_string();
    assert!(e.contains("gpt_config.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
