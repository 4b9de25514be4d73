use super::*;

fn server() -> TcpStore {
    TcpStore::serve("127.0.0.1:0".parse().unwrap()).unwrap()
}

#[test]
fn a_get_waits_for_the_set_of_another_client() {
    let server = server();
    let addr = server.addr();
    let reader = std::thread::spawn(move || {
        let c = TcpStore::connect(addr, Duration::from_secs(5)).unwrap();
        c.get("k", Duration::from_secs(10)).unwrap()
    });
    std::thread::sleep(Duration::from_millis(100));
    let writer = TcpStore::connect(addr, Duration::from_secs(5)).unwrap();
    writer.set("k", &[7; 128]).unwrap();
    assert_eq!(reader.join().unwrap(), vec![7; 128]);
    // Later readers see it at once, the writer too.
    assert_eq!(server.get("k", Duration::ZERO).unwrap(), vec![7; 128]);
}

#[test]
fn a_key_nobody_sets_times_out_naming_it() {
    let server = server();
    let start = Instant::now();
    let err = server
        .get("nccl/dp [0, 2]", Duration::from_millis(200))
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Timeout { key, .. } if key == "nccl/dp [0, 2]"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
    // The connection is still usable after a timeout.
    server.set("x", b"1").unwrap();
    assert_eq!(server.get("x", Duration::from_secs(1)).unwrap(), b"1");
}

#[test]
fn a_client_retries_until_the_server_starts_and_gives_up_at_its_deadline() {
    // Reserve a free port, release it, and start the server there a little later.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let s = TcpStore::serve(addr).unwrap();
        s.set("ready", b"yes").unwrap();
        std::thread::sleep(Duration::from_secs(2));
    });
    let client = TcpStore::connect(addr, Duration::from_secs(10)).unwrap();
    assert_eq!(client.get("ready", Duration::from_secs(5)).unwrap(), b"yes");
    late.join().unwrap();

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let err =
        TcpStore::connect(format!("127.0.0.1:{port}"), Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

/// `Duration::MAX` (no deadline) is a wait like any other, not an overflow panic.
#[test]
fn a_get_without_a_deadline_waits_for_the_set() {
    let server = server();
    let addr = server.addr();
    let reader = std::thread::spawn(move || {
        let c = TcpStore::connect(addr, Duration::MAX).unwrap();
        c.get("k", Duration::MAX)
    });
    std::thread::sleep(Duration::from_millis(100));
    server.set("k", b"v").unwrap();
    assert_eq!(reader.join().unwrap().unwrap(), b"v");
}

/// The server takes the wait a client asks for, however large, without overflowing.
#[test]
fn the_largest_deadline_a_client_can_send_is_served() {
    let server = server();
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    let mut msg = vec![GET];
    put(&mut msg, b"late");
    msg.extend_from_slice(&u64::MAX.to_le_bytes());
    raw.write_all(&msg).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    server.set("late", b"here").unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut found = [0u8; 1];
    raw.read_exact(&mut found).unwrap();
    assert_eq!(found, [1]);
    assert_eq!(take(&mut raw).unwrap(), b"here");
}

#[test]
fn a_foreign_peer_loses_only_its_connection() {
    let server = server();
    let mut foreign = TcpStream::connect(server.addr()).unwrap();
    foreign.write_all(&[GET, 0xff, 0xff, 0xff, 0xff]).unwrap();
    let mut buf = [0u8; 1];
    foreign
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert_eq!(
        foreign.read(&mut buf).unwrap_or(0),
        0,
        "the server hangs up"
    );
    server.set("still", b"up").unwrap();
    assert_eq!(server.get("still", Duration::from_secs(1)).unwrap(), b"up");
}
