//! Burn's `nn::cache::TensorCache`, whose autoregressive step Burn keeps to its own crate: the
//! drop-in attention, encoder and decoder need it for Burn's `forward_cache` and
//! `forward_autoregressive_inference`.

use burn::tensor::Tensor;

/// A cache of one part's output over the positions decoded so far (Burn's `TensorCache`).
#[derive(Debug, Clone)]
pub struct TensorCache<const D: usize> {
    state: Option<Tensor<D>>,
}

impl<const D: usize> TensorCache<D> {
    /// An empty cache.
    pub fn empty() -> Self {
        Self { state: None }
    }

    /// `func` of `tensor` (`[b, s, d]`), computed for its last position only once the cache
    /// holds the positions before it, which it then joins along `dim`: Burn's contract, each
    /// call a sequence one position longer than the last.
    pub(super) fn forward_autoregressive(
        &mut self,
        tensor: Tensor<3>,
        dim: usize,
        func: impl FnOnce(Tensor<3>) -> Tensor<D>,
    ) -> Tensor<D> {
        let out = match self.state.take() {
            Some(old) => {
                let s = tensor.dims()[1];
                Tensor::cat(vec![old, func(tensor.narrow(1, s - 1, 1))], dim)
            }
            None => func(tensor),
        };
        self.state = Some(out.clone());
        out
    }

    /// `func` of `tensor` the first time, the cached value after (cross-attention's keys and
    /// values over a fixed memory).
    pub(super) fn forward_full(
        &mut self,
        tensor: Tensor<3>,
        func: impl FnOnce(Tensor<3>) -> Tensor<D>,
    ) -> Tensor<D> {
        let out = self.state.take().unwrap_or_else(|| func(tensor));
        self.state = Some(out.clone());
        out
    }
}

/// Through `cache` when there is one (a step of autoregressive inference), else `func` whole.
pub(super) fn cached<const D: usize>(
    cache: Option<&mut TensorCache<D>>,
    tensor: Tensor<3>,
    dim: usize,
    func: impl FnOnce(Tensor<3>) -> Tensor<D>,
) -> Tensor<D> {
    match cache {
        Some(cache) => cache.forward_autoregressive(tensor, dim, func),
        None => func(tensor),
    }
}
