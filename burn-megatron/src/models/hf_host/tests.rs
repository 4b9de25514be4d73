use super::*;

#[test]
fn qkv_permutation_interleaves_heads_and_inverts() {
    // 2 heads of size 2: rows [q0 q1 | q2 q3], etc.
    assert_eq!(
        qkv_permutation(2, 2, 2),
        vec![0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    );
    let m = Host {
        values: (0..24).map(|v| v as f32).collect(),
        rows: 12,
        cols: 2,
    };
    let p = qkv_permutation(2, 2, 2);
    assert_eq!(permute_rows(&permute_rows(&m, &p, false), &p, true), m);
    assert_eq!(permute_rows(&m, &p, false).values[4..6], [8.0, 9.0]);
}

#[test]
fn grouped_qkv_keeps_each_groups_heads_then_its_key_and_value() {
    // 4 heads in 2 groups, head dim 1: q rows 0-3, k rows 4-5, v rows 6-7.
    assert_eq!(qkv_permutation(4, 2, 1), vec![0, 1, 4, 6, 2, 3, 5, 7]);
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
