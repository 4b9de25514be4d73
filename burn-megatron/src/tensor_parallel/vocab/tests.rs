use super::*;

#[test]
fn padding_and_ranges() {
    assert_eq!(padded_vocab_size(100, 128, 2), 256);
    assert_eq!(padded_vocab_size(256, 128, 2), 256);
    assert_eq!(padded_vocab_size(7, 1, 1), 7);
    assert_eq!(vocab_range(12, 2, 4), Ok((6, 9)));
    let e = vocab_range(10, 0, 4).unwrap_err();
    assert!(
        e.contains("10 is not divisible by the tensor-parallel size 4"),
        "{e}"
    );
}
