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

/// `ring_shift` hands each rank its predecessor's tensor, and its backward hands each rank the
/// gradient its successor computed for that tensor (CP 3: a ring, not a swap).
#[test]
fn ring_shift_passes_values_forward_and_gradients_back() {
    use crate::launch::{LaunchOptions, threads};
    use crate::topology::ParallelConfig;
    use burn::tensor::{Tensor, TensorData};
    let layout = ParallelConfig::new(3, 1, 1).with_context_parallel(3);
    let out = threads(&layout, LaunchOptions::default(), |ctx| {
        let cp = ContextParallel::new(ctx.groups.cp.clone(), 6)?;
        let r = cp.rank() as f32;
        let d = &ctx.device;
        let x = Tensor::<1>::from_data(TensorData::new(vec![r + 1.0; 2], [2]), d).require_grad();
        let w = Tensor::<1>::from_data(TensorData::new(vec![10.0 * (r + 1.0), 1.0], [2]), d);
        let y = cp.ring_shift(x.clone());
        let grads = (y.clone() * w).sum().backward();
        let values = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
        let gx = values(
            x.grad(&grads)
                .expect("x reaches the loss through the shift"),
        );
        Ok::<_, TpError>((values(y.inner()), gx))
    })
    .unwrap();
    for (rank, (y, gx)) in out.into_iter().enumerate() {
        let (prev, next) = ((rank + 2) % 3, (rank + 1) % 3);
        assert_eq!(y, [prev as f32 + 1.0; 2], "rank {rank}: values");
        assert_eq!(
            gx,
            [10.0 * (next as f32 + 1.0), 1.0],
            "rank {rank}: gradient"
        );
    }
}
