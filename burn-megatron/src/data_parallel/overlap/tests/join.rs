//! `finish` waits for the reduction worker within a bound, whatever its communicator does.

use crate::comm::{Buffer, Communicator, ProcessGroup};
use crate::data_parallel::overlap::*;
use burn::nn::LinearConfig;
use burn::tensor::{Device, Tensor};
use std::time::{Duration, Instant};

/// A member of a group of two whose all-reduce takes far longer than the timeout it
/// reports (a communicator that does not keep its own bound), or, not `stuck`, fails its
/// first all-reduce and leaves the others' buffers as they are (a peer of zeros, summed).
#[derive(Debug)]
struct Stuck {
    group: ProcessGroup,
    stuck: bool,
    calls: std::sync::atomic::AtomicUsize,
}

impl Stuck {
    fn refuse(&self, op: &'static str) -> Result<(), CommError> {
        Err(CommError::InvalidArgument {
            group: self.group.to_string(),
            op,
            reason: "not used by this test".into(),
        })
    }
}

impl Communicator for Stuck {
    fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(200)
    }

    fn all_reduce(&self, _: &mut Buffer, _: ReduceOp) -> Result<(), CommError> {
        if self.stuck {
            std::thread::sleep(Duration::from_secs(6));
            return Ok(());
        }
        match self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => self.refuse("all_reduce"),
            _ => Ok(()),
        }
    }

    fn all_gather(&self, _: Buffer) -> Result<Buffer, CommError> {
        self.refuse("all_gather")
            .map(|()| Buffer::from(Vec::<f32>::new()))
    }

    fn reduce_scatter(&self, _: Buffer, _: ReduceOp) -> Result<Buffer, CommError> {
        self.refuse("reduce_scatter")
            .map(|()| Buffer::from(Vec::<f32>::new()))
    }

    fn broadcast(&self, _: &mut Buffer, _: usize) -> Result<(), CommError> {
        self.refuse("broadcast")
    }

    fn send(&self, _: Buffer, _: usize) -> Result<(), CommError> {
        self.refuse("send")
    }

    fn recv(&self, _: &mut Buffer, _: usize) -> Result<(), CommError> {
        self.refuse("recv")
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.refuse("barrier")
    }
}

#[test]
fn finish_gives_up_on_a_worker_that_makes_no_progress() {
    let model = LinearConfig::new(4, 4).init(&Device::flex().autodiff());
    let dp: Comm = Arc::new(Stuck {
        group: ProcessGroup::new("dp", vec![0, 1], 0).unwrap(),
        stuck: true,
        calls: Default::default(),
    });
    let reducer = OverlapReducer::new(&model, &dp, &DataParallelConfig::default());
    drop(reducer.activate(true));
    let start = Instant::now();
    let err = reducer.finish(&mut GradientsParams::new()).unwrap_err();
    let took = start.elapsed();
    assert!(
        err.to_string().contains("finished no bucket within 200ms"),
        "{err}"
    );
    assert!(took < Duration::from_secs(3), "finish took {took:?}");
    // The worker is still inside its collective: later steps are refused, saying why.
    drop(reducer.activate(true));
    let err = reducer.finish(&mut GradientsParams::new()).unwrap_err();
    assert!(err.to_string().contains("left behind"), "{err}");
}

/// A step whose reduction failed is an error that leaves the gradients as they were, and the
/// next step runs whole (the per-step state is reset however the step ended).
#[test]
fn a_failed_reduction_leaves_the_next_step_whole() {
    let device = Device::flex().autodiff();
    let model = LinearConfig::new(4, 4).init(&device);
    let dp: Comm = Arc::new(Stuck {
        group: ProcessGroup::new("dp", vec![0, 1], 0).unwrap(),
        stuck: false,
        calls: Default::default(),
    });
    let config = DataParallelConfig {
        average: false,
        ..DataParallelConfig::default()
    };
    let reducer = OverlapReducer::new(&model, &dp, &config);
    let weight_grad = |grads: &GradientsParams| {
        let g: Tensor<2> = grads.get(model.weight.id).expect("a weight gradient");
        g.into_data().iter::<f32>().collect::<Vec<f32>>()
    };
    let step = || {
        let _active = reducer.activate(true);
        let x = Tensor::<2>::ones([2, 4], &device);
        GradientsParams::from_grads(model.forward(x).sum().backward(), &model)
    };
    let mut grads = step();
    let local = weight_grad(&grads);
    let err = reducer.finish(&mut grads).unwrap_err();
    assert!(err.to_string().contains("not used by this test"), "{err}");
    assert_eq!(weight_grad(&grads), local, "left as they were");
    let mut grads = step();
    assert_eq!(reducer.finish(&mut grads).unwrap(), 1, "one bucket reduced");
    assert_eq!(weight_grad(&grads), local, "a peer of zeros, summed");
}
