/// The option changed is the purge delay: mimalloc reports it off after the first
/// allocation (which any test has made by now).
#[test]
fn purging_is_off() {
    drop(vec![0u8; 1 << 20]);
    // SAFETY: a plain option read.
    let delay = unsafe { libmimalloc_sys::mi_option_get(super::PURGE_DELAY) };
    assert_eq!(delay, -1);
}
