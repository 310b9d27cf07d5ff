//! The splice of states (live pieces, tails, grafts) on states built from the input: two
//! synthetic states of fuzzed shapes (positions, sections, a sliding window's shorter
//! section, transposed V), then bytes of the input flipped into one of them, or the input
//! itself as the state. Never a panic or an allocation past the inputs' size; a state cut
//! into a head and a tail is joined back into the same state.
#![no_main]

use edgesplit_proto::splice::{self, testing};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((p, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let v_trans = p[2] & 1 == 1;
    let cells = u32::from(p[1] % 16) + 1;
    let sections = u32::from(p[3] % 3) + 1;
    // A sliding window's section holds the last positions only.
    let window = u32::from(p[5] % 4);
    let mut spans = vec![(0, cells); sections as usize];
    if window > 0 && window < cells {
        spans.push((cells - window, window));
    }
    let mut a = testing::windowed(&spans, v_trans);
    let first = u32::from(p[0] % 8);
    let mut b = testing::synthetic(first, u32::from(p[4] % 8) + 1, v_trans, sections);
    let pristine = p[6] & 3 == 0;
    if p[6] & 3 == 3 {
        a = rest.to_vec();
    } else if !pristine {
        let target = if p[6] & 3 == 1 { &mut a } else { &mut b };
        for flip in rest.chunks_exact(3) {
            let at = usize::from(u16::from_le_bytes([flip[0], flip[1]])) % target.len();
            target[at] ^= flip[2];
        }
    }
    let n = usize::from(p[7] % 20);
    for s in [&a, &b] {
        let _ = splice::span(s);
        let _ = splice::narrowest(s);
        let _ = splice::common_start(s);
        let _ = splice::is_linear(s);
        let _ = splice::head_digest(s, n);
    }
    if let (Ok(h), Ok(t)) = (splice::head(&a, n), splice::tail(&a, n)) {
        let joined = splice::append(&h, &t);
        if pristine {
            assert_eq!(joined.expect("a head and its tail join"), a);
        }
        let _ = splice::graft(&a, &t, Vec::new());
    }
    let _ = splice::graft(&a, &b, Vec::new());
    let _ = splice::append(&a, &b);
    let _ = splice::follows(&a, &b);
    let _ = splice::join(&[&a, &b], Vec::new());
    let _ = splice::join_from(&[&b, &a], first as usize, Vec::new());
});
