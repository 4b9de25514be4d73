//! The order in which a member opens its point-to-point pairs (see
//! [`Communicator::connect`](crate::comm::Communicator::connect)).

/// `peers` (group indices, `me` and repeats dropped) in the order `me` opens its pairs with
/// them: the group's one order of pairs, (lower, higher) ascending. Each member's order is
/// part of that one order, so the lowest pair any member waits on has both of its members
/// waiting on it, and opens; no cycle of waits can form.
pub(super) fn pair_order(me: usize, peers: &[usize]) -> Vec<usize> {
    let mut peers: Vec<usize> = peers.iter().copied().filter(|&p| p != me).collect();
    peers.sort_by_key(|&p| (me.min(p), me.max(p)));
    peers.dedup();
    peers
}

#[cfg(test)]
mod tests {
    use super::pair_order;
    use std::collections::HashMap;
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    /// Opening a pair as NCCL does: both members must arrive. `true` if the pair opened
    /// within the bound.
    #[derive(Default)]
    struct Rendezvous(Mutex<usize>, Condvar);

    impl Rendezvous {
        fn open(&self) -> bool {
            let mut arrived = self.0.lock().unwrap();
            *arrived += 1;
            self.1.notify_all();
            let (arrived, timeout) = self
                .1
                .wait_timeout_while(arrived, Duration::from_millis(300), |a| *a < 2)
                .unwrap();
            !timeout.timed_out() || *arrived >= 2
        }
    }

    /// Every member of a ring of `n` opens the pairs with its neighbours in the order
    /// `order` gives; whether every pair opened.
    fn ring_opens(n: usize, order: impl Fn(usize, &[usize]) -> Vec<usize> + Sync) -> bool {
        let pairs: HashMap<(usize, usize), Rendezvous> = (0..n)
            .map(|r| {
                let next = (r + 1) % n;
                ((r.min(next), r.max(next)), Rendezvous::default())
            })
            .collect();
        let pairs = Arc::new(pairs);
        std::thread::scope(|s| {
            let members: Vec<_> = (0..n)
                .map(|me| {
                    let (pairs, order) = (pairs.clone(), &order);
                    s.spawn(move || {
                        let neighbours = [(me + 1) % n, (me + n - 1) % n];
                        order(me, &neighbours)
                            .into_iter()
                            .all(|p| pairs[&(me.min(p), me.max(p))].open())
                    })
                })
                .collect();
            members.into_iter().all(|m| m.join().unwrap())
        })
    }

    #[test]
    fn a_ring_opens_its_pairs_in_the_group_order_at_every_size() {
        for n in 2..=6 {
            assert!(ring_opens(n, pair_order), "ring of {n}");
        }
        // The ring's own order (next first), which the first sends would follow, waits on
        // itself from three members on: what `connect` is for.
        assert!(ring_opens(2, |me, p| vec![p[0]]
            .into_iter()
            .filter(|&x| x != me)
            .collect()));
        assert!(!ring_opens(3, |_, p| p.to_vec()));
    }

    #[test]
    fn the_order_drops_the_member_itself_and_repeats() {
        assert_eq!(pair_order(2, &[3, 1, 2, 3]), vec![1, 3]);
        assert_eq!(pair_order(0, &[1, 1]), vec![1]);
    }
}
