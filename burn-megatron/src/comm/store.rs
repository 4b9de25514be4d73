//! A small key-value store over TCP, for the one thing processes must agree on before any
//! communicator exists: the NCCL unique id of each group.
//!
//! Rank 0 serves it (a thread of its process); every process, rank 0 included, is a client.
//! A value is set once and read by any number of ranks; a read waits until the key is set,
//! up to a deadline, so the order in which ranks arrive does not matter. This is the role
//! torch's `TCPStore` plays for `torchrun`, on a protocol of our own: a request is an op byte,
//! a length-prefixed key and, for a set, a length-prefixed value; a get is answered with the
//! length-prefixed value once it exists.
//!
//! ```
//! use burn_megatron::comm::TcpStore;
//! use std::time::Duration;
//! let server = TcpStore::serve("127.0.0.1:0".parse().unwrap()).unwrap();
//! let client = TcpStore::connect(server.addr(), Duration::from_secs(5)).unwrap();
//! client.set("nccl/tp [0, 1]", b"id").unwrap();
//! assert_eq!(client.get("nccl/tp [0, 1]", Duration::from_secs(5)).unwrap(), b"id");
//! ```

use super::{Deadline, lock};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const SET: u8 = 1;
const GET: u8 = 2;
/// Keys and values are small (ids of 128 bytes); anything larger is a foreign peer.
const MAX_LEN: u32 = 1 << 20;

/// Why a store operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Rank 0's store could not be reached before the deadline.
    #[error("cannot reach the rendezvous store at {addr} within {waited:?}: {reason}")]
    Connect {
        /// The address tried.
        addr: String,
        /// How long this rank tried.
        waited: Duration,
        /// The last connection error.
        reason: String,
    },
    /// The key was not set before the deadline.
    #[error("rendezvous key {key:?} was not set within {waited:?}")]
    Timeout {
        /// The key.
        key: String,
        /// How long this rank waited.
        waited: Duration,
    },
    /// The connection failed or the peer spoke another protocol.
    #[error("rendezvous store at {addr}: {reason}")]
    Io {
        /// The store's address.
        addr: String,
        /// What happened.
        reason: String,
    },
}

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A client of the store (see the module docs); [`serve`](Self::serve) also starts
/// the server in this process.
#[derive(Debug)]
pub struct TcpStore {
    addr: SocketAddr,
    conn: Mutex<TcpStream>,
}

