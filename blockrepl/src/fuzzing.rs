// SPDX-License-Identifier: Apache-2.0
//! Fuzz cases over what an unauthenticated replication peer controls,
//! shared by the cargo-fuzz targets in `fuzz/` (each a one-line call) and
//! the property tests below. Each case panics only when an invariant breaks.

use crate::net::{LinkProtection, MAGIC, NONCE, Secret, client_handshake, server_handshake};

fn secret(sel: u8) -> Option<Secret> {
    let p = [
        LinkProtection::Auto,
        LinkProtection::Encrypted,
        LinkProtection::Checksummed,
    ][usize::from(sel % 3)];
    Secret::new(b"fuzz-replication-secret".to_vec())
        .ok()
        .map(|s| s.with_protection(p))
}

fn runtime() -> Option<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().build().ok()
}

/// The replica server's side of the handshake against a hostile client
/// (first byte: policy, loopback, and whether the protocol magic is put
/// in front of the rest). Without the secret the client can never get a
/// session; the server answers at most one hello (nonce, mode, proof) and
/// never offers weaker protection than the client asked for.
pub fn server_handshake_case(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let (Some(secret), Some(rt)) = (secret(sel), runtime()) else {
        return;
    };
    let mut input = Vec::new();
    if sel & 8 != 0 {
        input.extend_from_slice(MAGIC);
    }
    input.extend_from_slice(rest);
    let mut out = Vec::new();
    let r = rt.block_on(server_handshake(
        &input[..],
        &mut out,
        &secret,
        sel & 4 != 0,
    ));
    assert!(r.is_err(), "a session without the secret");
    if let Err(e) = r {
        assert!(!e.to_string().is_empty());
    }
    let hello = 8 + NONCE + 1;
    if input.len() >= hello && input.starts_with(MAGIC) && input[hello - 1] <= 1 {
        assert_eq!(out.len(), NONCE + 1 + 32, "one server hello");
        assert!(
            out[NONCE] <= input[hello - 1],
            "server weakened the protection"
        );
    } else {
        assert!(out.is_empty(), "answered a bad hello");
    }
}

/// The client's side against a hostile server (or a man in the middle):
/// whatever comes back, the client never gets a session and never sends
/// its own proof to a server that did not prove the secret.
pub fn client_handshake_case(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let (Some(secret), Some(rt)) = (secret(sel), runtime()) else {
        return;
    };
    let mut out = Vec::new();
    let r = rt.block_on(client_handshake(rest, &mut out, &secret, sel & 4 != 0));
    assert!(
        r.is_err(),
        "a session with a server that does not hold the secret"
    );
    assert_eq!(out.len(), 8 + NONCE + 1, "only the hello was sent");
    assert!(out.starts_with(MAGIC));
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_hello_gets_exactly_one_answer() {
        let mut d = vec![8u8 | 2];
        d.extend([7u8; NONCE]);
        d.push(1);
        d.extend([0u8; 32]);
        server_handshake_case(&d);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn fuzz_server_handshake(sel in any::<u8>(), want in 0u8..3, body in prop::collection::vec(any::<u8>(), 0..80)) {
            // Mostly a well-formed hello (magic, nonce, mode) and a forged proof.
            let mut d = vec![sel | 8];
            d.extend(body.iter().take(NONCE));
            d.resize(1 + NONCE.min(body.len().max(NONCE)), 0);
            d.push(want);
            d.extend(body.iter().skip(NONCE));
            server_handshake_case(&d);
        }

        #[test]
        fn fuzz_client_handshake(sel in any::<u8>(), body in prop::collection::vec(any::<u8>(), 0..100)) {
            let mut d = vec![sel];
            d.extend(body);
            client_handshake_case(&d);
        }
    }
}
