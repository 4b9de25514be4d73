//! Every parameter of a `Bert` with its Hugging Face name and how it is split across
//! tensor-parallel ranks.

use super::super::hf_host::HfError;
use super::super::{Bert, LayerNormPosition, Norm};
use burn::module::Param;
use burn::tensor::Tensor;

/// How a parameter is laid out relative to its HF tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Split {
    /// Duplicated on every rank.
    Dup,
    /// HF dim 0 (output features) split: column-parallel weights and biases.
    Out,
    /// HF dim 1 (input features) split: row-parallel weights.
    In,
    /// Vocabulary rows, padded.
    Vocab,
    /// The fused per-head QKV from HF's query, key and value.
    Qkv,
}

pub(super) enum Slot<'a> {
    Two(&'a mut Param<Tensor<2>>),
    One(&'a mut Param<Tensor<1>>),
}

pub(super) struct Entry<'a> {
    pub(super) name: String,
    pub(super) split: Split,
    /// An `[out, in]` HF linear weight, stored transposed in Burn.
    pub(super) linear: bool,
    pub(super) slot: Slot<'a>,
}

fn layernorm<'a>(
    out: &mut Vec<Entry<'a>>,
    prefix: &str,
    norm: &'a mut Norm,
) -> Result<(), HfError> {
    let Norm::LayerNorm(ln) = norm else {
        return Err(HfError::Unsupported(
            "RMSNorm layers have no BERT equivalent".into(),
        ));
    };
    out.push(entry(
        format!("{prefix}.weight"),
        Split::Dup,
        false,
        Slot::One(&mut ln.gamma),
    ));
    if let Some(beta) = ln.beta.as_mut() {
        out.push(entry(
            format!("{prefix}.bias"),
            Split::Dup,
            false,
            Slot::One(beta),
        ));
    }
    Ok(())
}

fn entry(name: String, split: Split, linear: bool, slot: Slot<'_>) -> Entry<'_> {
    Entry {
        name,
        split,
        linear,
        slot,
    }
}

fn linear<'a>(
    out: &mut Vec<Entry<'a>>,
    prefix: &str,
    split: Split,
    weight: &'a mut Param<Tensor<2>>,
    bias: Option<&'a mut Param<Tensor<1>>>,
) {
    out.push(entry(
        format!("{prefix}.weight"),
        split,
        true,
        Slot::Two(weight),
    ));
    if let Some(b) = bias {
        let bias_split = if split == Split::In {
            Split::Dup
        } else {
            split
        };
        out.push(entry(
            format!("{prefix}.bias"),
            bias_split,
            false,
            Slot::One(b),
        ));
    }
}

/// Every parameter of `model` with its HF name and layout.
pub(super) fn entries(model: &mut Bert) -> Result<Vec<Entry<'_>>, HfError> {
    let mut out = Vec::new();
    let e = "bert.embeddings";
    let Bert {
        embeddings: Some(emb),
        layers,
        head: Some(m),
        ..
    } = model
    else {
        return Err(HfError::Unsupported(
            "a pipeline chunk: Hugging Face BERT import and export need the whole model".into(),
        ));
    };
    out.push(entry(
        format!("{e}.word_embeddings.weight"),
        Split::Vocab,
        false,
        Slot::Two(&mut emb.word_embeddings.weight),
    ));
    out.push(entry(
        format!("{e}.position_embeddings.weight"),
        Split::Dup,
        false,
        Slot::Two(&mut emb.position_embeddings.weight),
    ));
    out.push(entry(
        format!("{e}.token_type_embeddings.weight"),
        Split::Dup,
        false,
        Slot::Two(&mut emb.tokentype_embeddings.weight),
    ));
    out.push(entry(
        format!("{e}.LayerNorm.weight"),
        Split::Dup,
        false,
        Slot::One(&mut emb.embedding_layernorm.gamma),
    ));
    if let Some(beta) = emb.embedding_layernorm.beta.as_mut() {
        out.push(entry(
            format!("{e}.LayerNorm.bias"),
            Split::Dup,
            false,
            Slot::One(beta),
        ));
    }
    for (i, layer) in layers.iter_mut().enumerate() {
        if layer.layernorm_position() != LayerNormPosition::Post {
            return Err(HfError::Unsupported(
                "pre-LayerNorm layers (HF BERT is post-LN)".into(),
            ));
        }
        let p = format!("bert.encoder.layer.{i}");
        let qkv = &mut layer.attention.query_key_value;
        out.push(entry(
            format!("{p}.attention.self.qkv.weight"),
            Split::Qkv,
            true,
            Slot::Two(&mut qkv.weight),
        ));
        if let Some(b) = qkv.bias.as_mut() {
            out.push(entry(
                format!("{p}.attention.self.qkv.bias"),
                Split::Qkv,
                false,
                Slot::One(b),
            ));
        }
        let dense = &mut layer.attention.dense;
        linear(
            &mut out,
            &format!("{p}.attention.output.dense"),
            Split::In,
            &mut dense.weight,
            dense.bias.as_mut(),
        );
        layernorm(
            &mut out,
            &format!("{p}.attention.output.LayerNorm"),
            &mut layer.input_layernorm,
        )?;
        let mlp = layer
            .mlp
            .as_mut()
            .expect("BERT layers are dense: BertConfig sets no experts");
        let up = &mut mlp.dense_h_to_4h;
        linear(
            &mut out,
            &format!("{p}.intermediate.dense"),
            Split::Out,
            &mut up.weight,
            up.bias.as_mut(),
        );
        let down = &mut mlp.dense_4h_to_h;
        linear(
            &mut out,
            &format!("{p}.output.dense"),
            Split::In,
            &mut down.weight,
            down.bias.as_mut(),
        );
        layernorm(
            &mut out,
            &format!("{p}.output.LayerNorm"),
            &mut layer.post_attention_layernorm,
        )?;
    }
    linear(
        &mut out,
        "bert.pooler.dense",
        Split::Dup,
        &mut m.pooler.weight,
        m.pooler.bias.as_mut(),
    );
    linear(
        &mut out,
        "cls.predictions.transform.dense",
        Split::Dup,
        &mut m.lm_dense.weight,
        m.lm_dense.bias.as_mut(),
    );
    out.push(entry(
        "cls.predictions.transform.LayerNorm.weight".into(),
        Split::Dup,
        false,
        Slot::One(&mut m.lm_layernorm.gamma),
    ));
    if let Some(beta) = m.lm_layernorm.beta.as_mut() {
        out.push(entry(
            "cls.predictions.transform.LayerNorm.bias".into(),
            Split::Dup,
            false,
            Slot::One(beta),
        ));
    }
    out.push(entry(
        "cls.predictions.bias".into(),
        Split::Vocab,
        false,
        Slot::One(&mut m.lm_bias),
    ));
    linear(
        &mut out,
        "cls.seq_relationship",
        Split::Dup,
        &mut m.binary_head.weight,
        m.binary_head.bias.as_mut(),
    );
    Ok(out)
}
