use super::*;

struct Index;

impl RowFill<f32> for Index {
    #[inline(always)]
    fn row(&self, i: usize, out: &mut [f32], scratch: &mut Vec<f32>) {
        scratch.push(0.0);
        for (j, o) in out.iter_mut().enumerate() {
            *o = (i * 1000 + j) as f32;
        }
    }
}

#[test]
fn every_row_is_written_once_in_order() {
    for (rows, len) in [(0, 3), (3, 0), (1, 1), (5000, 7), (3, 40_000)] {
        let out = fill_rows(rows, len, &Index);
        assert_eq!(out.len(), rows * len);
        for (k, &v) in out.iter().enumerate() {
            assert_eq!(v, ((k / len) * 1000 + k % len) as f32);
        }
    }
}
