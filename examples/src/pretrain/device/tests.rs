use super::*;

/// Without the feature (or the driver) a GPU device is a clear error naming the flag.
#[test]
fn an_unavailable_device_is_an_error_naming_the_flag() {
    assert!(TrainDevice::Cpu.resolve().is_ok());
    if let Err(e) = TrainDevice::Cuda.resolve() {
        assert!(e.starts_with("--device cuda:"), "{e}");
    }
    if let Err(e) = TrainDevice::Wgpu.resolve() {
        assert!(e.starts_with("--device wgpu:"), "{e}");
    }
}
