//! `finish` waits for the reduction worker within a bound, whatever its communicator does.

use crate::comm::{Buffer, Communicator, ProcessGroup};
use crate::data_parallel::overlap::*;
use burn::nn::LinearConfig;
use burn::tensor::Device;
use std::time::{Duration, Instant};

/// A member of a group of two whose all-reduce takes far longer than the timeout it
/// reports: a communicator that does not keep its own bound.
#[derive(Debug)]
struct Stuck {
    group: ProcessGroup,
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
        std::thread::sleep(Duration::from_secs(6));
        Ok(())
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
}
