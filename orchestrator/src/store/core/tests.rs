// SPDX-License-Identifier: Apache-2.0
use super::*;

#[test]
fn continue_tokens_round_trip() {
    let k = ("g".into(), "K".into(), "ns".into(), "a-b".into());
    assert_eq!(
        decode_continue(&encode_continue(&k)).unwrap(),
        ("ns".into(), "a-b".into())
    );
    assert!(decode_continue("zz").is_err());
    assert!(decode_continue("abc").is_err());
}
