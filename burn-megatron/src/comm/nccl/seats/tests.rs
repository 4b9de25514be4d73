use super::*;

fn seat(host: &str, set: bool, device: u8) -> Seat {
    Seat {
        host: host.into(),
        host_id_set: set,
        device: [device; 16],
    }
}

#[test]
fn a_seat_survives_the_wire_and_a_long_host_is_cut() {
    let s = seat("node-3", true, 7);
    let b = s.to_bytes();
    assert_eq!(b.len(), SEAT_BYTES);
    assert_eq!(Seat::from_bytes(&b).unwrap(), s);
    let long = seat(&"h".repeat(1000), false, 1);
    let back = Seat::from_bytes(&long.to_bytes()).unwrap();
    assert_eq!(back.host.len(), HOST_MAX);
    assert!(Seat::from_bytes(&b[..100]).is_err());
}

/// One rank per GPU, or one GPU each on two hosts: nothing changes.
#[test]
fn ranks_on_their_own_devices_keep_their_host() {
    let one_node = [seat("n", false, 0), seat("n", false, 1)];
    let two_nodes = [seat("a", false, 0), seat("b", false, 0)];
    for seats in [&one_node[..], &two_nodes[..]] {
        for r in 0..2 {
            assert_eq!(host_id_for(r, seats), Ok(None));
        }
    }
}

/// Four ranks, three on GPU 0 and one on GPU 1 of one host: the three get host ids of
/// their own, all different; the fourth keeps the host's.
#[test]
fn ranks_that_share_a_device_get_host_ids_of_their_own() {
    let seats = [
        seat("n", false, 0),
        seat("n", false, 0),
        seat("n", false, 1),
        seat("n", false, 0),
    ];
    let ids: Vec<Option<String>> = (0..4).map(|r| host_id_for(r, &seats).unwrap()).collect();
    assert_eq!(ids[2], None);
    let given: std::collections::HashSet<_> = [0, 1, 3].map(|r| ids[r].clone().unwrap()).into();
    assert_eq!(given.len(), 3, "{ids:?}");
    assert!(given.iter().all(|id| id.starts_with("n/")), "{ids:?}");
}

/// The user's one NCCL_HOSTID on ranks that share a device: an error naming the variable
/// and the ranks, on each of them.
#[test]
fn one_user_host_id_on_a_shared_device_is_an_error() {
    let seats = [seat("job", true, 0), seat("job", true, 0)];
    for r in 0..2 {
        let e = host_id_for(r, &seats).unwrap_err();
        assert!(e.contains("NCCL_HOSTID"), "{e}");
        assert!(e.contains("[0, 1]"), "{e}");
        assert!(e.contains("Duplicate GPU"), "{e}");
    }
}

/// Different NCCL_HOSTIDs set by the user (as scripts/nccl_check.sh does) already separate
/// the ranks: nothing changes.
#[test]
fn the_users_own_distinct_host_ids_are_kept() {
    let seats = [seat("h-0", true, 0), seat("h-1", true, 0)];
    assert_eq!(host_id_for(0, &seats), Ok(None));
    assert_eq!(host_id_for(1, &seats), Ok(None));
}

#[test]
fn a_uuid_prints_as_cuda_does() {
    let u: [u8; 16] = std::array::from_fn(|i| i as u8);
    assert_eq!(uuid_text(&u), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
}
