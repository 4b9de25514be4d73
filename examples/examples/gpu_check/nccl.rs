//! NCCL as far as one GPU allows: a world of one rank (NCCL refuses two ranks of a
//! communicator on one GPU), its collectives on host buffers against their closed forms,
//! and the device collectives it offers. The tensor-parallel mappings' device path needs a
//! group of two or more (at TP 1 they are identities), so it is `scripts/nccl_check.sh`'s,
//! on two GPUs.

use super::Report;

#[cfg(feature = "cuda")]
pub fn one_rank(report: &mut Report) {
    let libraries = burn_megatron::cuda::cuda_libraries();
    if !(libraries.driver && libraries.nccl) {
        report.skip(
            "nccl one rank",
            format!("needs libcuda and libnccl: {libraries}"),
        );
        return;
    }
    match collectives() {
        Ok(detail) => report.pass("nccl one rank", detail),
        Err(e) => report.fail("nccl one rank", e),
    }
}

#[cfg(feature = "cuda")]
fn collectives() -> Result<String, String> {
    use burn_megatron::comm::nccl::Bootstrap;
    use burn_megatron::comm::nccl::NcclWorld;
    use burn_megatron::comm::{Buffer, CommunicatorExt, ReduceOp, TcpStore, World};
    use std::time::Duration;
    let err = |e: burn_megatron::comm::CommError| e.to_string();
    let store = TcpStore::serve(([127, 0, 0, 1], 0).into()).map_err(|e| e.to_string())?;
    let world =
        NcclWorld::new(0, 0, 1, Bootstrap::Store(store), Duration::from_secs(60)).map_err(err)?;
    let comm = world.new_group("check", vec![0], 0).map_err(err)?;
    let x = vec![1.5f32, -2.0, 3.25];
    let mut sum = x.clone();
    comm.all_reduce_vec(&mut sum, ReduceOp::Sum).map_err(err)?;
    let gathered = comm.all_gather_vec(x.clone()).map_err(err)?;
    let mut buf = Buffer::from(x.clone());
    comm.broadcast(&mut buf, 0).map_err(err)?;
    let scattered = comm
        .reduce_scatter(Buffer::from(x.clone()), ReduceOp::Sum)
        .map_err(err)?;
    let exchanged = comm
        .all_to_all_v(Buffer::from(x.clone()), &[3], &[3])
        .map_err(err)?;
    comm.barrier().map_err(err)?;
    let same = |what: &str, got: &Buffer| match got {
        Buffer::F32(v) if *v == x => Ok(()),
        other => Err(format!("{what}: {other:?}, not {x:?}")),
    };
    if sum != x || gathered != x {
        return Err(format!(
            "all_reduce {sum:?} / all_gather {gathered:?}, not {x:?}"
        ));
    }
    same("broadcast", &buf)?;
    same("reduce_scatter", &scattered)?;
    same("all_to_all_v", &exchanged)?;
    let device = if comm.device_collectives().is_some() {
        "device collectives offered (the mappings' path at TP ≥ 2 needs two GPUs)"
    } else {
        "no device collectives"
    };
    Ok(format!(
        "all_reduce, all_gather, broadcast, reduce_scatter, all_to_all_v, barrier exact; {device}"
    ))
}

#[cfg(not(feature = "cuda"))]
pub fn one_rank(report: &mut Report) {
    report.skip("nccl one rank", "built without the `cuda` feature");
}
