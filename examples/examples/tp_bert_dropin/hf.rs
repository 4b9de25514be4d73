//! A Hugging Face BERT checkpoint (`config.json` with its weights, as `save_pretrained` writes
//! them: `BertForPreTraining` or `BertForMaskedLM`, whose prediction head the model has) in
//! the user's BERT: the config
//! as a [`BertConfig`], and the [`LoadOptions`] that bring its tensors to the model's paths,
//! Burn's `TransformerEncoder` names among them. The model's code does not change; each rank
//! still reads only its shards.

use super::bert::BertConfig;
use super::parallel;
use burn::tensor::Device;
use burn_megatron::comm::Comm;
use burn_megatron::dropin::{LoadOptions, RecordSource, SaveOptions, save_safetensors};
use burn_megatron::tensor_parallel::TpError;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A Hugging Face BERT checkpoint's directory, its `config.json` read.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: BertConfig,
    /// Whether the prediction head's decoder shares the word embeddings' table (BERT's
    /// default: no `cls.predictions.decoder.weight` saved).
    pub tie_word_embeddings: bool,
}

impl Checkpoint {
    // ANCHOR: options
    /// How the checkpoint's tensors meet the user's BERT: Hugging Face's names renamed to the
    /// model's paths (each encoder layer's to Burn's `TransformerEncoderLayer`: `mha`,
    /// `norm_1`, `pwff`, `norm_2`), its linears read `[out, in]` and its norms' `weight` and
    /// `bias` as `gamma` and `beta` (the PyTorch adapter), the decoder read from the word
    /// embeddings' table where they are tied, and the parts this model has not (the pooler,
    /// the sentence-order head, a saved `position_ids` buffer) skipped.
    pub fn options(&self) -> Result<LoadOptions, TpError> {
        let renames = [
            (r"^bert\.", ""),
            (r"^embeddings\.LayerNorm\.", "embeddings.layer_norm."),
            (r"^encoder\.layer\.", "encoder.layers."),
            (r"\.attention\.self\.(query|key|value)\.", ".mha.$1."),
            (r"\.attention\.output\.dense\.", ".mha.output."),
            (r"\.attention\.output\.LayerNorm\.", ".norm_1."),
            (r"\.intermediate\.dense\.", ".pwff.linear_inner."),
            (r"\.output\.dense\.", ".pwff.linear_outer."),
            (r"\.output\.LayerNorm\.", ".norm_2."),
            (r"^cls\.predictions\.transform\.dense\.", "lm_head.dense."),
            (
                r"^cls\.predictions\.transform\.LayerNorm\.",
                "lm_head.layer_norm.",
            ),
            (
                r"^cls\.predictions\.decoder\.weight$",
                "lm_head.decoder.weight",
            ),
            (r"^cls\.predictions\.bias$", "lm_head.decoder.bias"),
        ];
        let mut options = LoadOptions::default().with_pytorch_adapter(true);
        for (pattern, replacement) in renames {
            options = options.with_key_remap(pattern, replacement)?;
        }
        if self.tie_word_embeddings {
            let table = "embeddings.word_embeddings.weight";
            options = options.with_tied("lm_head.decoder.weight", table);
        }
        // The decoder's bias is `cls.predictions.bias`, which older checkpoints save twice.
        let unused = r"^(pooler|cls\.seq_relationship)\.|^embeddings\.(position|token_type)_ids$|^cls\.predictions\.decoder\.bias$";
        options.with_skipped(unused)
    }
    // ANCHOR_END: options

