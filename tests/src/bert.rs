//! A fixed BERT batch for the parity tests: sample `g` is a pure function of `g` and its
//! length, so every layout and every rank builds the same rows.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_megatron::models::{
    BertConfig, ParallelAttentionConfig, ParallelMlpConfig, TransformerLayerConfig,
};

/// A layer of width `hidden` with `heads` heads and an MLP of `ffn`, every other switch at
/// its default (post-norm, GeLU, biases, dropout 0.1).
pub fn layer(hidden: usize, heads: usize, ffn: usize) -> TransformerLayerConfig {
    TransformerLayerConfig::new(
        hidden,
        ParallelAttentionConfig::new(heads),
        ParallelMlpConfig::new(ffn),
    )
}

/// A BERT of `layers` such layers, `seq` positions and a padded vocabulary of `vocab`, seed
/// 1234.
pub fn bert(
    layers: usize,
    (hidden, heads, ffn): (usize, usize, usize),
    seq: usize,
    vocab: usize,
) -> BertConfig {
    BertConfig::new(
        layers,
        seq,
        vocab,
        layer(hidden, heads, ffn).with_seed(1234),
    )
}

/// Rows of BERT inputs and targets, `[b, s]` (`sop`: `[b]`).
pub struct BertRows {
    /// Token ids.
    pub ids: Tensor<2, Int>,
    /// Segment ids: the second half of each row is segment 1.
    pub types: Tensor<2, Int>,
    /// True at padding (the last two positions of odd samples).
    pub padding: Tensor<2, Bool>,
    /// MLM labels.
    pub labels: Tensor<2, Int>,
    /// 1 where a label is predicted.
    pub mask: Tensor<2>,
    /// Sentence-order labels.
    pub sop: Tensor<1, Int>,
}

/// Sample `g` with `s` tokens.
pub fn bert_sample(g: usize, s: usize, device: &Device) -> BertRows {
    let ints = |f: &dyn Fn(usize) -> i64| {
        Tensor::<2, Int>::from_data(TensorData::new((0..s).map(f).collect(), [1, s]), device)
    };
    let pad = |j: usize| g % 2 == 1 && j >= s - 2;
    let floats = |f: &dyn Fn(usize) -> bool| {
        let v: Vec<f32> = (0..s).map(|j| f32::from(u8::from(f(j)))).collect();
        Tensor::<2>::from_data(TensorData::new(v, [1, s]), device)
    };
    BertRows {
        ids: ints(&|j| ((g * 13 + j * 7) % 60) as i64),
        types: ints(&|j| i64::from(j >= s / 2)),
        padding: floats(&pad).equal_elem(1.0),
        labels: ints(&|j| ((g * 5 + j * 11 + 3) % 60) as i64),
        mask: floats(&|j| (g + j).is_multiple_of(3) && !pad(j)),
        sop: Tensor::from_data(TensorData::new(vec![(g % 2) as i64], [1]), device),
    }
}

/// Samples `start..start + n`, all of `s` tokens, stacked.
pub fn bert_rows(start: usize, n: usize, s: usize, device: &Device) -> BertRows {
    let rows: Vec<BertRows> = (start..start + n)
        .map(|g| bert_sample(g, s, device))
        .collect();
    let cat2 =
        |f: &dyn Fn(&BertRows) -> Tensor<2, Int>| Tensor::cat(rows.iter().map(f).collect(), 0);
    BertRows {
        ids: cat2(&|r| r.ids.clone()),
        types: cat2(&|r| r.types.clone()),
        padding: Tensor::cat(rows.iter().map(|r| r.padding.clone()).collect(), 0),
        labels: cat2(&|r| r.labels.clone()),
        mask: Tensor::cat(rows.iter().map(|r| r.mask.clone()).collect(), 0),
        sop: Tensor::cat(rows.iter().map(|r| r.sop.clone()).collect(), 0),
    }
}
