//! A deadline for the NCCL calls that wait on the host with none of their own.
//!
//! Queuing work is normally quick, but NCCL connects a communicator's transports inside the
//! call that first needs them (a pair's first send or receive; a collective's first use
//! unless `NCCL_RUNTIME_CONNECT=0`), and that call waits on the host until the peer makes its
//! half. A peer that never does (stuck in another call, or in a deadlock) would hold this
//! rank for ever, before any event exists for [`wait`](super::NcclCommunicator) to bound.
//!
//! A blocking NCCL call cannot be interrupted: `ncclCommAbort` from another thread may free
//! the communicator under it (NCCL supports aborting at any point only for non-blocking
//! communicators). So past the deadline the watchdog ends the process, as PyTorch's NCCL
//! watchdog does, after saying which call on which group did not return; the launcher's
//! peers then fail on their own deadlines.

use crate::comm::{Deadline, lock};
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// What the watchdog does with a call that did not return in time: `(what, timeout)`.
type Expired = fn(&str, Duration);

/// Calls being watched, each with its deadline; one thread sleeps until the earliest.
pub(super) struct Watchdog {
    state: Mutex<State>,
    changed: Condvar,
    expired: Expired,
}

#[derive(Default)]
struct State {
    next_ticket: u64,
    armed: BTreeMap<u64, Armed>,
    watching: bool,
}

struct Armed {
    deadline: Instant,
    what: String,
    timeout: Duration,
}

/// Removes its ticket when the call returns (or unwinds).
struct Disarm<'a> {
    dog: &'a Watchdog,
    ticket: u64,
}

impl Drop for Disarm<'_> {
    fn drop(&mut self) {
        lock(&self.dog.state).armed.remove(&self.ticket);
    }
}

impl Watchdog {
    pub(super) fn new(expired: Expired) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            expired,
        })
    }

    /// Runs `call`, and if it has not returned `timeout` after it started, hands
    /// `what()` to the expiry action. A timeout that is no deadline ([`Deadline`]: too long
    /// for an [`Instant`]) watches nothing.
    pub(super) fn bounded<R>(
        self: &Arc<Self>,
        what: impl FnOnce() -> String,
        timeout: Duration,
        call: impl FnOnce() -> R,
    ) -> R {
        let Deadline(Some(deadline)) = Deadline::from_now(timeout) else {
            return call();
        };
        let ticket = {
            let mut state = lock(&self.state);
            if !state.watching {
                let dog = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("nccl-watchdog".into())
                    .spawn(move || dog.watch());
                if let Err(e) = spawned {
                    eprintln!(
                        "burn-megatron: warning: the NCCL watchdog thread did not start ({e}); \
                         NCCL calls that wait on the host are not bounded"
                    );
                }
                // Tried once: a thread that did not start is said once, not at every call.
                state.watching = true;
            }
            let ticket = state.next_ticket;
            state.next_ticket += 1;
            let what = what();
            state.armed.insert(
                ticket,
                Armed {
                    deadline,
                    what,
                    timeout,
                },
            );
            ticket
        };
        self.changed.notify_all();
        let _disarm = Disarm { dog: self, ticket };
        call()
    }

    fn watch(self: Arc<Self>) {
        let mut state = lock(&self.state);
        loop {
            let earliest = state
                .armed
                .iter()
                .min_by_key(|(_, a)| a.deadline)
                .map(|(&t, a)| (t, a.deadline));
            let Some((ticket, deadline)) = earliest else {
                state = self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            let now = Instant::now();
            if now < deadline {
                state = self
                    .changed
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            let Armed { what, timeout, .. } = state.armed.remove(&ticket).expect("listed above");
            drop(state);
            (self.expired)(&what, timeout);
            state = lock(&self.state);
        }
    }
}

/// This process's watchdog, whose expiry ends the process.
pub(super) fn watchdog() -> &'static Arc<Watchdog> {
    static DOG: OnceLock<Arc<Watchdog>> = OnceLock::new();
    DOG.get_or_init(|| Watchdog::new(end_process))
}

fn end_process(what: &str, timeout: Duration) {
    crate::comm::last_words(format_args!(
        "burn-megatron: {what} did not return within {timeout:?}: a member died or never made \
         the matching call. NCCL cannot be interrupted inside a blocking call, so this \
         process ends (exit status {})",
        super::ABORT_CODE
    ));
    // `_exit`, not `exit`: another thread is inside NCCL, whose exit handlers must not run
    // under it.
    // SAFETY: ends the process at once; nothing runs after it.
    unsafe { libc::_exit(super::ABORT_CODE) }
}

#[cfg(test)]
mod tests {
    use super::Watchdog;
    use std::sync::Mutex;
    use std::time::Duration;

    static EXPIRED: Mutex<Vec<String>> = Mutex::new(Vec::new());

    fn record(what: &str, _: Duration) {
        EXPIRED.lock().unwrap().push(what.to_string());
    }

    #[test]
    fn a_call_past_its_deadline_expires_and_a_prompt_one_does_not() {
        let dog = Watchdog::new(record);
        let quick = dog.bounded(|| "quick".into(), Duration::from_millis(200), || 7);
        assert_eq!(quick, 7);
        dog.bounded(
            || "stuck".into(),
            Duration::from_millis(50),
            || std::thread::sleep(Duration::from_millis(400)),
        );
        // Concurrent calls: only the one that overstays expires, at its own deadline.
        std::thread::scope(|s| {
            s.spawn(|| {
                dog.bounded(
                    || "long but in time".into(),
                    Duration::from_secs(5),
                    || std::thread::sleep(Duration::from_millis(300)),
                )
            });
            s.spawn(|| {
                dog.bounded(
                    || "second stuck".into(),
                    Duration::from_millis(100),
                    || std::thread::sleep(Duration::from_millis(400)),
                )
            });
        });
        // An unbounded timeout watches nothing.
        dog.bounded(|| "forever".into(), Duration::MAX, || ());
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(*EXPIRED.lock().unwrap(), ["stuck", "second stuck"]);
    }
}
