//! A rank's slice of a global tensor from whatever saved shards overlap it: the part of
//! loading that does not care which layout wrote the checkpoint.

/// A box `[offset, offset + shape)` of a row-major global tensor, with its bytes.
pub(super) struct Piece<'a> {
    pub(super) offset: &'a [usize],
    pub(super) shape: &'a [usize],
    pub(super) bytes: &'a [u8],
}

fn volume(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Copies the overlap of `src` into `dst` (both boxes of the same global tensor, `elem`
/// bytes per element); returns the elements copied.
fn copy_overlap(
    src: &Piece<'_>,
    dst_offset: &[usize],
    dst_shape: &[usize],
    dst: &mut [u8],
    elem: usize,
) -> usize {
    let n = dst_shape.len();
    let lo: Vec<usize> = (0..n).map(|d| src.offset[d].max(dst_offset[d])).collect();
    let hi: Vec<usize> = (0..n)
        .map(|d| (src.offset[d] + src.shape[d]).min(dst_offset[d] + dst_shape[d]))
        .collect();
    if (0..n).any(|d| lo[d] >= hi[d]) {
        return 0;
    }
    if n == 0 {
        dst[..elem].copy_from_slice(&src.bytes[..elem]);
        return 1;
    }
    let strides = |shape: &[usize]| -> Vec<usize> {
        let mut s = vec![1; n];
        for d in (0..n - 1).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(src.shape), strides(dst_shape));
    let run = hi[n - 1] - lo[n - 1];
    // Every index of the overlap but the last dimension's, in row-major order.
    let mut at: Vec<usize> = lo[..n - 1].to_vec();
    let mut copied = 0;
    loop {
        let index = |offset: &[usize], strides: &[usize]| -> usize {
            let mut i = 0;
            for d in 0..n - 1 {
                i += (at[d] - offset[d]) * strides[d];
            }
            i + (lo[n - 1] - offset[n - 1])
        };
        let (s, t) = (index(src.offset, &ss) * elem, index(dst_offset, &ds) * elem);
        dst[t..t + run * elem].copy_from_slice(&src.bytes[s..s + run * elem]);
        copied += run;
        // The next index, last dimension first.
        let mut d = n - 1;
        loop {
            if d == 0 {
                return copied;
            }
            d -= 1;
            at[d] += 1;
            if at[d] < hi[d] {
                break;
            }
            at[d] = lo[d];
        }
    }
}

/// The box `[offset, offset + shape)` assembled from `pieces` (non-overlapping boxes of the
/// same tensor, `elem` bytes per element), or why it cannot be.
pub(super) fn assemble(
    offset: &[usize],
    shape: &[usize],
    pieces: &[Piece<'_>],
    elem: usize,
) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; volume(shape) * elem];
    let mut covered = 0;
    for p in pieces {
        if p.offset.len() != shape.len() || p.shape.len() != shape.len() {
            return Err(format!(
                "a shard of rank {} for a tensor of rank {}",
                p.shape.len(),
                shape.len()
            ));
        }
        if p.bytes.len() != volume(p.shape) * elem {
            return Err(format!(
                "a shard of shape {:?} holds {} bytes, not {}",
                p.shape,
                p.bytes.len(),
                volume(p.shape) * elem
            ));
        }
        covered += copy_overlap(p, offset, shape, &mut out, elem);
    }
    if covered != volume(shape) {
        return Err(format!(
            "the saved shards cover {covered} of the {} elements at offset {offset:?}, shape {shape:?}: a shard is missing",
            volume(shape)
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A global 4 × 6 tensor of u8 `r·6 + c`, cut into boxes and put together at other cuts.
    #[test]
    fn any_cut_reassembles_from_any_other() {
        let global: Vec<u8> = (0..24).collect();
        let cut = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>| -> Vec<u8> {
            rows.flat_map(|r| cols.clone().map(move |c| (r * 6 + c) as u8))
                .collect()
        };
        // Saved as two column halves (TP 2 along dim 1).
        let (left, right) = (cut(0..4, 0..3), cut(0..4, 3..6));
        let saved = [
            Piece {
                offset: &[0, 0],
                shape: &[4, 3],
                bytes: &left,
            },
            Piece {
                offset: &[0, 3],
                shape: &[4, 3],
                bytes: &right,
            },
        ];
        assert_eq!(assemble(&[0, 0], &[4, 6], &saved, 1).unwrap(), global);
        // Loaded as three column slices (TP 3), and as a middle block.
        for k in 0..3 {
            let got = assemble(&[0, 2 * k], &[4, 2], &saved, 1).unwrap();
            assert_eq!(got, cut(0..4, 2 * k..2 * k + 2));
        }
        assert_eq!(
            assemble(&[1, 2], &[2, 3], &saved, 1).unwrap(),
            cut(1..3, 2..5)
        );
        // Wider elements copy whole elements.
        let wide: Vec<u8> = global.iter().flat_map(|&b| [b, 0xAA]).collect();
        let one = [Piece {
            offset: &[0, 0],
            shape: &[4, 6],
            bytes: &wide,
        }];
        let got = assemble(&[3, 5], &[1, 1], &one, 2).unwrap();
        assert_eq!(got, vec![23, 0xAA]);
    }

    #[test]
    fn a_missing_or_malformed_shard_is_named() {
        let half: Vec<u8> = vec![0; 12];
        let only_left = [Piece {
            offset: &[0, 0],
            shape: &[4, 3],
            bytes: &half,
        }];
        let e = assemble(&[0, 0], &[4, 6], &only_left, 1).unwrap_err();
        assert!(
            e.contains("cover 12 of the 24") && e.contains("missing"),
            "{e}"
        );
        let short = [Piece {
            offset: &[0, 0],
            shape: &[4, 3],
            bytes: &half[..5],
        }];
        let e = assemble(&[0, 0], &[4, 3], &short, 1).unwrap_err();
        assert!(e.contains("holds 5 bytes, not 12"), "{e}");
        let e = assemble(&[0], &[12], &only_left, 1).unwrap_err();
        assert!(e.contains("rank 2 for a tensor of rank 1"), "{e}");
    }
}
