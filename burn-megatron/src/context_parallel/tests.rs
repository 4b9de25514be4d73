use super::*;

#[test]
fn each_rank_holds_chunk_r_and_its_mirror() {
    assert_eq!(cp_positions(16, 4, 0).unwrap(), [0, 1, 14, 15]);
    assert_eq!(cp_positions(16, 4, 3).unwrap(), [6, 7, 8, 9]);
    let mut all: Vec<usize> = (0..4)
        .flat_map(|r| cp_positions(16, 4, r).unwrap())
        .collect();
    all.sort();
    assert_eq!(all, (0..16).collect::<Vec<_>>());
    let e = cp_positions(12, 4, 0).unwrap_err().to_string();
    assert!(e.contains("12") && e.contains("(8)"), "{e}");
}