    /// The way back, for `save_safetensors`: the model's paths to `BertForPreTraining`'s and
    /// `BertForMaskedLM`'s names, linears `[out, in]`, norms' `gamma` and `beta` as `weight`
    /// and `bias`, the decoder left out where it is tied to the word embeddings (as
    /// `transformers` saves it). What this model has not (the pooler, the sentence-order
    /// head) is not written: `BertForMaskedLM` has none either.
    pub fn save_options(&self) -> Result<SaveOptions, TpError> {
        let renames = [
            (r"^embeddings\.layer_norm\.", "bert.embeddings.LayerNorm."),
            (r"^embeddings\.", "bert.embeddings."),
            (r"^encoder\.layers\.", "bert.encoder.layer."),
            (r"\.mha\.(query|key|value)\.", ".attention.self.$1."),
            (r"\.mha\.output\.", ".attention.output.dense."),
            (r"\.norm_1\.", ".attention.output.LayerNorm."),
            (r"\.pwff\.linear_inner\.", ".intermediate.dense."),
            (r"\.pwff\.linear_outer\.", ".output.dense."),
            (r"\.norm_2\.", ".output.LayerNorm."),
            (r"^lm_head\.dense\.", "cls.predictions.transform.dense."),
            (
                r"^lm_head\.layer_norm\.",
                "cls.predictions.transform.LayerNorm.",
            ),
            (r"^lm_head\.decoder\.bias$", "cls.predictions.bias"),
            (
                r"^lm_head\.decoder\.weight$",
                "cls.predictions.decoder.weight",
            ),
        ];
        let mut options = SaveOptions::default().with_pytorch_adapter(true);
        for (pattern, replacement) in renames {
            options = options.with_key_remap(pattern, replacement)?;
        }
        match self.tie_word_embeddings {
            true => options.with_skipped(r"^lm_head\.decoder\.weight$"),
            false => Ok(options),
        }
    }

    /// `model`'s weights as this checkpoint's `model.safetensors` in `dir` (with its
    /// `config.json`, copied), which `transformers` loads. Collective over `tp`.
    pub fn save(
        &self,
        model: &parallel::BertMaskedLm,
        dir: &Path,
        tp: &Comm,
    ) -> Result<(), TpError> {
        let io = |e: std::io::Error| TpError::Invalid(format!("{}: {e}", dir.display()));
        let config = self.dir.join("config.json");
        // Every rank goes on to the collective write, whatever the copy did.
        let copied = match tp.group().rank() {
            0 => std::fs::create_dir_all(dir)
                .and_then(|_| std::fs::copy(config, dir.join("config.json"))),
            _ => Ok(0),
        };
        let options = self.save_options()?;
        let saved = save_safetensors(model, dir.join("model.safetensors"), tp, &options);
        copied.map_err(io)?;
        saved
    }

    /// The model, split over `tp` as `parallel::BertMaskedLm::load` splits it, with the
    /// checkpoint's weights.
    pub fn load(&self, tp: &Comm, device: &Device) -> Result<parallel::BertMaskedLm, TpError> {
        let weights = RecordSource::from_hugging_face(&self.dir)?;
        let options = self.options()?;
        parallel::BertMaskedLm::load(&self.config, weights.path(), &options, tp, device)
    }

    /// `dir/config.json` read. What this BERT cannot hold is an error naming the setting:
    /// another model type, activation (the exact GeLU's names are `gelu` and `gelu_python`)
    /// or position embedding, a decoder, cross-attention.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let path = dir.join("config.json");
        let error = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
        let text = std::fs::read_to_string(&path).map_err(|e| error(&e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| error(&e))?;
        let at = |key: &str| format!("{}: `{key}`", path.display());
        let count = |key: &str| {
            let n = json[key].as_u64().map(|n| n as usize);
            n.ok_or_else(|| at(key) + " is not a count")
        };
        let settings = [
            ("model_type", &["bert"][..]),
            ("hidden_act", &["gelu", "gelu_python"]),
            ("position_embedding_type", &["absolute"]),
        ];
        for (key, want) in settings {
            if json[key].as_str().is_some_and(|v| !want.contains(&v)) {
                return Err(at(key) + &format!(" is not {}", want.join(" or ")));
            }
        }
        for key in ["is_decoder", "add_cross_attention"] {
            if json[key].as_bool() == Some(true) {
                return Err(at(key) + " is true: this BERT is an encoder");
            }
        }
        let config = BertConfig::new(
            count("vocab_size")?,
            count("hidden_size")?,
            count("num_hidden_layers")?,
            count("num_attention_heads")?,
            count("intermediate_size")?,
            count("max_position_embeddings")?,
            count("type_vocab_size")?,
        );
        let eps = json["layer_norm_eps"]
            .as_f64()
            .unwrap_or(config.layer_norm_eps);
        Ok(Self {
            dir: dir.to_path_buf(),
            config: config.with_layer_norm_eps(eps),
            tie_word_embeddings: json["tie_word_embeddings"].as_bool().unwrap_or(true),
        })
    }
}
