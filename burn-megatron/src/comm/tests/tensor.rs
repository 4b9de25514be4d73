use crate::comm::tensor::*;
use crate::comm::*;
use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions};
use std::time::Duration;

fn run<T: Send + 'static>(
    n: usize,
    f: impl Fn(LocalCommunicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let world = LocalWorld::with_timeout(n, Duration::from_secs(2));
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (world, f) = (world.clone(), f.clone());
            std::thread::spawn(move || f(world.communicator("tp", (0..n).collect(), rank).unwrap()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A [2, 3] tensor whose entries encode (rank, row, col) as 100·rank + 10·row + col.
fn rank_tensor(rank: usize, dtype: DType) -> Tensor<2> {
    let v: Vec<f32> = (0..6)
        .map(|i| (100 * rank + 10 * (i / 3) + i % 3) as f32)
        .collect();
    let t = Tensor::<1>::from_floats(v.as_slice(), &Device::flex()).reshape([2, 3]);
    t.cast(dtype)
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.cast(DType::F32).into_data().try_to_vec().unwrap()
}

#[test]
fn gather_along_each_dim_in_group_order() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let out = run(2, move |comm| {
            let me = comm.group().rank();
            let g0 = all_gather(&comm, rank_tensor(me, dtype), 0).unwrap();
            let g1 = all_gather(&comm, rank_tensor(me, dtype), 1).unwrap();
            (g0.dims(), g0.dtype(), values(g0), g1.dims(), values(g1))
        });
        for (d0, dt, v0, d1, v1) in out {
            assert_eq!(dt, dtype);
            assert_eq!(d0, [4, 3]);
            assert_eq!(
                v0,
                vec![
                    0., 1., 2., 10., 11., 12., 100., 101., 102., 110., 111., 112.
                ]
            );
            assert_eq!(d1, [2, 6]);
            assert_eq!(
                v1,
                vec![
                    0., 1., 2., 100., 101., 102., 10., 11., 12., 110., 111., 112.
                ]
            );
        }
    }
}

#[test]
fn reduce_scatter_and_split_along_last_dim() {
    let out = run(3, |comm| {
        let me = comm.group().rank();
        // [2, 6]: entry (r, c) = c + me on rank `me`.
        let v: Vec<f32> = (0..12).map(|i| (i % 6 + me) as f32).collect();
        let t = Tensor::<1>::from_floats(v.as_slice(), &Device::flex()).reshape([2, 6]);
        let rs = reduce_scatter(&comm, t.clone(), 1, ReduceOp::Sum).unwrap();
        let sp = split(&comm, t, 1).unwrap();
        (me, values(rs), values(sp))
    });
    for (me, rs, sp) in out {
        // Sum over ranks 0..3 of (c + r) = 3c + 3, columns 2·me and 2·me + 1.
        let c = 2 * me;
        let row = [3. * c as f32 + 3., 3. * (c + 1) as f32 + 3.];
        assert_eq!(rs, [row, row].concat());
        let own = [c as f32 + me as f32, (c + 1) as f32 + me as f32];
        assert_eq!(sp, [own, own].concat());
    }
}

#[test]
fn all_reduce_broadcast_and_p2p_keep_int_and_half_dtypes() {
    let out = run(2, |comm| {
        let me = comm.group().rank();
        let dev = Device::flex();
        let opts = TensorCreationOptions::new(dev.clone()).with_dtype(DType::I64);
        let ids = Tensor::<1, Int>::from_data([me as i64 + 1, 10], opts);
        let summed = all_reduce(&comm, ids, ReduceOp::Sum).unwrap();
        let b = broadcast(&comm, rank_tensor(me, DType::BF16), 1).unwrap();
        let peer = 1 - me;
        send(&comm, rank_tensor(me, DType::F16), peer).unwrap();
        let r: Tensor<2> = recv(&comm, [2, 3], DType::F16, &dev, peer).unwrap();
        (
            summed.dtype(),
            summed.into_data().try_to_vec::<i64>().unwrap(),
            b.dtype(),
            values(b),
            r.dtype(),
            values(r),
        )
    });
    for (me, (sdt, s, bdt, b, rdt, r)) in out.into_iter().enumerate() {
        assert_eq!((sdt, s), (DType::I64, vec![3, 20]));
        assert_eq!(bdt, DType::BF16);
        assert_eq!(b, values(rank_tensor(1, DType::F32)));
        assert_eq!(rdt, DType::F16);
        assert_eq!(r, values(rank_tensor(1 - me, DType::F32)));
    }
}

#[test]
fn indivisible_and_out_of_range_dims_are_errors() {
    let out = run(2, |comm| {
        let t = rank_tensor(0, DType::F32); // [2, 3]
        let a = split(&comm, t.clone(), 1).unwrap_err().to_string();
        let b = all_gather(&comm, t, 2).unwrap_err().to_string();
        (a, b)
    });
    for (a, b) in out {
        assert!(
            a.contains("dim 1 of size 3 does not split evenly over 2 ranks"),
            "{a}"
        );
        assert!(b.contains("dim 2 is out of range for a 2-d tensor"), "{b}");
    }
}
