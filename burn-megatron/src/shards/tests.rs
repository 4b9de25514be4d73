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

/// Two overlapping halves copy 12 + 12 elements of a 4 × 6 box, yet leave a column
/// empty: counting alone would call it covered.
#[test]
fn overlapping_shards_cannot_hide_a_hole() {
    let part: Vec<u8> = vec![1; 12];
    let overlapping = [
        Piece {
            offset: &[0, 0],
            shape: &[4, 3],
            bytes: &part,
        },
        Piece {
            offset: &[0, 2],
            shape: &[4, 3],
            bytes: &part,
        },
    ];
    let e = assemble(&[0, 0], &[4, 6], &overlapping, 1).unwrap_err();
    assert!(e.contains("overlap"), "{e}");
    // Offsets near usize::MAX are an error, not an overflow.
    let far = [Piece {
        offset: &[0, usize::MAX - 1],
        shape: &[4, 3],
        bytes: &part,
    }];
    let e = assemble(&[0, 0], &[4, 6], &far, 1).unwrap_err();
    assert!(e.contains("overflows"), "{e}");
    let e = assemble(&[0, 0], &[usize::MAX, 6], &far, 2).unwrap_err();
    assert!(e.contains("overflows"), "{e}");
}

/// A 5-row tensor padded to 8 rows (a vocabulary at TP 2): the padding reads as zeros,
/// whether the checkpoint left it out or holds it (saved before it was left out, here
/// nonzero so that a read of it shows).
#[test]
fn padding_reads_as_zeros_whether_saved_or_not() {
    let row = |r: usize| [r as u8 * 2 + 1, r as u8 * 2 + 2];
    let rows = |r: std::ops::Range<usize>| -> Vec<u8> { r.flat_map(row).collect() };
    let (real_top, real_tail) = (rows(0..3), rows(3..5));
    let unpadded = [
        Piece {
            offset: &[0, 0],
            shape: &[3, 2],
            bytes: &real_top,
        },
        Piece {
            offset: &[3, 0],
            shape: &[2, 2],
            bytes: &real_tail,
        },
    ];
    let (old_top, old_bottom) = (rows(0..4), rows(4..8));
    let padded = [
        Piece {
            offset: &[0, 0],
            shape: &[4, 2],
            bytes: &old_top,
        },
        Piece {
            offset: &[4, 0],
            shape: &[4, 2],
            bytes: &old_bottom,
        },
    ];
    let want_bottom: Vec<u8> = [row(4).to_vec(), vec![0; 6]].concat();
    for saved in [&unpadded[..], &padded[..]] {
        let top = assemble_padded(&[0, 0], &[4, 2], saved, 1, &[5, 2]).unwrap();
        assert_eq!(top, rows(0..4));
        let bottom = assemble_padded(&[4, 0], &[4, 2], saved, 1, &[5, 2]).unwrap();
        assert_eq!(bottom, want_bottom);
    }
    // Along columns: a [2, 3] tensor padded to [2, 4], read whole.
    let cols: Vec<u8> = (1..=8).collect();
    let wide = [Piece {
        offset: &[0, 0],
        shape: &[2, 4],
        bytes: &cols,
    }];
    let got = assemble_padded(&[0, 0], &[2, 4], &wide, 1, &[2, 3]).unwrap();
    assert_eq!(got, vec![1, 2, 3, 0, 5, 6, 7, 0]);
    // A slice wholly past the real extent is all zeros, and reads nothing.
    let past = assemble_padded(&[6, 0], &[2, 2], &[], 1, &[5, 2]).unwrap();
    assert_eq!(past, vec![0; 4]);
}
