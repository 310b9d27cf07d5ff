//! The state layout walk (the receiver's check of a state's tensor descriptors) on
//! synthetic states with fuzzed bytes flipped in, or on the input itself: never a panic;
//! `describe_within` never returns more descriptors than its limit (it stops before
//! allocating more; an unknown layout is one opaque descriptor), and what it returns is
//! what `describe` returns.
#![no_main]

use edgesplit_proto::layout;
use edgesplit_proto::splice::testing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((p, rest)) = data.split_first_chunk::<4>() else {
        return;
    };
    let state = if p[0] & 1 == 1 {
        rest.to_vec()
    } else {
        let mut s = testing::synthetic(
            u32::from(p[1] % 4),
            u32::from(p[2] % 12) + 1,
            p[0] & 2 == 2,
            u32::from(p[0] >> 6) + 1,
        );
        for flip in rest.chunks_exact(3) {
            let at = usize::from(u16::from_le_bytes([flip[0], flip[1]])) % s.len();
            s[at] ^= flip[2];
        }
        s
    };
    let limit = usize::from(p[3]);
    let whole = layout::describe(&state);
    match layout::describe_within(&state, limit) {
        // An unknown layout is one opaque descriptor, whatever the limit.
        Ok(l) => {
            assert!(l.descriptors.len() <= limit.max(1));
            assert_eq!(l.descriptors, whole.descriptors);
        }
        // Stopped at the limit (a malformed part past it would make `describe` opaque).
        Err(_) => {}
    }
    let _ = layout::describe_state(&state);
    let _ = layout::describe_sections(&state);
    let _ = layout::sections_v4_to_v3(&state);
});
