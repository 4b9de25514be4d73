use super::*;

/// Whatever this machine has, asking for a device is an answer, never a panic; on a
/// machine without the driver (CI) it is `NoDriver`.
#[test]
fn a_missing_driver_is_an_error() {
    let libraries = cuda_libraries();
    let got = cuda_device(0);
    if !libraries.driver {
        assert_eq!(got.unwrap_err(), CudaUnavailable::NoDriver);
    }
    let far = cuda_device(1 << 20).expect_err("no machine has a millionth GPU");
    assert!(!far.to_string().is_empty());
}

/// Device memory is an answer too: an error without the driver, else used ≤ total.
#[test]
fn device_memory_is_an_error_or_a_count() {
    match device_memory(0) {
        Ok(m) => assert!(m.used <= m.total && m.total > 0, "{m:?}"),
        Err(e) => {
            if !cuda_libraries().driver {
                assert_eq!(e, CudaUnavailable::NoDriver);
            }
        }
    }
}
