//! What this build computes with: the build id a handoff peer must share (the llama.cpp
//! version and the ggml build options that change numerics on the same hardware) and the
//! device it may not (CPU architecture, ggml backends, CPU kernels). The rule between the
//! two is PROTOCOL.md's "Compatibility"; the handshake compares the build id only.

use std::ffi::CStr;

use llama_cpp_sys_2 as sys;

/// The bindings crate, which pins one llama.cpp commit: the state format of every export.
/// Kept in step with the workspace's `=` pin of `llama-cpp-sys-2` (a unit test checks
/// Cargo.lock).
pub const BINDINGS: &str = "llama-cpp-sys-2 0.1.161";

/// ggml CPU features that are build switches changing the kernels (so the numbers) on the
/// same hardware: llamafile's sgemm, KleidiAI's ARM kernels, weight repacking. Named in the
/// build id, on or off.
const NUMERIC_OPTIONS: [&str; 3] = ["LLAMAFILE", "KLEIDIAI", "REPACK"];
/// ggml CPU features that change nothing computed (threading).
const NEUTRAL: [&str; 1] = ["OPENMP"];
/// The vendored llama.cpp's own switches (patches/), each named in the build id with its
/// value, or with what a stock ggml does where the feature is absent:
/// - `FA_SPLIT_KV`: whether flash attention splits one query's cells among threads. The
///   vendored ggml never does (ggml-cpu-fa-no-split-kv.patch), so a decode step's sums follow
///   neither the thread count nor where the cells sit: `off`. A stock ggml: `per-thread`
///   (answers that follow `--threads` past 512 cells).
/// - `MATH`: how the kernels' float functions are computed. The vendored llama.cpp takes
///   them from the double functions, rounded, and fuses no multiply-add the source does not
///   write (llama-cpp-det-math.patch), so glibc and musl builds, GCC and Clang ones, round
///   alike: `det`. A stock one: `libm` (the C library's float functions).
const SWITCHES: [(&str, &str); 2] = [("FA_SPLIT_KV", "per-thread"), ("MATH", "libm")];

/// This build and the device it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    /// What a handoff peer must share: `llama-cpp-sys-2 0.1.161, ggml 0.26.0, LLAMAFILE on,
    /// KLEIDIAI off, REPACK off, FA_SPLIT_KV off, MATH det`.
    pub build_id: String,
    /// The CPU architecture (`x86_64`, `aarch64`).
    pub arch: String,
    /// The ggml backends that compute (not RPC, a client) and the CPU kernels compiled in:
    /// `CPU: SSE3 SSSE3 AVX AVX2 F16C FMA BMI2`.
    pub kernels: String,
}

/// One ggml backend's name and features (`ggml_backend_get_features`).
struct Backend {
    name: String,
    features: Vec<(String, String)>,
}

