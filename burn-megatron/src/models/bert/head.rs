//! The heads and the pretraining losses: the MLM head over every position (what Hugging
//! Face's `BertForPreTraining` returns) or over the positions the loss counts only (the
//! original BERT's `gather_indexes`: ~15 % of the rows, so ~1/7 of the vocabulary-sized
//! matmuls and cross-entropy), with the same loss and gradients.

use super::{Bert, BertHead, BertOutput};
use crate::context_parallel::ContextParallel;
use crate::tensor_parallel::mappings::copy_to_tensor_model_parallel_region;
use crate::tensor_parallel::{
    TpError, VocabParallelEmbedding, product, vocab_parallel_cross_entropy,
};
use burn::tensor::activation::{gelu, log_softmax};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_megatron_kernels::device::ReadBack;

/// The positions of a batch that the MLM loss counts (its loss mask's non-zero entries),
/// for [`Bert::forward_stage_with_positions`]: the MLM head then runs on those rows only.
///
/// Built on the host from the loss mask, which is input data, so reading it costs no sync
/// with the model's work.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::models::MaskedPositions;
/// let mask = Tensor::<2>::from_floats([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]], &Device::flex());
/// let p = MaskedPositions::from_loss_mask(&mask).unwrap();
/// // Rows of the sequence-major [s · b] flattening: (s 1, b 0), (s 0, b 1), (s 2, b 1).
/// assert_eq!(p.rows(), [1, 2, 5]);
/// ```
#[derive(Debug, Clone)]
pub struct MaskedPositions {
    rows: Vec<i64>,
    /// `[b, s]` of the mask they come from.
    dims: [usize; 2],
    index: Tensor<1, Int>,
}

impl MaskedPositions {
    /// The non-zero entries of `loss_mask` (`[b, s]`), on its device. A mask without any
    /// keeps one row (weighted by its zero), so the head's shapes never go empty and the
    /// loss is 0 as over all positions. Reads the mask back to the host (a device
    /// synchronisation on a GPU): a loader that made the mask on the host passes it to
    /// [`from_host_mask`](Self::from_host_mask) instead. Errors when the mask cannot be read
    /// as floats.
    pub fn from_loss_mask(loss_mask: &Tensor<2>) -> Result<Self, TpError> {
        let values: Vec<f32> = loss_mask
            .clone()
            .read_back()
            .convert::<f32>()
            .try_to_vec()
            .map_err(|e| TpError::Invalid(format!("the loss mask cannot be read: {e:?}")))?;
        Self::from_host_mask(&values, loss_mask.dims(), &loss_mask.device())
    }

    /// The same from the mask's values on the host (`[b, s]` row-major, as the batch's
    /// `loss_mask` tensor holds them), reading nothing back; the index goes to `device`.
    ///
    /// ```
    /// use burn::tensor::Device;
    /// use burn_megatron::models::MaskedPositions;
    /// // Two samples of three tokens; rows are sequence-major (position · b + sample).
    /// let mask = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0];
    /// let p = MaskedPositions::from_host_mask(&mask, [2, 3], &Device::flex()).unwrap();
    /// assert_eq!(p.rows(), &[1, 2, 5]);
    /// assert!(MaskedPositions::from_host_mask(&mask, [2, 2], &Device::flex()).is_err());
    /// ```
    pub fn from_host_mask(
        values: &[f32],
        dims: [usize; 2],
        device: &Device,
    ) -> Result<Self, TpError> {
        let [b, s] = dims;
        if values.len() != b * s {
            return Err(TpError::Invalid(format!(
                "a loss mask of {} values for dims [{b}, {s}]",
                values.len()
            )));
        }
        // Sequence-major, as the encoder lays out its activations ([s, b, h]).
        let mut rows: Vec<i64> = (0..s * b)
            .filter(|&r| values[(r % b) * s + r / b] != 0.0)
            .map(|r| r as i64)
            .collect();
        if rows.is_empty() {
            rows.push(0);
        }
        let index = Tensor::from_data(TensorData::new(rows.clone(), [rows.len()]), device);
        Ok(Self {
            rows,
            dims: [b, s],
            index,
        })
    }

    /// The rows, of the sequence-major `[s · b]` flattening, in increasing order.
    pub fn rows(&self) -> &[i64] {
        &self.rows
    }

    /// The rows as a tensor.
    pub fn index(&self) -> Tensor<1, Int> {
        self.index.clone()
    }
}

