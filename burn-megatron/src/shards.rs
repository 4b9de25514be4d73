//! A box of a global tensor put together from whatever pieces of it overlap the box: how a
//! checkpoint restores a rank's slice from shards saved at another layout, and how a
//! whole-model record is cut into this rank's shard on load.

/// A box `[offset, offset + shape)` of a row-major global tensor, with its bytes.
#[derive(Clone, Copy)]
pub(crate) struct Piece<'a> {
    pub(crate) offset: &'a [usize],
    pub(crate) shape: &'a [usize],
    pub(crate) bytes: &'a [u8],
}

fn volume(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |v, &d| v.checked_mul(d))
}

/// A box as its first index and its end, `[lo, hi)`.
type Bounds = (Vec<usize>, Vec<usize>);

/// The overlap `[lo, hi)` of the box `src` with `[dst_offset, dst_offset + dst_shape)`, if
/// any; an error if a bound overflows.
fn overlap(
    src: &Piece<'_>,
    dst_offset: &[usize],
    dst_shape: &[usize],
) -> Result<Option<Bounds>, String> {
    let n = dst_shape.len();
    let mut lo = Vec::with_capacity(n);
    let mut hi = Vec::with_capacity(n);
    for d in 0..n {
        let end = |o: usize, s: usize| {
            o.checked_add(s)
                .ok_or_else(|| format!("offset {o} + {s} overflows"))
        };
        lo.push(src.offset[d].max(dst_offset[d]));
        hi.push(end(src.offset[d], src.shape[d])?.min(end(dst_offset[d], dst_shape[d])?));
    }
    Ok((0..n).all(|d| lo[d] < hi[d]).then_some((lo, hi)))
}

/// Copies the overlap `[lo, hi)` of `src` into `dst` (both boxes of the same global tensor,
/// `elem` bytes per element; the sizes were checked by [`assemble`]).
fn copy_overlap(
    src: &Piece<'_>,
    (lo, hi): (&[usize], &[usize]),
    dst_offset: &[usize],
    dst_shape: &[usize],
    dst: &mut [u8],
    elem: usize,
) {
    let n = dst_shape.len();
    if n == 0 {
        dst[..elem].copy_from_slice(&src.bytes[..elem]);
        return;
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
        // The next index, last dimension first.
        let mut d = n - 1;
        loop {
            if d == 0 {
                return;
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

/// The box `[offset, offset + shape)` assembled from `pieces` (disjoint boxes of the same
/// tensor, `elem` bytes per element), or why it cannot be: pieces that overlap within the
/// box are refused, so the count of elements copied is the box's only when every element
/// came from a piece.
pub(crate) fn assemble(
    offset: &[usize],
    shape: &[usize],
    pieces: &[Piece<'_>],
    elem: usize,
) -> Result<Vec<u8>, String> {
    let size = |shape: &[usize]| {
        volume(shape)
            .and_then(|v| v.checked_mul(elem))
            .ok_or_else(|| format!("a box of shape {shape:?} overflows"))
    };
    if offset.len() != shape.len() {
        return Err(format!("offset {offset:?} for a box of shape {shape:?}"));
    }
    let mut out = vec![0u8; size(shape)?];
    let mut covered = 0usize;
    let mut taken: Vec<Bounds> = Vec::new();
    for p in pieces {
        if p.offset.len() != shape.len() || p.shape.len() != shape.len() {
            return Err(format!(
                "a shard of rank {} for a tensor of rank {}",
                p.shape.len(),
                shape.len()
            ));
        }
        let bytes = size(p.shape)?;
        if p.bytes.len() != bytes {
            return Err(format!(
                "a shard of shape {:?} holds {} bytes, not {bytes}",
                p.shape,
                p.bytes.len(),
            ));
        }
        let Some((lo, hi)) = overlap(p, offset, shape)? else {
            continue;
        };
        let meets = |(l, h): &Bounds| (0..lo.len()).all(|d| lo[d] < h[d] && l[d] < hi[d]);
        if taken.iter().any(meets) {
            return Err(format!(
                "the shards at offset {:?} and another overlap: a hole could hide behind them",
                p.offset
            ));
        }
        copy_overlap(p, (&lo, &hi), offset, shape, &mut out, elem);
        let run: Vec<usize> = (0..lo.len()).map(|d| hi[d] - lo[d]).collect();
        covered += volume(&run).unwrap_or(0);
        taken.push((lo, hi));
    }
    let want = volume(shape).unwrap_or(0);
    if covered != want {
        return Err(format!(
            "the saved shards cover {covered} of the {want} elements at offset {offset:?}, shape {shape:?}: a shard is missing",
        ));
    }
    Ok(out)
}

/// [`assemble`], with zeros for the part of the box past `extent`, the real shape of a
/// tensor whose shards pad it along one dimension (a padded vocabulary's rows or columns,
/// which no record needs): only the part inside `extent` is read from `pieces`, so pieces
/// that hold padding (saved before it was left out) are cut to the real extent.
pub(crate) fn assemble_padded(
    offset: &[usize],
    shape: &[usize],
    pieces: &[Piece<'_>],
    elem: usize,
    extent: &[usize],
) -> Result<Vec<u8>, String> {
    let ranks_agree = offset.len() == shape.len() && extent.len() == shape.len();
    let past = |d: usize| offset[d].saturating_add(shape[d]) > extent[d];
    let Some(d) = (0..shape.len()).find(|&d| ranks_agree && past(d)) else {
        return assemble(offset, shape, pieces, elem);
    };
    let mut inside = shape.to_vec();
    inside[d] = extent[d].saturating_sub(offset[d]).min(shape[d]);
    let bytes = volume(shape)
        .and_then(|v| v.checked_mul(elem))
        .ok_or_else(|| format!("a box of shape {shape:?} overflows"))?;
    let mut out = vec![0u8; bytes];
    if bytes == 0 || inside[d] == 0 {
        return Ok(out);
    }
    let real = assemble(offset, &inside, pieces, elem)?;
    // Each run of the dimensions before `d` holds `inside[d]` real blocks, then padding.
    let block = volume(&shape[d + 1..]).unwrap_or(0).saturating_mul(elem);
    let (keep, run) = (inside[d] * block, shape[d] * block);
    for (to, from) in out.chunks_mut(run).zip(real.chunks(keep)) {
        to[..keep].copy_from_slice(from);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
