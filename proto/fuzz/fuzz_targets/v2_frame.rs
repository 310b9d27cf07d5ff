//! The V2 frame decoder on arbitrary bytes, with and without a session key: never a
//! panic or an allocation past the cap, and every frame it accepts re-encodes to bytes that
//! decode to the same frame.
#![no_main]

use bytes::BytesMut;
use edgesplit_proto::frame::{decode_keyed, encode_keyed, Check};
use libfuzzer_sys::fuzz_target;

/// Small, so the cap is exercised too.
const CAP: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    for k in [Check::Sha256, Check::Hmac([0x42u8; 32])] {
        let mut buf = BytesMut::from(data);
        // A stream may hold several frames.
        while !buf.is_empty() {
            match decode_keyed(&mut buf, CAP, &k) {
                Ok(Some(frame)) => {
                    let mut again = BytesMut::new();
                    encode_keyed(&frame, &mut again, CAP, &k).expect("a decoded frame re-encodes");
                    let back = decode_keyed(&mut again, CAP, &k)
                        .expect("re-encoded bytes decode")
                        .expect("a whole frame");
                    assert_eq!(back, frame);
                    assert!(again.is_empty());
                }
                Ok(None) | Err(_) => break,
            }
        }
    }
});