impl Bert {
    pub(super) fn heads(
        &self,
        head: &BertHead,
        word_embeddings: &VocabParallelEmbedding,
        x: Tensor<3>,
        positions: Option<&MaskedPositions>,
    ) -> BertOutput {
        let _span = tracing::debug_span!("bert.lm_head").entered();
        let [s, b, h] = x.dims();
        let first = x.clone().narrow(0, 0, 1).reshape([b, h]);
        // The transform is per position: on the counted rows only when they are given.
        let rows = match positions {
            Some(p) => x.reshape([s * b, h]).select(0, p.index()),
            None => x.reshape([s * b, h]),
        };
        let t = head.lm_layernorm.forward(gelu(head.lm_dense.forward(rows)));
        let t = copy_to_tensor_model_parallel_region(t, &self.tp);
        // A 2-d matmul: a broadcast [1, h, V] weight would make backward materialise one
        // [h, V] gradient per sequence position before summing them.
        let w = word_embeddings.weight.val().transpose();
        let logits = product(t, w) + head.lm_bias.val().unsqueeze::<2>();
        let lm_logits = match positions {
            Some(_) => logits.unsqueeze_dim(1),
            None => logits.reshape([s as i32, b as i32, -1]),
        };
        let pooled = head.pooler.forward(first).tanh();
        BertOutput {
            lm_logits,
            binary_logits: head.binary_head.forward(pooled),
            lm_positions: positions.cloned(),
        }
    }

    /// (MLM loss averaged over `loss_mask`, binary-head loss averaged over the batch), in f32.
    /// `lm_labels`, `loss_mask`: `[b, s]`; `binary_labels`: `[b]`. When `output` was computed
    /// at [`MaskedPositions`], they must come from this `loss_mask` (its dims are checked).
    pub fn loss(
        &self,
        output: BertOutput,
        lm_labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
        binary_labels: Tensor<1, Int>,
    ) -> Result<(Tensor<1>, Tensor<1>), TpError> {
        let (lm_sum, tokens, binary_loss) =
            self.loss_parts(output, lm_labels, loss_mask, binary_labels)?;
        Ok((lm_sum / tokens.clamp_min(1.0), binary_loss))
    }

    /// [`loss`](Self::loss) of this rank's share of sequences split over `cp` (outputs of
    /// [`Bert::forward_stage_cp`], `lm_labels` and `loss_mask` split as the tokens): its
    /// masked tokens' losses over the masked-token count of the whole sequences, and the
    /// binary loss on CP rank 0 (which holds `[CLS]`), 0 elsewhere. The CP ranks' losses sum
    /// to the unsplit ones and their gradients to its gradients (reduce them with a sum
    /// over CP; Megatron scales the loss by CP and averages over DP × CP).
    pub fn loss_cp(
        &self,
        output: BertOutput,
        lm_labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
        binary_labels: Tensor<1, Int>,
        cp: &ContextParallel,
    ) -> Result<(Tensor<1>, Tensor<1>), TpError> {
        let (lm_sum, tokens, binary_loss) =
            self.loss_parts(output, lm_labels, loss_mask, binary_labels)?;
        let tokens = cp.sum_tensor(tokens).clamp_min(1.0);
        let cls = if cp.rank() == 0 { 1.0 } else { 0.0 };
        Ok((lm_sum / tokens, binary_loss * cls))
    }

    /// (the MLM losses summed over `loss_mask`, the mask's sum, the binary loss), in f32.
    fn loss_parts(
        &self,
        output: BertOutput,
        lm_labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
        binary_labels: Tensor<1, Int>,
    ) -> Result<(Tensor<1>, Tensor<1>, Tensor<1>), TpError> {
        let _span = tracing::debug_span!("bert.loss").entered();
        let [b, s] = loss_mask.dims();
        if lm_labels.dims() != [b, s] {
            return Err(TpError::Invalid(format!(
                "MLM labels of dims {:?} for a loss mask of dims {:?}",
                lm_labels.dims(),
                [b, s]
            )));
        }
        let [d0, d1, v] = output.lm_logits.dims();
        let mut labels = lm_labels.swap_dims(0, 1).reshape([s * b]);
        // Losses in f32 whatever the model's dtype, as Megatron.
        let mask = loss_mask.swap_dims(0, 1).reshape([s * b]).cast(DType::F32);
        let tokens = mask.clone().sum();
        let mut weights = mask;
        if let Some(p) = &output.lm_positions {
            if p.dims != [b, s] {
                return Err(TpError::Invalid(format!(
                    "logits at the masked positions of a [{}, {}] mask, scored against a mask of dims {:?}",
                    p.dims[0],
                    p.dims[1],
                    [b, s]
                )));
            }
            labels = labels.select(0, p.index());
            weights = weights.select(0, p.index());
        }
        let losses = vocab_parallel_cross_entropy(
            output.lm_logits.reshape([d0 * d1, v]),
            labels,
            0.0,
            &self.tp,
        )?;
        let lm_sum = (losses.cast(DType::F32) * weights).sum();
        let logp = log_softmax(output.binary_logits.cast(DType::F32), 1);
        let binary_loss = logp.gather(1, binary_labels.unsqueeze_dim(1)).neg().mean();
        Ok((lm_sum, tokens, binary_loss))
    }
}