fn text(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: ggml returns NUL-terminated static strings (names, versions, features).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The registered ggml backends and their features. Called on the engine's owner thread.
fn backends() -> Vec<Backend> {
    let mut out = Vec::new();
    // SAFETY: the registry is built statically; indices below its count are valid, and a
    // features list ends with a null name.
    unsafe {
        for i in 0..sys::ggml_backend_reg_count() {
            let reg = sys::ggml_backend_reg_get(i);
            let name = text(sys::ggml_backend_reg_name(reg));
            let mut features = Vec::new();
            let f =
                sys::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_get_features".as_ptr());
            if !f.is_null() {
                let get: unsafe extern "C" fn(
                    sys::ggml_backend_reg_t,
                ) -> *mut sys::ggml_backend_feature = std::mem::transmute(f);
                let mut p = get(reg);
                while !p.is_null() && !(*p).name.is_null() {
                    features.push((text((*p).name), text((*p).value)));
                    p = p.add(1);
                }
            }
            out.push(Backend { name, features });
        }
    }
    out
}

/// Reads this build's platform. Called on the engine's owner thread.
pub(crate) fn read() -> Platform {
    // Not `ggml_commit()`: ggml's CMake asks git for the commit of whatever repository
    // encloses the source, which for a copied crate (the aarch64 build's patched copy
    // under target-aarch64/) is ours, and for the registry's copy is "unknown". The
    // bindings version pins the commit.
    // SAFETY: a static string.
    let version = unsafe { text(sys::ggml_version()) };
    describe(&version, &backends())
}

/// The platform from what ggml reports (apart, for tests).
fn describe(version: &str, backends: &[Backend]) -> Platform {
    let cpu = backends.iter().find(|b| b.name == "CPU");
    let has = |name: &str| cpu.is_some_and(|b| b.features.iter().any(|(n, _)| n == name));
    let mut build_id = format!("{BINDINGS}, ggml {version}");
    for o in NUMERIC_OPTIONS {
        build_id.push_str(&format!(", {o} {}", if has(o) { "on" } else { "off" }));
    }
    for (switch, stock) in SWITCHES {
        let value = cpu
            .and_then(|b| b.features.iter().find(|(n, _)| n == switch))
            .map_or(stock, |(_, v)| v.as_str());
        build_id.push_str(&format!(", {switch} {value}"));
    }
    let mut kernels = Vec::new();
    for b in backends.iter().filter(|b| b.name != "RPC") {
        if b.name != "CPU" {
            kernels.push(b.name.clone());
            continue;
        }
        let isa: Vec<String> = b
            .features
            .iter()
            .filter(|(n, _)| {
                !NUMERIC_OPTIONS.contains(&n.as_str())
                    && !NEUTRAL.contains(&n.as_str())
                    && !SWITCHES.iter().any(|(s, _)| s == n)
            })
            .map(|(n, v)| {
                if v == "1" {
                    n.clone()
                } else {
                    format!("{n}={v}")
                }
            })
            .collect();
        kernels.push(format!("CPU: {}", isa.join(" ")));
    }
    Platform {
        build_id,
        arch: std::env::consts::ARCH.to_string(),
        kernels: kernels.join("; "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(name: &str, features: &[(&str, &str)]) -> Backend {
        Backend {
            name: name.into(),
            features: features
                .iter()
                .map(|(n, v)| ((*n).to_string(), (*v).to_string()))
                .collect(),
        }
    }

    #[test]
    fn build_id_names_the_version_and_the_numeric_options_not_the_cpu() {
        let x86 = [
            backend(
                "CPU",
                &[
                    ("AVX2", "1"),
                    ("FMA", "1"),
                    ("LLAMAFILE", "1"),
                    ("OPENMP", "1"),
                    ("FA_SPLIT_KV", "off"),
                    ("MATH", "det"),
                ],
            ),
            backend("RPC", &[]),
        ];
        let arm = [
            backend(
                "CPU",
                &[
                    ("NEON", "1"),
                    ("DOTPROD", "1"),
                    ("SVE_CNT", "16"),
                    ("LLAMAFILE", "1"),
                    ("FA_SPLIT_KV", "off"),
                    ("MATH", "det"),
                ],
            ),
            backend("RPC", &[]),
        ];
        let a = describe("0.26.0", &x86);
        let b = describe("0.26.0", &arm);
        assert_eq!(
            a.build_id,
            "llama-cpp-sys-2 0.1.161, ggml 0.26.0, LLAMAFILE on, KLEIDIAI off, REPACK off, \
             FA_SPLIT_KV off, MATH det"
        );
        // Another CPU is the same build; its kernels differ and are reported.
        assert_eq!(a.build_id, b.build_id);
        assert_eq!(a.kernels, "CPU: AVX2 FMA");
        assert_eq!(b.kernels, "CPU: NEON DOTPROD SVE_CNT=16");
        // Repacking or another ggml is another build.
        let repack = [backend(
            "CPU",
            &[("AVX2", "1"), ("LLAMAFILE", "1"), ("REPACK", "1")],
        )];
        assert!(describe("0.26.0", &repack).build_id.contains("REPACK on"));
        // A stock ggml (its split-KV chunks follow the thread count, its float functions
        // the C library's) is another build.
        assert!(describe("0.26.0", &repack)
            .build_id
            .ends_with("FA_SPLIT_KV per-thread, MATH libm"));
        assert_ne!(describe("0.27.0", &x86).build_id, a.build_id);
        // Another backend is named before the CPU's kernels.
        let cuda = [
            backend("CUDA", &[("ARCHS", "890")]),
            backend("CPU", &[("AVX2", "1")]),
        ];
        assert_eq!(describe("0.26.0", &cuda).kernels, "CUDA; CPU: AVX2");
    }

    #[test]
    fn bindings_match_the_locked_crate() {
        let lock = include_str!("../../Cargo.lock");
        let version = BINDINGS.rsplit(' ').next().unwrap();
        let needle = format!("name = \"llama-cpp-sys-2\"\nversion = \"{version}\"");
        assert!(lock.contains(&needle), "Cargo.lock does not pin {BINDINGS}");
    }
}