impl TcpStore {
    /// Serves a store on `bind` (port 0 picks a free one) from a background thread, and
    /// connects to it.
    pub fn serve(bind: SocketAddr) -> Result<Self, StoreError> {
        let io = |reason: String| StoreError::Io {
            addr: bind.to_string(),
            reason,
        };
        let listener = TcpListener::bind(bind).map_err(|e| io(format!("cannot listen: {e}")))?;
        let addr = listener.local_addr().map_err(|e| io(e.to_string()))?;
        let table = Arc::new(Table::default());
        std::thread::Builder::new()
            .name("rendezvous-store".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    let table = table.clone();
                    // A client that misbehaves only loses its own connection.
                    let _ = std::thread::Builder::new()
                        .name("rendezvous-client".into())
                        .spawn(move || serve_client(conn, &table));
                }
            })
            .map_err(|e| io(format!("cannot start the server thread: {e}")))?;
        let local = SocketAddr::new(
            if addr.ip().is_unspecified() {
                [127, 0, 0, 1].into()
            } else {
                addr.ip()
            },
            addr.port(),
        );
        let mut client = Self::connect(local, Duration::from_secs(10))?;
        client.addr = addr;
        Ok(client)
    }

    /// Connects to the store at `addr`, retrying until `timeout` (its server may start
    /// after this process).
    pub fn connect(
        addr: impl ToSocketAddrs + std::fmt::Display,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let start = Instant::now();
        let name = addr.to_string();
        let mut delay = Duration::from_millis(10);
        loop {
            let attempt = addr
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|mut a| a.next().ok_or_else(|| "no address".to_string()))
                .and_then(|a| {
                    let left = timeout
                        .saturating_sub(start.elapsed())
                        .max(Duration::from_millis(1));
                    TcpStream::connect_timeout(&a, left)
                        .map(|s| (a, s))
                        .map_err(|e| e.to_string())
                });
            match attempt {
                Ok((addr, conn)) => {
                    let _ = conn.set_nodelay(true);
                    return Ok(Self {
                        addr,
                        conn: Mutex::new(conn),
                    });
                }
                Err(reason) if start.elapsed() >= timeout => {
                    return Err(StoreError::Connect {
                        addr: name,
                        waited: start.elapsed(),
                        reason,
                    });
                }
                Err(_) => {
                    std::thread::sleep(delay.min(timeout.saturating_sub(start.elapsed())));
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            }
        }
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn io(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Io {
            addr: self.addr.to_string(),
            reason: e.to_string(),
        }
    }

    /// Sets `key` to `value` (a later set of the same key replaces it).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut conn = lock(&self.conn);
        let mut msg = vec![SET];
        put(&mut msg, key.as_bytes());
        put(&mut msg, value);
        conn.set_write_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| self.io(e))?;
        conn.write_all(&msg).map_err(|e| self.io(e))?;
        // The acknowledgement orders this set before any later request of this client.
        let mut ack = [0u8; 1];
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| self.io(e))?;
        conn.read_exact(&mut ack).map_err(|e| self.io(e))?;
        Ok(())
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let start = Instant::now();
        let mut conn = lock(&self.conn);
        let mut msg = vec![GET];
        put(&mut msg, key.as_bytes());
        msg.extend_from_slice(&(timeout.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        conn.write_all(&msg).map_err(|e| self.io(e))?;
        // The server answers at its own deadline; the margin covers the network.
        conn.set_read_timeout(Some(timeout.saturating_add(Duration::from_secs(5))))
            .map_err(|e| self.io(e))?;
        let mut found = [0u8; 1];
        conn.read_exact(&mut found).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => StoreError::Timeout {
                key: key.into(),
                waited: start.elapsed(),
            },
            _ => self.io(e),
        })?;
        if found[0] == 0 {
            return Err(StoreError::Timeout {
                key: key.into(),
                waited: start.elapsed(),
            });
        }
        take(&mut *conn).map_err(|e| self.io(e))
    }
}

fn put(msg: &mut Vec<u8>, bytes: &[u8]) {
    msg.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    msg.extend_from_slice(bytes);
}

fn take(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len);
    if len > MAX_LEN {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a field of {len} bytes: not a burn-megatron store peer"),
        ));
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// Answers one client's requests until it disconnects or speaks another protocol.
fn serve_client(mut conn: TcpStream, table: &Table) {
    let _ = conn.set_nodelay(true);
    let mut op = [0u8; 1];
    while conn.read_exact(&mut op).is_ok() {
        let Ok(key) = take(&mut conn).map(|k| String::from_utf8_lossy(&k).into_owned()) else {
            return;
        };
        let reply = match op[0] {
            SET => {
                let Ok(value) = take(&mut conn) else { return };
                lock(&table.values).insert(key, value);
                table.changed.notify_all();
                vec![1]
            }
            GET => {
                let mut ms = [0u8; 8];
                if conn.read_exact(&mut ms).is_err() {
                    return;
                }
                // The client's wait, whatever it is: one past what an `Instant` holds is no
                // deadline rather than an overflow.
                let deadline = Deadline::from_now(Duration::from_millis(u64::from_le_bytes(ms)));
                let mut values = lock(&table.values);
                loop {
                    if let Some(v) = values.get(&key) {
                        let mut reply = vec![1];
                        put(&mut reply, v);
                        break reply;
                    }
                    let now = Instant::now();
                    if deadline.passed(now) {
                        break vec![0];
                    }
                    let left = deadline.left(now);
                    values = table
                        .changed
                        .wait_timeout(values, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            _ => return,
        };
        if conn.write_all(&reply).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
