use super::*;

#[test]
fn a_block_counts_against_its_owner_wherever_it_is_freed() {
    let (counter, block) = std::thread::spawn(|| {
        let counter = Counter::claim();
        let block = vec![7u8; 1 << 20];
        assert_eq!(counter.live(), 1 << 20);
        (counter, block)
    })
    .join()
    .unwrap();
    // Freed on this thread, which took no counter: off the owner's count.
    drop(block);
    assert_eq!(counter.live(), 0);
    assert_eq!(counter.peak(), 1 << 20);
    counter.reset_peak();
    assert_eq!(counter.peak(), 0);
}
