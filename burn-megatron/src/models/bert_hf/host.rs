//! Host-side matrices: the row-major f32 form HF tensors are reshaped, permuted and sharded
//! in.

use super::HfError;
use super::entries::Split;
use burn::module::Param;
use burn::tensor::{Tensor, TensorCreationOptions, TensorData};

/// A row-major host matrix.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Host {
    pub(super) values: Vec<f32>,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl Host {
    pub(super) fn transpose(&self) -> Host {
        let mut values = vec![0.0; self.values.len()];
        for r in 0..self.rows {
            for c in 0..self.cols {
                values[c * self.rows + r] = self.values[r * self.cols + c];
            }
        }
        Host {
            values,
            rows: self.cols,
            cols: self.rows,
        }
    }

    pub(super) fn rows(&self, range: std::ops::Range<usize>) -> Host {
        Host {
            values: self.values[range.start * self.cols..range.end * self.cols].to_vec(),
            rows: range.len(),
            cols: self.cols,
        }
    }

    pub(super) fn cols(&self, range: std::ops::Range<usize>) -> Host {
        self.transpose().rows(range).transpose()
    }
}

/// HF's `[3h(, h)]` query/key/value stacked as `[q; k; v]` ⇄ the per-head fused order
/// `[head][q, k, v][head_dim]` (rows).
pub(super) fn qkv_permutation(heads: usize, hidden: usize) -> Vec<usize> {
    let hn = hidden / heads;
    let mut perm = Vec::with_capacity(3 * hidden);
    for head in 0..heads {
        for j in 0..3 {
            perm.extend((0..hn).map(|d| j * hidden + head * hn + d));
        }
    }
    perm
}

pub(super) fn permute_rows(m: &Host, perm: &[usize], inverse: bool) -> Host {
    let mut values = vec![0.0; m.values.len()];
    for (dst, &src) in perm.iter().enumerate() {
        let (to, from) = if inverse { (src, dst) } else { (dst, src) };
        values[to * m.cols..(to + 1) * m.cols]
            .copy_from_slice(&m.values[from * m.cols..(from + 1) * m.cols]);
    }
    Host {
        values,
        ..m.clone()
    }
}

pub(super) fn host_of(name: &str, data: &TensorData) -> Result<Host, HfError> {
    let values: Vec<f32> = data.iter::<f32>().collect();
    match data.shape().len() {
        1 => Ok(Host {
            rows: values.len(),
            cols: 1,
            values,
        }),
        2 => Ok(Host {
            rows: data.shape()[0],
            cols: data.shape()[1],
            values,
        }),
        n => Err(HfError::Checkpoint(format!(
            "{name}: expected a 1-d or 2-d tensor, found {n}-d"
        ))),
    }
}

pub(super) fn set_param<const D: usize>(
    p: &mut Param<Tensor<D>>,
    values: Vec<f32>,
    shape: [usize; D],
) {
    let old = p.val();
    let options = TensorCreationOptions::new(old.device()).with_dtype(old.dtype());
    let t = Tensor::<D>::from_data(TensorData::new(values, shape), options)
        .set_require_grad(old.is_require_grad());
    *p = p.clone().map(|_| t);
}

pub(super) fn shard(full: &Host, split: Split, rank: usize, size: usize) -> Host {
    match split {
        Split::Dup => full.clone(),
        Split::Out | Split::Vocab | Split::Qkv => {
            let n = full.rows / size;
            full.rows(rank * n..(rank + 1) * n)
        }
        Split::In => {
            let n = full.cols / size;
            full.cols(rank * n..(rank + 1) * n)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_permutation_interleaves_heads_and_inverts() {
        // 2 heads of size 2: rows [q0 q1 | q2 q3], etc.
        assert_eq!(
            qkv_permutation(2, 4),
            vec![0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
        );
        let m = Host {
            values: (0..24).map(|v| v as f32).collect(),
            rows: 12,
            cols: 2,
        };
        let p = qkv_permutation(2, 4);
        assert_eq!(permute_rows(&permute_rows(&m, &p, false), &p, true), m);
        assert_eq!(permute_rows(&m, &p, false).values[4..6], [8.0, 9.0]);
    }

    #[test]
    fn host_matrix_slicing() {
        let m = Host {
            values: (0..6).map(|v| v as f32).collect(),
            rows: 2,
            cols: 3,
        };
        assert_eq!(m.transpose().values, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(m.cols(1..3).values, vec![1.0, 2.0, 4.0, 5.0]);
        assert_eq!(m.rows(1..2).values, vec![3.0, 4.0, 5.0]);
    }
}
